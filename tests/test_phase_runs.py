"""Runs of phase-training steps in one call (PhaseTrainer.backward_run / predicted_steps, through
PhaseStepper and FusedStep.steps) give the step-by-step numbers, bit for bit."""
from __future__ import annotations

import dataclasses
import math
from types import SimpleNamespace

import numpy as np
import pytest

from qatlab.kernels.fused import R_CORRECT_NS, R_PREDICT_NS
from qatlab.config import PhaseConfig
from qatlab.train.fused_step import FusedStep
from qatlab.nn import Mlp
from qatlab.optim import Adam
from qatlab.quant import TernaryQuantizer
from qatlab.train.loss import BatchLoss
from qatlab.train.rows import layer_row, layer_row_of_sums
from qatlab.train.steppers import Parts
from qatlab.train.phase_loop import PhaseStepper

SIZES, B, N = [12, 16, 5], 4, 64


class _AnyLoss:
    def __eq__(self, other):
        return isinstance(other, float) and math.isfinite(other)


ANY_LOSS = _AnyLoss()


def _stepper(predictor="momentum", warmup=0, loss="cross_entropy", first_correct_every=4):
    """A PhaseStepper on a small ternary MLP (CORRECT every 4th step; no ramp unless
    first_correct_every < 4) and its optimizer."""
    mlp = Mlp(SIZES, seed=2, weight_quantizers=[TernaryQuantizer(), TernaryQuantizer()])
    scratch, grads = mlp.scratch(B), mlp.gradients(B)
    opt = Adam(mlp.flat_params(), lr=0.02)
    cfg = PhaseConfig(warmup_steps=warmup, full_steps=3, predict_steps=9, correct_every=4, max_grad_norm=0.3,
                      loss_threshold=0.05, predictor=predictor, first_correct_every=first_correct_every)
    loss = BatchLoss(loss, SimpleNamespace(task="classification", n_outputs=SIZES[-1]), B)
    X, y = _data()
    parts = Parts(mlp, scratch, grads, opt, loss, X, y, B, every=1)
    return PhaseStepper(cfg, parts, FusedStep(mlp, scratch, grads, opt)), opt


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


def _protocol_step(stepper, opt, x, y, need_loss):
    """One step with its PREDICT steps made by hand, as the PhaseTrainer doc spells the protocol
    out (PhaseStepper.step makes them with predicted_steps)."""
    trainer = stepper.trainer
    update = lambda flat, real, scale, lr_scale: opt.step(flat, lr=opt.lr * lr_scale, grad_scale=scale)  # noqa: E731
    if not trainer.predict_run_length():
        return stepper.step(x, y, update, need_loss=need_loss)
    trainer.begin_step()
    loss = stepper._loss(x, y, backward=False) if need_loss else None
    flat = stepper.grads.flat()
    trainer.get_predicted_gradients(out=flat, clip=False)
    if trainer.clip_scale != 0.0:
        update(flat, False, trainer.clip_scale, trainer.lr_scale)
    trainer.end_step(loss)
    return loss


@pytest.mark.parametrize("predictor, warmup, limit, loss, first", [("momentum", 0, 5, "cross_entropy", 1),
                                                                    ("least_squares", 2, 3, "cross_entropy", 4),
                                                                    ("momentum", 5, 100, "cross_entropy", 2),
                                                                    ("momentum", 0, 10, "mse", 2)])
