"""bench_predictability: lag cosines against a direct loop, and the ring-buffer measurement against
the same cosines over every gradient of the run kept at once."""
from __future__ import annotations

import math

import numpy as np
import pytest

from qatlab import config as C
from qatlab.bench.predictability import gradient_predictability, lag_cosines, real_gradients
from qatlab.data import load_dataset


def _cos(a, b):
    na, nb = np.linalg.norm(a), np.linalg.norm(b)
    return float(a @ b / (na * nb)) if na > 0 and nb > 0 else 0.0


def test_lag_cosines_match_a_direct_loop():
    g = np.random.default_rng(0).standard_normal((12, 7))
    g[4] = 0.0                                   # a zero gradient counts as cosine 0
    got = lag_cosines(g, (1, 3, 11, 12))
    for k in (1, 3, 11):
        assert got[k] == pytest.approx(np.mean([_cos(g[t], g[t + k]) for t in range(12 - k)]), abs=1e-12)
    assert math.isnan(got[12])


def _small_config() -> C.ExperimentConfig:
    cfg = C.ExperimentConfig()
    cfg.model.hidden = [16]
    cfg.optim.epochs = 2
    return cfg


def test_gradient_predictability_matches_the_cosines_of_every_gradient_kept():
    cfg = _small_config()
    got = gradient_predictability(cfg, lags=(1, 2, 5))
    g = np.array([x.astype(np.float64) for x in real_gradients(cfg)])   # every gradient of the run
    assert got["steps"] == len(g) == 2 * math.ceil(load_dataset(cfg.data).n_train / cfg.optim.batch_size)
    want = lag_cosines(g, (1, 2, 5))
    for k in (1, 2, 5):
        assert got[f"lag_{k}"] == pytest.approx(want[k], abs=1e-9)
    m = cfg.phase.prediction.momentum
    mom = np.mean([_cos(g[t - 1] + m * (g[t - 1] - g[t - 2]), g[t]) for t in range(2, len(g))])
    assert got["momentum"] == pytest.approx(mom, abs=1e-6)
    assert all(-1.0 <= got[k] <= 1.0 for k in ("lag_1", "lag_2", "lag_5", "momentum"))


def test_gradient_predictability_needs_cross_entropy():
    cfg = _small_config()
    cfg.optim.loss = "mse"
    with pytest.raises(ValueError, match="cfg.optim.loss"):
        gradient_predictability(cfg)
    with pytest.raises(ValueError, match="cfg.optim.loss"):
        next(real_gradients(cfg))
