"""Runs of phase-training steps in one call (PhaseTrainer.backward_run / predicted_steps, through
PhaseStepper and FusedStep.steps) give the step-by-step numbers, bit for bit."""
from __future__ import annotations

import dataclasses
import math
from types import SimpleNamespace

import numpy as np
import pytest

from qatlab.config import PhaseConfig
from qatlab.fused import FusedStep
from qatlab.nn import Mlp
from qatlab.optim import Adam
from qatlab.quant import TernaryQuantizer
from qatlab.train.experiment import _Loss
from qatlab.train.phase_loop import PhaseStepper

SIZES, B, N = [12, 16, 5], 4, 64


def _stepper(predictor="momentum", warmup=0):
    mlp = Mlp(SIZES, seed=2, weight_quantizers=[TernaryQuantizer(), TernaryQuantizer()])
    scratch, grads = mlp.scratch(B), mlp.gradients(B)
    opt = Adam(mlp.flat_params(), lr=0.02)
    cfg = PhaseConfig(warmup_steps=warmup, full_steps=3, predict_steps=9, correct_every=4, max_grad_norm=0.3,
                      loss_threshold=0.05, predictor=predictor)
    loss = _Loss("cross_entropy", SimpleNamespace(task="classification", n_outputs=SIZES[-1]), B)
    return PhaseStepper(cfg, mlp, scratch, grads, loss, FusedStep(mlp, scratch, grads, opt)), opt


def _data():
    rng = np.random.default_rng(0)
    return rng.standard_normal((N, SIZES[0])).astype(np.float32), rng.integers(0, SIZES[-1], N)


def _state(stepper, opt):
    pred = stepper.trainer._predictor
    stats = dataclasses.asdict(stepper.trainer.get_stats())
    for key in ("backward_seconds", "predict_seconds", "wallclock_speedup"):
        stats.pop(key)
    return (stepper.mlp.flat_params().copy(), [s.copy() for s in opt._state], opt.t, stepper.grads.flat().copy(),
            pred.anchor.copy(), pred.block_sum.copy(), pred.trend.copy(), pred.correction.copy(), pred.anchor_step,
            pred.block_count, pred.block_steps, pred.gain, stats, stepper.trainer.phase_lengths)


def _same(a, b):
    for x, y in zip(a, b):
        if isinstance(x, np.ndarray):
            np.testing.assert_array_equal(x, y)
        elif isinstance(x, list):
            _same(x, y)
        else:
            assert x == y or (isinstance(x, float) and math.isnan(x) and math.isnan(y)), (x, y)


@pytest.mark.parametrize("predictor, warmup, limit", [("momentum", 0, 5), ("least_squares", 2, 3),
                                                       ("momentum", 5, 100)])
def test_runs_match_step_by_step(predictor, warmup, limit):
    X, y = _data()
    (one, opt1), (runs, opt2) = _stepper(predictor, warmup), _stepper(predictor, warmup)
    update = lambda flat, real, scale: opt1.step(flat, grad_scale=scale)      # noqa: E731
    order = np.random.default_rng(1).integers(0, N, 200 * B)
    losses1, losses2, made = [], [], {"backward": 0, "predicted": 0}
    step = 0
    while step < 150:
        idx = order[step * B:]
        if n := runs.backward_run_length(limit):
            assert runs.backward_run(X, idx[:n * B], n, labels=y) == n
            losses2 += runs.fused.losses.tolist()
            made["backward"] += n
        elif n := runs.predicted_run_length(limit):
            runs.predicted_run(n)
            losses2 += [None] * n
            made["predicted"] += n
        else:
            n = 1
            losses2.append(runs.step(X[idx[:B]], y[idx[:B]], None, need_loss=False))
        for j in range(n):
            rows = idx[j * B:(j + 1) * B]
            losses1.append(one.step(X[rows], y[rows], update, need_loss=False))
        step += n
        _same(_state(one, opt1), _state(runs, opt2))
    assert losses1 == losses2
    assert made["backward"] > 30 and made["predicted"] > 30          # both kinds of run were made
    assert one.trainer.get_stats().cycles > 5


def test_fused_steps_stash_clip_and_accumulate():
    (a, opt1), (b, opt2) = _stepper(), _stepper()
    X, y = _data()
    idx = np.arange(5 * B, dtype=np.int64)
    n = a.mlp.num_params
    stash1, stash2 = np.zeros(n, np.float32), np.zeros(n, np.float32)
    acc1, acc2 = np.full(n, 7.0, np.float32), np.full(n, 7.0, np.float32)
    assert b.fused.steps(X, idx, 5, labels=y, stash=stash2, clip=0.3, accumulate=acc2, accumulate_fresh=True) == 5
    for j in range(5):
        rows = idx[j * B:(j + 1) * B]
        assert a.fused(X[rows], labels=y[rows], stash=stash1, clip=0.3) == b.fused.losses[j]
        assert a.fused.stash_sumsq == b.fused.stash_sumsqs[j]
        if j == 0:
            acc1[:] = stash1
        else:
            acc1 += stash1
    np.testing.assert_array_equal(stash1, stash2)
    np.testing.assert_array_equal(acc1, acc2)
    np.testing.assert_array_equal(a.mlp.flat_params(), b.mlp.flat_params())
    with pytest.raises(ValueError, match="accumulate: needs a stash"):
        b.fused.steps(X, idx, 5, labels=y, accumulate=acc2)
    with pytest.raises(ValueError, match="clip"):
        b.fused.steps(X, idx, 5, labels=y, stash=stash2, clip=-1.0)


def test_run_api_errors_leave_state_untouched():
    stepper, opt = _stepper()
    trainer = stepper.trainer
    X, y = _data()
    assert trainer.predict_run_length() == 0 and trainer.backward_run_length() == 3
    with pytest.raises(ValueError, match="count"):
        trainer.backward_run(4, lambda *a: ([], []))
    with pytest.raises(ValueError, match="count"):
        trainer.predicted_steps(1, opt, stepper.mlp.flat_params(), stepper.grads.flat())
    stepper.backward_run(X, np.arange(3 * B, dtype=np.int64), 3, labels=y)
    assert trainer.backward_run_length() == 0 and trainer.predict_run_length() == 3
    before = _state(stepper, opt)
    with pytest.raises(ValueError, match="opt"):
        trainer.predicted_steps(2, Adam([np.zeros(stepper.mlp.num_params, np.float32)]), stepper.mlp.flat_params(),
                                stepper.grads.flat())
    with pytest.raises(ValueError, match="out"):
        trainer.predicted_steps(2, opt, stepper.mlp.flat_params(), np.zeros(3, np.float32))
    _same(before, _state(stepper, opt))


def test_backward_run_stops_at_a_non_finite_loss_and_names_a_non_finite_gradient():
    stepper, opt = _stepper()
    X, y = _data()
    X[2 * B, 0] = np.nan                                   # the third step's batch
    assert stepper.backward_run(X, np.arange(3 * B, dtype=np.int64), 3, labels=y) == 3
    assert math.isnan(stepper.fused.losses[-1]) and stepper.trainer.total_step == 2

    stepper, opt = _stepper()

    def nan_gradient(stash, accumulate, fresh):          # finite losses, the second gradient not finite
        stash[5] = np.nan
        return [0.5, 0.7], [1.0, math.nan]

    with pytest.raises(ValueError, match=r"grads\['w0'\]: contains NaN or inf"):
        stepper.trainer.backward_run(2, nan_gradient)
