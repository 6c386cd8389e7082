"""FusedStep: the whole step in one Numba call gives the Python step's numbers, bit for bit."""
import math

import numpy as np
import pytest

import qatlab as ql
from qatlab.runtime import parallel
from qatlab.train.fused_step import BACKWARD, FORWARD, FusedStep, unsupported_reason
from qatlab.kernels.fused import LAYER_SUMS, batch_rows_error, layer_sums
from qatlab.nn import ACTIVATIONS, Mlp, cross_entropy_loss, mse_loss
from qatlab.optim import SGD, Adam, Momentum
from qatlab.quant import FakeQuantize, TernaryQuantizer
from qatlab.train.trainer import Trainer

SIZES = [12, 16, 8, 5]
CAP = 9


def _model(activation="relu", ternary=(True, False, True), bias=True, ste="identity"):
    qs = [TernaryQuantizer(ste=ste) if t else None for t in ternary]
    return Mlp(SIZES, activation=activation, seed=3, bias=bias, weight_quantizers=qs)


def _optimizer(kind, params):
    if kind == "sgd":
        return SGD(params, lr=0.05, weight_decay=0.01)
    if kind == "momentum":
        return Momentum(params, lr=0.05, max_grad_norm=0.5, decoupled_weight_decay=False, weight_decay=0.01)
    return Adam(params, lr=0.01, max_grad_norm=0.5, weight_decay=0.02)


def _pair(opt_kind, **model_kw):
    """Two identical (mlp, scratch, grads, opt) sets."""
    out = []
    for _ in range(2):
        mlp = _model(**model_kw)
        out.append((mlp, mlp.scratch(CAP), mlp.gradients(CAP), _optimizer(opt_kind, mlp.flat_params())))
    return out


def _batches(n_steps, loss, seed=0):
    rng = np.random.default_rng(seed)
    for t in range(n_steps):
        B = CAP if t % 3 else CAP - 4          # a smaller batch now and then (the epoch's last)
        x = rng.standard_normal((B, SIZES[0])).astype(np.float32)
        if loss == "ce":
            yield x, {"labels": rng.integers(0, SIZES[-1], B)}
        else:
            yield x, {"targets": rng.standard_normal((B, SIZES[-1])).astype(np.float32)}


def _python_step(mlp, scratch, grads, opt, x, labels=None, targets=None):
    y = mlp.forward(x, scratch)
    if labels is not None:
        loss = cross_entropy_loss(y, labels, grads.d_output_mut())
    else:
        loss = mse_loss(y, targets, grads.d_output_mut())
    mlp.backward(x, scratch, grads, need_input_grad=False)
    opt.step(grads.flat())
    return loss


@pytest.mark.parametrize("activation", ACTIVATIONS)
@pytest.mark.parametrize("opt_kind", ["sgd", "momentum", "adam"])
@pytest.mark.parametrize("loss", ["ce", "mse"])
def test_matches_the_python_step_bit_for_bit(activation, opt_kind, loss):
    (m1, s1, g1, o1), (m2, s2, g2, o2) = _pair(opt_kind, activation=activation)
    fused = FusedStep(m2, s2, g2, o2)
    for x, target in _batches(7, loss):
        assert _python_step(m1, s1, g1, o1, x, **target) == fused(x, **target)
        assert np.array_equal(m1.flat_params(), m2.flat_params())
        assert np.array_equal(g1.flat(), g2.flat())
        assert np.array_equal(s1.output(), s2.output())
        assert (o1.t, o1.last_lr) == (o2.t, o2.last_lr)
        assert o1.last_grad_norm == o2.last_grad_norm or math.isnan(o1.last_grad_norm) and math.isnan(o2.last_grad_norm)
        for q1, q2 in zip(m1.weight_quantizers, m2.weight_quantizers):
            assert q1 is None or q1.alpha == q2.alpha
        for i in range(m1.num_layers):
            assert np.array_equal(s1.weights_used(i), s2.weights_used(i))
            assert np.array_equal(s1.layer_input(i), s2.layer_input(i))


@pytest.mark.parametrize("ste", ["identity", "clipped_identity", "tanh", "hard_tanh"])
def test_every_ste_and_no_bias(ste):
    (m1, s1, g1, o1), (m2, s2, g2, o2) = _pair("adam", bias=False, ste=ste, ternary=(True, True, True))
    fused = FusedStep(m2, s2, g2, o2)
    for x, target in _batches(5, "ce", seed=1):
        assert _python_step(m1, s1, g1, o1, x, **target) == fused(x, **target)
    assert np.array_equal(m1.flat_params(), m2.flat_params())
    fused.mlp.weight_quantizers[0].ste = "identity"        # a changed STE is picked up
    m1.weight_quantizers[0].ste = "identity"
    x, target = next(_batches(1, "ce", seed=2))
    assert _python_step(m1, s1, g1, o1, x, **target) == fused(x, **target)
    assert np.array_equal(m1.flat_params(), m2.flat_params())


