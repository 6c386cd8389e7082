"""bench_predictability: lag cosines against a direct loop, and the whole measurement against a
slow reference that keeps every gradient of the run."""
from __future__ import annotations

import math

import numpy as np
import pytest

from qatlab import config as C
from qatlab.bench_predictability import gradient_predictability, lag_cosines
from qatlab.data import load_dataset
from qatlab.nn import cross_entropy_loss
from qatlab.optim import make_optimizer
from qatlab.train.build import build_model


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


def _all_gradients(cfg):
    """Every real gradient of the run, by the plain loop the module describes."""
    data = load_dataset(cfg.data)
    mlp = build_model(cfg, data.n_features, data.n_outputs)
    bs = cfg.optim.batch_size
    opt = make_optimizer(cfg.optim, mlp.flat_params(), math.ceil(data.n_train / bs))
    scratch, grads = mlp.scratch(bs), mlp.gradients(bs)
    rng = np.random.default_rng(cfg.optim.seed)
    out = []
    for _ in range(cfg.optim.epochs):
        order = rng.permutation(data.n_train)
        for pos in range(0, data.n_train, bs):
            idx = order[pos: pos + bs]
            xb = np.ascontiguousarray(data.X_train[idx])
            cross_entropy_loss(mlp.forward(xb, scratch), data.y_train[idx], grads.d_output_mut())
            mlp.backward(xb, scratch, grads, need_input_grad=False)
            out.append(grads.flat().astype(np.float64))
            opt.step(grads.flat())
    return np.array(out)


def test_gradient_predictability_matches_a_reference_that_keeps_every_gradient():
    cfg = _small_config()
    got = gradient_predictability(cfg, lags=(1, 2, 5))
    g = _all_gradients(cfg)
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
