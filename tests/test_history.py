"""Phase training's trend-entry stores (PhaseConfig.history_storage): sizes, bytes, the memory estimate."""
from __future__ import annotations

import numpy as np
import pytest

import qatlab as ql
from qatlab.config import PhaseConfig, PredictionConfig, VSAConfig
from qatlab.train.history import history_nbytes, make_history
from qatlab.train.trainer import Trainer
from qatlab.train.predictors import FloatHistory, ParamLayout, make_predictor
from qatlab.train.ternary_accumulator import TernaryGradientAccumulator
from qatlab.train.vsa import VSAHistory

LAYOUT = ParamLayout([("w0", (64, 33)), ("b0", (33,)), ("w1", (33, 10)), ("b1", (10,))])
KINDS = {"float32": FloatHistory, "ternary": TernaryGradientAccumulator, "vsa": VSAHistory}


@pytest.mark.parametrize("predictor, capacity", [("momentum", 2), ("least_squares", 7)])
@pytest.mark.parametrize("storage", list(KINDS))
def test_store_kind_capacity_and_bytes(storage, predictor, capacity):
    cfg = PhaseConfig(predictor=predictor, history_storage=storage, prediction=PredictionConfig(history_size=7),
                      vsa=VSAConfig(dimension=512))
    hist = make_history(cfg, LAYOUT)
    assert type(hist) is KINDS[storage] and hist.capacity == capacity and hist.storage == storage
    assert hist.nbytes == history_nbytes(cfg, LAYOUT.sizes)
    expected = {"float32": capacity * 4 * LAYOUT.size,
                "ternary": capacity * (sum((n + 3) // 4 for n in LAYOUT.sizes) + 4 * 4),
                "vsa": capacity * 4 * 512 + 4 * 512 + 8 * 512 + 32}[storage]
    assert hist.nbytes == expected
    assert make_predictor(predictor, LAYOUT.size, cfg.prediction, hist).nbytes == 4 * 4 * LAYOUT.size \
        + capacity * 8 + expected


def test_a_store_of_the_wrong_size_is_refused():
    hist = FloatHistory(3, LAYOUT.size)
    with pytest.raises(ValueError, match="history: must hold 2 entries, holds 3"):
        make_predictor("momentum", LAYOUT.size, PredictionConfig(), hist)


def test_float_history_weighted_sum():
    hist = FloatHistory(3, 5)
    rows = np.arange(15, dtype=np.float32).reshape(3, 5)
    for slot in range(3):
        hist.write(slot, rows[slot])
    got = hist.weighted_sum(np.array([1.0, 0.0, -0.5]), np.zeros(5, np.float32))
    np.testing.assert_array_equal(got, rows[0] - 0.5 * rows[2])


@pytest.mark.parametrize("storage", list(KINDS))
def test_memory_estimate_counts_the_store(storage):
    cfg = ql.ExperimentConfig()
    cfg.model.hidden = [33]
    cfg.phase.enabled, cfg.phase.history_storage = True, storage
    est = ql.estimate_memory(cfg, n_train=1000, n_test=200, n_features=64, n_outputs=10)
    params = LAYOUT.size
    assert est["phase"] == 7 * 4 * params + history_nbytes(cfg.phase, LAYOUT.sizes)


@pytest.mark.slow
@pytest.mark.parametrize("storage", ["ternary", "vsa"])
def test_a_phase_run_keeps_its_trend_entries_in_the_store_and_says_how_big(storage):
    cfg = ql.ExperimentConfig()
    cfg.optim.epochs, cfg.model.hidden = 3, [32]
    cfg.phase.enabled, cfg.phase.history_storage, cfg.phase.predictor = True, storage, "least_squares"
    log = ql.MetricsLog()
    res = Trainer(cfg, log).run()
    assert res.status == "finished" and res.final["backward_passes"] < res.final["steps"]
    sizes = [a.size for _, a in res.model.parameters()]
    meta = log.meta["phase_history"]
    assert meta == {"storage": storage, "bytes": history_nbytes(cfg.phase, sizes),
                    "float32_bytes": 5 * 4 * sum(sizes)}
    assert res.final["history_bytes"] == meta["bytes"] == log.meta["phase_stats"]["history_bytes"]
    assert meta["bytes"] < meta["float32_bytes"] if storage == "ternary" else meta["bytes"] > 0