def test_one_step_against_a_float64_reference():
    """Ternary 2-layer ReLU, softmax cross-entropy, Adam step 1: the documented formulas in numpy."""
    mlp = Mlp([6, 8, 3], seed=1, weight_quantizers=[TernaryQuantizer(), TernaryQuantizer()])
    W1, b1, W2, b2 = (a.astype(np.float64) for a in (mlp.weights(0), mlp.biases(0), mlp.weights(1), mlp.biases(1)))
    opt = Adam(mlp.flat_params(), lr=0.01)
    fused = FusedStep(mlp, mlp.scratch(4), mlp.gradients(4), opt)
    rng = np.random.default_rng(0)
    x, labels = rng.standard_normal((4, 6)).astype(np.float32), np.array([0, 2, 1, 2])
    loss = fused(x, labels=labels)

    def tern(W):
        alpha = np.mean(np.abs(W))
        return alpha * np.clip(np.rint(W / alpha), -1, 1)
    x64 = x.astype(np.float64)
    Q1, Q2 = tern(W1), tern(W2)
    h = np.maximum(x64 @ Q1.T + b1, 0)
    z = h @ Q2.T + b2
    p = np.exp(z - z.max(1, keepdims=True))
    p /= p.sum(1, keepdims=True)
    assert loss == pytest.approx(-np.mean(np.log(p[np.arange(4), labels])), rel=1e-5)
    dz = (p - np.eye(3)[labels]) / 4
    dh = (dz @ Q2) * (h > 0)
    grads = [dh.T @ x64, dh.sum(0), dz.T @ h, dz.sum(0)]       # identity STE: dW = dWq
    for before, g, after in zip((W1, b1, W2, b2), grads, (mlp.weights(0), mlp.biases(0), mlp.weights(1), mlp.biases(1))):
        m, v = 0.1 * g, 0.001 * g * g
        expected = before - (0.01 / 0.1) * m / (np.sqrt(v) / np.sqrt(0.001) + 1e-8)
        np.testing.assert_allclose(after, expected, rtol=1e-4, atol=1e-6)


def test_stages_stop_early():
    (m1, s1, g1, o1), (m2, s2, g2, o2) = _pair("adam")
    fused = FusedStep(m2, s2, g2, None)
    x, target = next(_batches(1, "ce"))
    params, grads = m2.flat_params().copy(), g2.flat().copy()
    y = m1.forward(x, s1)
    assert fused(x, **target, stage=FORWARD) == cross_entropy_loss(y, target["labels"])
    assert np.array_equal(m2.flat_params(), params) and np.array_equal(g2.flat(), grads)
    loss = fused(x, **target, stage=BACKWARD)
    assert loss == cross_entropy_loss(y, target["labels"], g1.d_output_mut())
    m1.backward(x, s1, g1, need_input_grad=False)
    assert np.array_equal(g1.flat(), g2.flat())
    assert np.array_equal(m2.flat_params(), params)
    with pytest.raises(ValueError, match="stage"):
        fused(x, **target)                                    # UPDATE needs an optimizer


def test_stash_copies_the_gradient_and_clip_scales_the_update():
    """stash + clip (phase training's backward step) = BACKWARD, copy + float64 sum of squares,
    then opt.step(g, grad_scale=clip factor)."""
    (m1, s1, g1, o1), (m2, s2, g2, o2) = _pair("adam")
    fused1, fused2 = FusedStep(m1, s1, g1, o1), FusedStep(m2, s2, g2, o2)
    stash = np.full(m2.num_params, np.nan, np.float32)
    for x, target in _batches(4, "ce", seed=3):
        fused1(x, **target, stage=BACKWARD)
        g = g1.flat().astype(np.float64)
        norm = np.sqrt(np.sum(g * g))
        o1.step(g1.flat(), grad_scale=0.05 / (norm + 1e-6) if norm > 0.05 else 1.0)
        fused2(x, **target, stash=stash, clip=0.05)
        assert np.array_equal(stash, g2.flat()) and np.array_equal(g1.flat(), g2.flat())
        assert fused2.stash_sumsq == pytest.approx(norm * norm, rel=1e-6)
        assert np.array_equal(m1.flat_params(), m2.flat_params()) and o1.t == o2.t
    with pytest.raises(ValueError, match="stash"):
        fused2(x, **target, stash=np.zeros(3, np.float32))