def test_runs_match_step_by_step(predictor, warmup, limit, loss, first):
    """first: first_correct_every (the CORRECT spacing's ramp: 1, 2, 3, 4 or 2, 3, 4; 4: none)."""
    X, y = _data()
    (one, opt1), (runs, opt2) = _stepper(predictor, warmup, loss, first), _stepper(predictor, warmup, loss, first)
    targets = runs.loss_fn.fused_block(y)
    order = np.random.default_rng(1).integers(0, N, 400 * B)
    rng, rng_rows = np.random.default_rng(2), np.random.default_rng(3)
    losses1, losses2 = [], []
    made = {"backward": 0, "alone": 0, "no read": 0, "rows": 0, "2+ rows": 0, "ends CORRECT": 0, "2+ CORRECT": 0,
            "short batch": 0}
    step = 0
    while step < 300:
        idx = order[step * B:]
        sizes = None                               # batch rows of each step (default B)
        if step % 7 == 3:                          # made alone; a PREDICT step measures its loss
            n, needs = 1, [True]
            losses2.append(runs.step(X[idx[:B]], y[idx[:B]], None, need_loss=True))
            made["alone"] += 1
        elif n := runs.backward_run_length(limit):
            assert runs.backward_run(X, idx[:n * B], n, **targets) == n
            losses2 += runs.fused.losses.tolist()
            made["backward"] += n
            needs = [True] * n
        else:
            n = runs.block_run_length(limit)
            rows = sorted(set(rng.integers(0, n, int(rng.integers(0, 3))).tolist()))   # steps logging a row
            corrects = [runs.trainer.block_step_is_correct(j) for j in range(n)]
            short = int(rng_rows.choice([B, B // 2]))  # an epoch's last batch may be shorter
            t_before = opt2.t
            losses, right, batch, records = runs.block_run(X, idx[:(n - 1) * B + short], n, B, rows=rows, **targets)
            dropped = len(losses) < n              # its step read the short batch: left for the next call
            n = len(losses)
            rows = [j for j in rows if j < n]
            assert [r[0] for r in records] == rows
            sizes = [B] * (n - 1) + [batch]
            needs = [corrects[j] or j in rows for j in range(n)]
            losses2 += losses
            made["no read"] += not any(needs)
            made["rows"] += len(rows) > 0
            made["2+ rows"] += len(rows) > 1
            made["ends CORRECT"] += corrects[n - 1]
            made["2+ CORRECT"] += sum(corrects[:n]) >= 2
            made["short batch"] += batch < B or dropped
            want_right = 0
        for j in range(n):
            batch_rows, t_step = idx[j * B:j * B + (sizes[j] if sizes else B)], opt1.t
            losses1.append(_protocol_step(one, opt1, X[batch_rows], y[batch_rows], need_loss=needs[j]))
            if sizes and needs[j]:
                want_right += int(np.sum(np.argmax(one.scratch.output(), axis=1) == y[batch_rows]))
            if sizes and j in rows:                # the row the kernel logged: what the live objects give
                _, loss, _, updates, sums, columns = records[rows.index(j)]
                assert t_before + updates == t_step                     # the updates made before it
                want = [layer_row(one.mlp, one.grads, one.scratch, i) for i in range(one.mlp.num_layers)]
                got = [layer_row_of_sums(one.mlp, i, sums[8 * i:8 * i + 8])[0] for i in range(one.mlp.num_layers)]
                want_columns, _ = one.row_columns(), columns.pop("speedup_wall")
                want_columns.pop("speedup_wall")
                assert (got, columns, loss) == (want, want_columns, losses1[-1])
        if sizes:
            assert right == want_right
        step += n
        _same(_state(one, opt1), _state(runs, opt2))
    assert losses1 == losses2
    if limit < 2 * 4:                                # correct_every = 4: two CORRECT steps need 5 to 8 steps
        made.pop("2+ CORRECT")
    if limit < 3:
        made.pop("2+ rows")
    assert made["backward"] > 20 and min(made.values()) > 0, made   # every kind of run was made
    assert one.trainer.get_stats().mean_loss["predict"] > 0          # PREDICT steps measured losses
    assert one.trainer.get_stats().cycles > 5


def test_fused_steps_stash_clip_and_accumulate():
    (a, _), (b, _) = _stepper(), _stepper()
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
    trainer.predicted_steps(1, opt, stepper.mlp.flat_params(), stepper.grads.flat())   # remembered by identity
    before = _state(stepper, opt)
    assert trainer.predict_block_length() == 8                     # block runs: to the block's end
    with pytest.raises(ValueError, match="count"):
        stepper.block_run(X, np.arange(9 * B, dtype=np.int64), 9, B, labels=y)
    with pytest.raises(ValueError, match="idx"):                   # the batches are checked before anything is made
        stepper.block_run(X, np.full(3 * B, N, dtype=np.int64), 3, B, labels=y)     # its step 2 is CORRECT
    with pytest.raises(ValueError, match="idx"):                   # a batch it reads is missing
        trainer.predict_block_run(3, lambda run: stepper.fused.predict_block(X, np.arange(B), B, run, labels=y))
    with pytest.raises(ValueError, match="rows"):
        trainer.predict_block_run(3, lambda run: 0, rows=[2, 1])
    with pytest.raises(ValueError, match="rows"):
        trainer.predict_block_run(3, lambda run: 0, rows=[3])
    with pytest.raises(ValueError, match="batch_size"):
        trainer.predict_block_run(3, lambda run: stepper.fused.predict_block(X, np.arange(3 * B), 0, run, labels=y))
    _same(before, _state(stepper, opt))
    stepper.block_run(X, np.arange(B, dtype=np.int64), 1, B, labels=y)   # arguments checked before are only
    before = _state(stepper, opt)                                   # remembered: other ones are checked again
    with pytest.raises(ValueError, match="out"):
        trainer.predicted_steps(1, opt, stepper.mlp.flat_params(), np.zeros(3, np.float32))
    with pytest.raises(ValueError, match="params"):
        trainer.predicted_steps(1, opt, np.zeros(3, np.float32), stepper.grads.flat())
    _same(before, _state(stepper, opt))


def test_a_lone_predict_step_with_a_non_finite_loss_makes_nothing():
    stepper, opt = _stepper()
    X, y = _data()
    stepper.backward_run(X, np.arange(3 * B, dtype=np.int64), 3, labels=y)
    before = _state(stepper, opt)
    bad = X[:B].copy()
    bad[0, 0] = np.inf
    assert math.isnan(stepper.step(bad, y[:B], None, need_loss=True))
    _same(before, _state(stepper, opt))
    assert stepper.step(X[:B], y[:B], None, need_loss=True) > 0 and stepper.trainer.total_step == 4


def test_predicted_steps_measure_books_the_first_loss_or_makes_nothing():
    stepper, opt = _stepper()
    X, y = _data()
    stepper.backward_run(X, np.arange(3 * B, dtype=np.int64), 3, labels=y)
    trainer, params, out = stepper.trainer, stepper.mlp.flat_params(), stepper.grads.flat()
    before = _state(stepper, opt)
    assert math.isnan(trainer.predicted_steps(2, opt, params, out, measure=lambda: math.nan))
    _same(before, _state(stepper, opt))                              # nothing made or booked
    assert trainer.predicted_steps(2, opt, params, out, measure=lambda: 0.25) == 0.25
    stats = trainer.get_stats()
    assert stats.predict_steps == 2 and stats.mean_loss["predict"] == 0.25 and trainer.total_step == 5
    assert trainer.predicted_steps(1, opt, params, out) is None


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


@pytest.mark.parametrize("in_runs", [False, True])
def test_predicted_steps_at_gain_zero_make_no_update(in_runs):
    """Gain 0 hands out zeros; the optimizer is left alone (Adam would otherwise coast on its momentum)."""
    stepper, opt = _stepper()
    X, y = _data()
    stepper.backward_run(X, np.arange(3 * B, dtype=np.int64), 3, labels=y)      # FULL: anchor, Adam state
    stepper.trainer._predictor.gain = 0.0
    before = (stepper.mlp.flat_params().copy(), [s.copy() for s in opt._state], opt.t)
    calls = []
    if in_runs:
        stepper.block_run(X, np.arange(3 * B, dtype=np.int64), 3, B, labels=y)
    else:
        for _ in range(3):
            stepper.step(X[:B], y[:B], lambda *a: calls.append(a), need_loss=False)
    assert not calls and stepper.trainer.get_stats().predict_steps == 3
    np.testing.assert_array_equal(stepper.mlp.flat_params(), before[0])
    for s, s0 in zip(opt._state, before[1]):
        np.testing.assert_array_equal(s, s0)
    assert opt.t == before[2] == 3
    expect = np.empty_like(stepper.grads.flat())
    stepper.trainer._predictor.predict(5, expect)                                  # the last step's prediction
    np.testing.assert_array_equal(stepper.grads.flat(), expect)


@pytest.mark.parametrize("opt", [0, 1, 2])
@pytest.mark.parametrize("max_norm, own_clip", [(0.0, 0.0), (1e9, 0.0), (0.5, 0.0), (0.0, 0.05)])
def test_predicted_steps_kernel_matches_prediction_then_update(opt, max_norm, own_clip):
    """The kernel gives the numbers of anchor_trend into out followed by the optimizer's kernel
    (SGD, momentum, Adam), step by step: in one pass while the clipping cannot bind (off, or far
    away), in three when it may (0.5 binds) or the optimizer clips on its own (own_clip)."""
    from qatlab.kernels.fused import _update, predicted_steps
    from qatlab.kernels.state import Opt
    from qatlab.kernels.phase_kernels import anchor_trend

    rng = np.random.default_rng(3)
    n, steps, gain = 500, 4, 0.3
    anchor, trend, corr = (rng.standard_normal(n).astype(np.float32) * 0.1 for _ in range(3))
    ks, cs = np.array([1.0, 2.0, 3.0, 4.0]), np.array([0.9, 0.81, 0.0, 0.6561])
    scs = np.zeros((steps, 8))
    for j in range(steps):
        t = j + 1
        adam = [0.9, 0.999, 0.01 / (1 - 0.9 ** t), (1 - 0.999 ** t) ** 0.5, 1e-8]
        scs[j] = [own_clip, 0.0, 1.0, *([0.01, 0, 0, 0, 0], [0.01, 0.9, 0, 0, 0], adam)[opt]]
    p, m, v = (rng.standard_normal(n).astype(np.float32) for _ in range(3))
    v = np.abs(v)
    p2, m2, v2 = p.copy(), m.copy(), v.copy()
    out, out2 = np.zeros(n, np.float32), np.zeros(n, np.float32)
    clipped, norm, opt_norm = predicted_steps(anchor, trend, ks, corr, cs, gain, max_norm, out, tuple(Opt(opt, m, v)), p,
                                              scs)
    ref_clipped = 0
    for j in range(steps):
        ref_norm = math.sqrt(anchor_trend(anchor, trend, ks[j], corr, cs[j], out2) * gain * gain)
        scale = 1.0
        if max_norm > 0 and ref_norm > max_norm:
            scale, ref_clipped = max_norm / (ref_norm + 1e-6), ref_clipped + 1
        ref_opt_norm = _update(Opt(opt, m2, v2), p2, out2, scs[j], scale * gain)
    assert (clipped, norm) == (ref_clipped, ref_norm) and (ref_clipped > 0) == (max_norm == 0.5)
    assert opt_norm == ref_opt_norm if own_clip else math.isnan(opt_norm) and math.isnan(ref_opt_norm)
    for a, b in ((p, p2), (m, m2), (v, v2), (out, out2)):
        np.testing.assert_array_equal(a, b)


def test_lr_scale_is_the_gain_on_predict_steps_only():
    stepper, opt = _stepper()
    trainer = stepper.trainer
    X, y = _data()
    assert trainer.lr_scale == 1.0
    stepper.backward_run(X, np.arange(3 * B, dtype=np.int64), 3, labels=y)
    trainer._predictor.gain = 0.25
    info = trainer.begin_step()
    assert info.phase.name == "PREDICT" and trainer.lr_scale == 0.25
    trainer.get_predicted_gradients(stepper.grads.flat(), clip=False)
    trainer.end_step(None)
    assert trainer.lr_scale == 1.0                       # between steps
    lr0, t0 = opt.lr, opt.t
    stepper.block_run(X, np.arange(2 * B, dtype=np.int64), 2, B, labels=y)
    assert opt.t == t0 + 2 and opt.last_lr == pytest.approx(lr0 * 0.25)


@pytest.mark.parametrize("count, measure, bad_step", [(4, False, 3), (2, True, 1), (1, True, 0), (8, False, 7),
                                                     (8, False, 3)])
def test_a_block_run_stops_at_a_non_finite_loss_and_books_the_steps_before_it(count, measure, bad_step):
    """Step ``bad_step`` (CORRECT at 3 and 7, or a PREDICT step measuring its loss) has an inf
    input: it makes and books nothing, the steps before it are made as step by step and the ones
    after it are not made."""
    X, y = _data()
    (one, opt1), (runs, opt2) = _stepper(), _stepper()
    idx = np.arange(3 * B, dtype=np.int64)
    one.backward_run(X, idx, 3, labels=y)
    runs.backward_run(X, idx, 3, labels=y)
    order = np.arange(count * B, dtype=np.int64) % N
    X = np.concatenate([X, np.full((B, X.shape[1]), np.inf, np.float32)])
    y = np.concatenate([y, y[:B]])
    order[bad_step * B:(bad_step + 1) * B] = np.arange(N, N + B)     # only the bad step's batch is inf
    for j in range(bad_step):
        rows = order[j * B:(j + 1) * B]
        _protocol_step(one, opt1, X[rows], y[rows], need_loss=j == 3)
    losses, right, _, _ = runs.block_run(X, order, count, B, rows=[count - 1] if measure else [], labels=y)
    assert len(losses) == bad_step + 1 and math.isnan(losses[-1])
    assert [v is None for v in losses[:-1]] == [j != 3 for j in range(bad_step)]     # step 3 is CORRECT
    _same(_state(one, opt1), _state(runs, opt2))
    assert runs.trainer.total_step == 3 + bad_step


def test_a_correct_step_with_a_finite_loss_and_a_non_finite_gradient_names_the_parameter():
    stepper, opt = _stepper()
    X, y = _data()
    stepper.backward_run(X, np.arange(3 * B, dtype=np.int64), 3, labels=y)

    def nan_gradient(run):                                # 3 PREDICT steps made, the CORRECT one not
        assert (run.count, run.last_read) == (4, 3)
        run.predictor.staging[7] = np.nan
        run.result[:] = [3, 0, 0.5, 0.3, 0, math.nan, math.nan, 0, 0, 1000, 0, 1.0, 1]
        return 3

    with pytest.raises(ValueError, match=r"grads\['w0'\]: contains NaN or inf"):
        stepper.trainer.predict_block_run(4, nan_gradient)
    assert stepper.trainer.total_step == 6 and stepper.trainer.get_stats().correct_steps == 0


def test_a_block_run_splits_its_seconds_by_the_kernel_clock(monkeypatch):
    """PREDICT steps: the Python before the kernel and its PREDICT nanoseconds; the CORRECT steps:
    their nanoseconds and the Python after the kernel."""
    from qatlab.train import phase

    stepper, opt = _stepper()
    X, y = _data()
    stepper.backward_run(X, np.arange(3 * B, dtype=np.int64), 3, labels=y)
    trainer = stepper.trainer
    ticks = iter([10.0, 10.5, 11.0])                     # call starts, kernel returns, booking done
    monkeypatch.setattr(phase, "_clock", lambda: next(ticks))
    seconds = trainer.get_stats().backward_seconds

    def kernel(run):
        made = stepper.fused.predict_block(X, np.arange(8 * B, dtype=np.int64) % N, B, run, labels=y)
        run.result[R_PREDICT_NS], run.result[R_CORRECT_NS] = 100e6, 250e6    # 0.1 s predicting, 0.25 s correcting
        return made

    assert trainer.predict_block_run(8, kernel)[0] == [None] * 3 + [ANY_LOSS] + [None] * 3 + [ANY_LOSS]
    stats = trainer.get_stats()
    assert stats.predict_seconds == pytest.approx(0.5 - 0.25)
    assert stats.backward_seconds - seconds == pytest.approx(0.25 + 0.5)
    assert (stats.predict_steps, stats.correct_steps) == (6, 2)


def test_the_kernel_clock_reads_time_monotonic_ns():
    import time

    from qatlab.kernels.clock import AVAILABLE, monotonic_ns

    assert AVAILABLE                                        # Linux and macOS
    before = time.monotonic_ns()
    now = monotonic_ns()
    assert before <= now <= time.monotonic_ns()