def test_non_finite_loss_updates_nothing():
    mlp, scratch, grads, opt = _pair("adam")[0]
    fused = FusedStep(mlp, scratch, grads, opt)
    x, target = next(_batches(1, "ce"))
    x[0, 0] = np.nan
    params = mlp.flat_params().copy()
    assert math.isnan(fused(x, **target))
    assert np.array_equal(mlp.flat_params(), params) and opt.t == 0


def test_bad_input_is_refused():
    mlp, scratch, grads, opt = _pair("adam")[0]
    fused = FusedStep(mlp, scratch, grads, opt)
    x, target = next(_batches(1, "ce"))
    params = mlp.flat_params().copy()
    with pytest.raises(ValueError, match="labels, targets"):
        fused(x)
    with pytest.raises(ValueError, match="labels, targets"):
        fused(x, labels=target["labels"], targets=np.zeros((len(x), SIZES[-1]), np.float32))
    with pytest.raises(ValueError, match="labels"):
        fused(x, labels=target["labels"][:-1])
    with pytest.raises(ValueError, match="labels"):
        fused(x, labels=np.full(len(x), SIZES[-1]))          # a label outside [0, K)
    with pytest.raises(ValueError, match="targets"):
        fused(x, targets=np.zeros((len(x), 2), np.float32))
    with pytest.raises(ValueError, match="x"):
        fused(np.zeros((CAP + 1, SIZES[0]), np.float32), labels=np.zeros(CAP + 1, np.int64))
    with pytest.raises(ValueError, match="stage"):
        fused(x, **target, stage=3)
    for bad in (-1.0, math.nan, math.inf):
        with pytest.raises(ValueError, match="clip"):
            fused(x, **target, clip=bad)
    assert opt.t == 0 and np.array_equal(mlp.flat_params(), params)


@pytest.mark.parametrize("opt_kind", ["sgd", "momentum", "adam"])
def test_non_finite_or_negative_lr_is_refused_with_nothing_changed(opt_kind):
    """lr=nan made every parameter NaN; now the step, the optimizer's own step and its fused
    scalars refuse it, naming lr, before anything moves."""
    mlp, scratch, grads, opt = _pair(opt_kind)[0]
    fused = FusedStep(mlp, scratch, grads, opt)
    x, target = next(_batches(1, "ce"))
    params, state = mlp.flat_params().copy(), [s.copy() for s in opt._state]
    for bad in (math.nan, math.inf, -math.inf, -0.1, np.float32("nan"), "0.1", None.__class__):
        with pytest.raises((ValueError, TypeError), match="lr"):
            fused(x, **target, lr=bad)
        with pytest.raises((ValueError, TypeError), match="lr"):
            opt.step(grads.flat(), lr=bad)
        with pytest.raises((ValueError, TypeError), match="lr"):
            opt.fused_scalars(bad)
    for bad in (math.nan, math.inf, 0.0, -1.0):
        with pytest.raises(ValueError, match="lr"):
            _optimizer(opt_kind, mlp.flat_params()).__class__(mlp.flat_params(), lr=bad)
    assert opt.t == 0 and np.array_equal(mlp.flat_params(), params)
    assert all(np.array_equal(a, b) for a, b in zip(opt._state, state))
    fused(x, **target, lr=np.float32(0.01))          # a numpy float that is finite still steps
    assert opt.t == 1 and not np.array_equal(mlp.flat_params(), params)


@pytest.mark.parametrize("loss", ["ce", "onehot", "mse"])
@pytest.mark.parametrize("opt_kind", ["momentum", "adam"])
def test_steps_match_one_call_per_step(loss, opt_kind):
    """steps(X, idx, k) = k calls on X[idx[j*B:(j+1)*B]], at the scheduled learning rates (cosine here)."""
    (m1, s1, g1, o1), (m2, s2, g2, o2) = _pair(opt_kind)
    for o in (o1, o2):
        o.schedule = ql.optim.Schedule("cosine", 0.05, total_steps=12)
    one, many = FusedStep(m1, s1, g1, o1), FusedStep(m2, s2, g2, o2)
    rng = np.random.default_rng(5)
    X = rng.standard_normal((40, SIZES[0])).astype(np.float32)
    labels = rng.integers(0, SIZES[-1], 40)
    T = rng.standard_normal((40, SIZES[-1])).astype(np.float32)
    block = {"ce": {"labels": labels}, "onehot": {"labels": labels, "onehot": True}, "mse": {"targets": T}}[loss]
    for count, B in ((1, CAP), (4, CAP), (3, 5)):
        idx = rng.integers(0, 40, count * B)
        assert many.steps(X, idx, count, **block) == count
        losses, correct = [], []
        for j in range(count):
            rows = idx[j * B:(j + 1) * B]
            target = ({"targets": T[rows]} if loss == "mse" else
                      {"targets": np.eye(SIZES[-1], dtype=np.float32)[labels[rows]]} if loss == "onehot" else
                      {"labels": labels[rows]})
            losses.append(one(X[rows], **target))
            correct.append(int(np.sum(np.argmax(s1.output(), axis=1) == labels[rows])) if loss != "mse" else 0)
        assert many.losses.tolist() == losses and many.correct.tolist() == correct
        assert np.array_equal(m1.flat_params(), m2.flat_params()) and np.array_equal(g1.flat(), g2.flat())
        assert (o1.t, o1.last_lr) == (o2.t, o2.last_lr) and np.array_equal(s1.output(), s2.output())
        for i in range(m1.num_layers):
            assert np.array_equal(s1.layer_input(i), s2.layer_input(i))
        assert [q and q.alpha for q in m1.weight_quantizers] == [q and q.alpha for q in m2.weight_quantizers]


def test_steps_stop_at_a_non_finite_loss():
    (m1, s1, g1, o1), (m2, s2, g2, o2) = _pair("adam")
    one, many = FusedStep(m1, s1, g1, o1), FusedStep(m2, s2, g2, o2)
    rng = np.random.default_rng(6)
    X = rng.standard_normal((30, SIZES[0])).astype(np.float32)
    labels = rng.integers(0, SIZES[-1], 30)
    X[7, 2] = np.nan                                    # in batch 2 (rows 6..8 of idx)
    idx = np.arange(12, dtype=np.int64)
    assert many.steps(X, idx, 4, labels=labels) == 3
    assert math.isnan(many.losses[-1]) and len(many.losses) == 3
    for j in range(2):
        one(X[3 * j: 3 * j + 3], labels=labels[3 * j: 3 * j + 3])
    assert np.array_equal(m1.flat_params(), m2.flat_params()) and o2.t == 2


def test_steps_refuse_bad_input():
    mlp, scratch, grads, opt = _pair("adam")[0]
    fused = FusedStep(mlp, scratch, grads, opt)
    X = np.zeros((20, SIZES[0]), np.float32)
    labels = np.zeros(20, np.int64)
    idx = np.arange(8, dtype=np.int64)
    params = mlp.flat_params().copy()
    for kwargs, match in [(dict(X=X[:, :3]), "X"), (dict(X=X.astype(np.float64)), "X"), (dict(count=3), "idx"),
                          (dict(count=0), "count"), (dict(idx=idx + 15), "idx"), (dict(idx=idx - 1), "idx"),
                          (dict(idx=np.arange(4 * (CAP + 1))), "idx"), (dict(labels=labels[:5]), "labels"),
                          (dict(labels=np.full(20, SIZES[-1])), r"labels: every label of a row in idx must be in \[0, 5\)"),
                          (dict(labels=np.full(20, -1), onehot=True), r"labels: every label of a row in idx"),
                          (dict(labels=None), "labels, targets"),
                          (dict(targets=np.zeros((20, 2), np.float32)), "labels, targets"),
                          (dict(labels=None, targets=np.zeros((20, 2), np.float32)), "targets")]:
        args = dict(X=X, idx=idx, count=2, labels=labels) | kwargs
        with pytest.raises(ValueError, match=match):
            fused.steps(args.pop("X"), args.pop("idx"), args.pop("count"), **args)
    assert opt.t == 0 and np.array_equal(mlp.flat_params(), params)
    labels[19] = SIZES[-1]                  # only the labels of the rows in idx are used and checked
    assert fused.steps(X, idx, 2, labels=labels) == 2


def test_what_it_does_not_cover():
    mlp = _model()
    scratch = mlp.scratch(CAP)
    assert unsupported_reason(mlp, scratch, Adam(mlp.flat_params())) is None
    fq = Mlp(SIZES, weight_quantizers=[FakeQuantize(bits=4), None, None])
    assert "ternary" in unsupported_reason(fq, fq.scratch(CAP))
    aq = Mlp(SIZES, activation_quantizers=[FakeQuantize(bits=8), None])
    assert "activation" in unsupported_reason(aq, aq.scratch(CAP))
    big = Mlp([parallel.MIN_ELEMENTS // 8, 8, 2])
    assert "parameters" in unsupported_reason(big, big.scratch(1))
    wide = Mlp([1024, 64, 2])
    assert "matrix products" in unsupported_reason(wide, wide.scratch(parallel.MIN_MACS // (1024 * 64)))
    other = Adam([np.zeros(mlp.num_params, np.float32)])
    assert "optimizer" in unsupported_reason(mlp, scratch, other)
    assert FusedStep.build(fq, fq.scratch(CAP), fq.gradients(CAP)) is None
    with pytest.raises(ValueError, match="FusedStep does not cover"):
        FusedStep(fq, fq.scratch(CAP), fq.gradients(CAP))


@pytest.mark.slow
@pytest.mark.parametrize("phase, loss", [(False, "cross_entropy"), (False, "mse"), (True, "cross_entropy")])
def test_experiment_history_is_the_same_with_the_fused_and_the_reference_stepper(phase, loss):
    cfg = ql.ExperimentConfig()
    cfg.optim.epochs, cfg.model.hidden, cfg.optim.loss = 2, [32], loss
    cfg.phase.enabled = phase
    fused_trainer, reference_trainer = Trainer(cfg), Trainer(cfg, reference=True)
    stepper = fused_trainer.stepper
    assert (stepper.fused if phase else stepper) is not None and isinstance(getattr(stepper, "fused"), FusedStep)
    assert type(reference_trainer.stepper).__name__ == ("PhaseStepper" if phase else "ReferenceStepper")
    assert getattr(reference_trainer.stepper, "fused", None) is None
    fused, reference = fused_trainer.run(), reference_trainer.run()
    assert fused.history.keys() == reference.history.keys()
    for key in fused.history:
        if key not in ("time", "steps_per_second", "speedup_wall"):
            np.testing.assert_array_equal(fused.history[key], reference.history[key], err_msg=key)


def test_batch_rows_error_matches_numpy():
    rng = np.random.default_rng(5)
    for _ in range(200):
        n, k = int(rng.integers(1, 30)), int(rng.integers(1, 6))
        idx = rng.integers(-2, n + 2, size=int(rng.integers(1, 12)))
        labels = rng.integers(-1, k + 1, size=n) if rng.random() < 0.8 else np.zeros(0, np.int64)
        if (idx < 0).any() or (idx >= n).any():
            want = 1
        elif len(labels) and ((labels[idx] < 0) | (labels[idx] >= k)).any():
            want = 2
        else:
            want = 0
        assert batch_rows_error(idx, n, labels, k) == want


@pytest.mark.parametrize("ternary", [True, False])
def test_layer_sums_match_numpy(ternary):
    """A metrics row's per-layer sums (the kernel block runs log rows with) against numpy."""
    rng = np.random.default_rng(5)
    w = (rng.standard_normal(1000) * 0.1).astype(np.float32)
    dw = rng.standard_normal(1000).astype(np.float32)
    dw[::7] = 0.0
    dw[3] = np.nan                                     # counts as neither sign, as in the live row
    used = np.where(np.abs(w) > 0.05, np.sign(w), 0).astype(np.float32)
    alpha = np.float32(np.mean(np.abs(w)))
    out = np.full(LAYER_SUMS, 7.0)
    layer_sums(w, dw, used, ternary, alpha, out)
    d = dw.astype(np.float64)
    assert math.isnan(out[0]) and np.isnan(d @ d)
    ok = ~np.isnan(d)
    layer_sums(w, np.where(ok, dw, 0).astype(np.float32), used, ternary, alpha, out)
    assert out[0] == pytest.approx(d[ok] @ d[ok], rel=1e-12)
    assert out[1:4].tolist() == [np.count_nonzero(d[ok]), np.sum(used < 0), np.sum(used > 0)]
    if ternary:
        v = np.rint(w * (np.float32(1) / alpha))
        q = np.clip(v, -1, 1) * alpha
        w64 = w.astype(np.float64)
        assert out[4] == pytest.approx(np.sum((w64 - q.astype(np.float64)) ** 2), rel=1e-12)
        assert out[5] == np.sum(np.abs(v) > 1) and out[6] == pytest.approx(w64 @ w64, rel=1e-12)
        assert out[7] == alpha
    else:
        assert out[4:].tolist() == [0.0] * 4
