"""Optimizers, schedules and clipping against slow numpy references of the torch formulas."""
import math

import numpy as np
import pytest

from qatlab.config import OptimConfig
from qatlab.nn import Mlp
from qatlab.optim import SGD, Adam, Momentum, Schedule, clip_global_norm, make_optimizer


def ref_adam(p, grads, lr, b1=0.9, b2=0.999, eps=1e-8, wd=0.0, decoupled=True):
    """torch.optim.Adam / AdamW, float64; lr: list (one per step)."""
    p, m, v = p.astype(np.float64), np.zeros(p.shape), np.zeros(p.shape)
    for t, (g, a) in enumerate(zip(grads, lr), start=1):
        g = g.astype(np.float64)
        if decoupled:
            p = p * (1 - a * wd)
        else:
            g = g + wd * p
        m = b1 * m + (1 - b1) * g
        v = b2 * v + (1 - b2) * g * g
        p = p - (a / (1 - b1 ** t)) * m / (np.sqrt(v) / np.sqrt(1 - b2 ** t) + eps)
    return p


def ref_sgd(p, grads, lr, momentum=0.0, wd=0.0, decoupled=True):
    """torch.optim.SGD (dampening 0, buffer starts at the first gradient), float64."""
    p, buf = p.astype(np.float64), None
    for g, a in zip(grads, lr):
        g = g.astype(np.float64)
        if decoupled:
            p = p * (1 - a * wd)
        else:
            g = g + wd * p
        if momentum:
            buf = g.copy() if buf is None else momentum * buf + g
            g = buf
        p = p - a * g
    return p


def problem(n=257, steps=12, seed=0):
    rng = np.random.default_rng(seed)
    p = rng.standard_normal(n).astype(np.float32)
    grads = [rng.standard_normal(n).astype(np.float32) * (1 + t) for t in range(steps)]
    return p, grads


def run(opt, p, grads):
    for g in grads:
        opt.step(g)
    return p


@pytest.mark.parametrize("wd, decoupled", [(0.0, True), (0.1, True), (0.1, False)])
def test_adam_matches_torch_formula(wd, decoupled):
    p, grads = problem()
    ref = ref_adam(p, grads, [1e-2] * len(grads), wd=wd, decoupled=decoupled)
    opt = Adam(p, lr=1e-2, weight_decay=wd, decoupled_weight_decay=decoupled)
    run(opt, p, grads)
    np.testing.assert_allclose(p, ref, rtol=1e-5, atol=1e-6)
    assert opt.t == len(grads)


def test_adam_first_step_is_lr_times_sign():
    p, (g,) = problem(steps=1)
    p0 = p.copy()
    Adam(p, lr=0.5, eps=0.0).step(g)
    np.testing.assert_allclose(p, p0 - 0.5 * np.sign(g), rtol=1e-6, atol=1e-6)


@pytest.mark.parametrize("momentum, wd, decoupled", [(0.0, 0.0, True), (0.0, 0.05, True), (0.9, 0.0, True),
                                                      (0.9, 0.05, True), (0.9, 0.05, False)])
def test_sgd_and_momentum_match_torch_formula(momentum, wd, decoupled):
    p, grads = problem()
    lrs = [0.01 * (t + 1) for t in range(len(grads))]
    ref = ref_sgd(p, grads, lrs, momentum, wd, decoupled)
    opt = SGD(p, lr=0.01, momentum=momentum, weight_decay=wd, decoupled_weight_decay=decoupled)
    for g, a in zip(grads, lrs):
        opt.step(g, lr=a)
    np.testing.assert_allclose(p, ref, rtol=1e-5, atol=1e-6)
    assert opt.last_lr == lrs[-1]


def test_momentum_class_defaults_to_0_9():
    p, grads = problem()
    ref = ref_sgd(p, grads, [0.01] * len(grads), momentum=0.9)
    opt = Momentum(p, lr=0.01)
    assert opt.momentum == 0.9
    run(opt, p, grads)
    np.testing.assert_allclose(p, ref, rtol=1e-5, atol=1e-6)


def test_parameter_lists_merge_into_the_flat_buffer():
    mlp, twin = Mlp([6, 5, 3], seed=1), Mlp([6, 5, 3], seed=1)
    named = Adam(mlp.parameters(), lr=1e-2)
    flat = Adam(twin.flat_params(), lr=1e-2)
    assert len(named._p) == 1 and named._p[0].base is mlp.flat_params()
    rng = np.random.default_rng(2)
    for _ in range(3):
        g = mlp.gradients()
        g.flat()[:] = rng.standard_normal(g.flat().size)
        named.step(g.parameters())           # a list of (name, view) pairs
        flat.step(g)                         # a Gradients object
    np.testing.assert_array_equal(mlp.flat_params(), twin.flat_params())


def test_separate_arrays_with_flat_or_listed_grads():
    rng = np.random.default_rng(3)
    a, b = rng.standard_normal((3, 4)).astype(np.float32), rng.standard_normal(5).astype(np.float32)
    grads = [rng.standard_normal(17).astype(np.float32) for _ in range(4)]
    ref = ref_adam(np.concatenate([a.ravel(), b]), grads, [1e-2] * 4)
    opt = Adam([("a", a), ("b", b)], lr=1e-2)
    assert len(opt._p) == 2
    for i, g in enumerate(grads):
        opt.step(g if i % 2 else [g[:12].reshape(3, 4), g[12:]])
    np.testing.assert_allclose(np.concatenate([a.ravel(), b]), ref, rtol=1e-5, atol=1e-6)


def test_step_validation_changes_nothing():
    p, (g,) = problem(steps=1)
    p0 = p.copy()
    opt = Adam(p, lr=1e-2)
    with pytest.raises(ValueError, match="grads"):
        opt.step(g[:-1])
    with pytest.raises(TypeError, match="grads"):
        opt.step(g.astype(np.float64))
    with pytest.raises(ValueError, match="lr"):
        opt.step(g, lr=-1.0)
    assert opt.t == 0 and np.array_equal(p, p0)
    with pytest.raises(TypeError, match="params"):
        Adam(p.astype(np.float64))
    with pytest.raises(ValueError, match="lr"):
        Adam(p, lr=0.0)
    with pytest.raises(ValueError, match="betas"):
        Adam(p, betas=(0.9, 1.0))
    with pytest.raises(ValueError, match="momentum"):
        SGD(p, momentum=1.0)


def test_schedules():
    c = Schedule("constant", 0.1)
    assert c(0) == c(10 ** 6) == 0.1
    s = Schedule("step", 1.0, total_steps=100)
    assert [s(t) for t in (0, 49, 50, 74, 75, 99)] == pytest.approx([1, 1, 0.1, 0.1, 0.01, 0.01])
    cos = Schedule("cosine", 2.0, total_steps=10)
    for t in (0, 3, 5, 10, 12):
        assert cos(t) == pytest.approx(2.0 * 0.5 * (1 + math.cos(math.pi * min(t, 10) / 10)))
    assert cos(5) == pytest.approx(1.0) and cos(10) == pytest.approx(0.0, abs=1e-12)
    with pytest.raises(ValueError, match="schedule"):
        Schedule("linear", 1.0, 10)
    with pytest.raises(ValueError, match="total_steps"):
        Schedule("cosine", 1.0)


def test_optimizer_follows_its_schedule():
    p, grads = problem(steps=8)
    lrs = [Schedule("cosine", 0.1, 8)(t) for t in range(8)]
    ref = ref_adam(p, grads, lrs)
    opt = Adam(p, lr=Schedule("cosine", 0.1, 8))
    seen = []
    for g in grads:
        seen.append(opt.lr)
        opt.step(g)
    assert seen == lrs
    np.testing.assert_allclose(p, ref, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("make", [
    lambda p, s: Adam(p, lr=s, weight_decay=0.01, max_grad_norm=2.0),
    lambda p, s: Adam(p, lr=s, betas=(0.8, 0.99), weight_decay=0.01, decoupled_weight_decay=False),
    lambda p, s: SGD(p, lr=s, weight_decay=0.1),
    lambda p, s: Momentum(p, lr=s, momentum=0.7, decoupled_weight_decay=False, weight_decay=0.1)])
@pytest.mark.parametrize("kind", ["constant", "step", "cosine"])
def test_fused_run_scalars_are_the_next_steps_fused_scalars(make, kind):
    p, grads = problem(steps=3)
    opt = make(p, Schedule(kind, 0.1, 8))
    opt.step(grads[0])
    for t, scale in ((1, 0.5), (1, 1.0), (300, 0.25)):
        opt.t = t
        out = np.full((4, 8), np.nan)
        lrs = opt.fused_run_scalars(out, lr_scale=scale)
        assert lrs.tolist() == [opt.schedule(t + j) * scale for j in range(4)] and opt.t == t
        for j, lr in enumerate(lrs):
            np.testing.assert_array_equal(out[j], opt.fused_scalars(lr, ahead=j))
    if isinstance(opt, Adam):        # betas changed after construction are used
        opt.betas = (0.5, 0.9)
        opt.fused_run_scalars(out)
        np.testing.assert_array_equal(out[0], opt.fused_scalars(opt.lr))
    opt.t = 1
    before = out.copy()
    for bad in (np.zeros((4, 7)), np.zeros((4, 8), np.float32), [[0.0] * 8]):
        with pytest.raises(ValueError, match="out: expected a float64 array of shape"):
            opt.fused_run_scalars(bad)
    for bad in (-0.5, math.nan, math.inf, True):
        with pytest.raises(ValueError, match="lr_scale"):
            opt.fused_run_scalars(out, lr_scale=bad)
    assert np.array_equal(out, before) and opt.t == 1


@pytest.mark.parametrize("make", [
    lambda p: Adam(p, lr=0.1, weight_decay=0.01, max_grad_norm=2.0),
    lambda p: Adam(p, lr=0.1, betas=(0.8, 0.99), eps=1e-6, weight_decay=0.01, decoupled_weight_decay=False),
    lambda p: SGD(p, lr=0.1, weight_decay=0.1),
    lambda p: Momentum(p, lr=0.1, momentum=0.7, decoupled_weight_decay=False, weight_decay=0.1)])
def test_fused_row_is_the_python_steps_scalars(make):
    """The Numba row (fused_row) holds the floats Optimizer.step passes its kernel: (decay, l2) of
    _decay_l2 and _scalars, for every optimizer and step."""
    p, _ = problem(steps=1)
    opt = make(p)
    for t in (1, 2, 7, 100, 2999):
        for lr in (0.1, 0.0375, 1e-5):
            opt.t = t - 1
            decay, l2 = opt._decay_l2(lr)
            want = [opt.max_grad_norm, l2, decay, *opt._scalars(t, lr)]
            assert opt.fused_scalars(lr).tolist() == want + [0.0] * (8 - len(want))


def test_fused_done_books_a_run_of_steps():
    p, _ = problem(steps=1)
    clipping, plain = Adam(p.copy(), max_grad_norm=1.0), Adam(p.copy())
    for opt in (clipping, plain):
        opt.fused_done(np.float64(0.25), 3.0, steps=3)
        opt.fused_done(0.5, 4.0)
        assert opt.t == 4 and opt.last_lr == 0.5 and type(opt.last_lr) is float
    assert clipping.last_grad_norm == 4.0 and math.isnan(plain.last_grad_norm)


def test_clip_global_norm_helper():
    rng = np.random.default_rng(4)
    a, b = rng.standard_normal(10).astype(np.float32), rng.standard_normal((2, 3)).astype(np.float32)
    a0, b0 = a.copy(), b.copy()
    n = np.sqrt(np.sum(a0.astype(np.float64) ** 2) + np.sum(b0.astype(np.float64) ** 2))
    assert clip_global_norm([a, b], 2 * n) == pytest.approx(n) and np.array_equal(a, a0)
    assert clip_global_norm([("a", a), ("b", b)], 1.0) == pytest.approx(n)
    c = 1.0 / (n + 1e-6)
    np.testing.assert_allclose(a, a0 * c, rtol=1e-6)
    np.testing.assert_allclose(b, b0 * c, rtol=1e-6)
    for bad in (0.0, -1.0, float("nan")):
        with pytest.raises(ValueError, match="max_norm"):
            clip_global_norm(a, bad)


def test_optimizer_clipping_equals_clip_then_step_and_keeps_grads():
    p, grads = problem(steps=5)
    q = p.copy()
    opt = Adam(p, lr=1e-2, max_grad_norm=3.0)
    ref = Adam(q, lr=1e-2)
    for g in grads:
        g0 = g.copy()
        opt.step(g)
        assert np.array_equal(g, g0)  # clipping inside step does not write to the gradient
        assert opt.last_grad_norm == pytest.approx(np.linalg.norm(g0.astype(np.float64)))
        clip_global_norm(g0, 3.0)
        ref.step(g0)
    np.testing.assert_allclose(p, q, rtol=1e-6, atol=1e-7)


@pytest.mark.parametrize("cls", [SGD, Momentum, Adam])
def test_grad_scale_equals_stepping_the_scaled_gradient(cls):
    """step(g, grad_scale=s) is step(float32(s * g)), g untouched: bit for bit, and to rounding
    when max_grad_norm then clips the scaled gradient; a bad scale is refused, changing nothing."""
    p, grads = problem(steps=4)
    q, p2, q2 = p.copy(), p.copy(), p.copy()
    opt, ref = cls(p, lr=1e-2), cls(q, lr=1e-2)
    clipping, ref_clipping = cls(p2, lr=1e-2, max_grad_norm=2.0), cls(q2, lr=1e-2, max_grad_norm=2.0)
    for g in grads:
        g0 = g.copy()
        opt.step(g, grad_scale=0.3)
        clipping.step(g, grad_scale=0.3)
        ref.step(g0 * np.float32(0.3))
        ref_clipping.step(g0 * np.float32(0.3))
        assert np.array_equal(g, g0) and np.array_equal(p, q)
        assert clipping.last_grad_norm == pytest.approx(ref_clipping.last_grad_norm, rel=1e-6)
    np.testing.assert_allclose(p2, q2, rtol=1e-6)
    for bad in (-1.0, math.nan, math.inf):
        with pytest.raises(ValueError, match="grad_scale"):
            opt.step(grads[0], grad_scale=bad)
    assert opt.t == len(grads) and np.array_equal(p, q)


@pytest.mark.parametrize("name, cls", [("sgd", SGD), ("momentum", Momentum), ("adam", Adam)])
@pytest.mark.parametrize("schedule", ["constant", "step", "cosine"])
def test_make_optimizer_from_config(name, cls, schedule):
    cfg = OptimConfig(optimizer=name, lr=0.05, schedule=schedule, epochs=4, momentum=0.8,
                      weight_decay=0.01, max_grad_norm=2.0)
    mlp = Mlp([3, 4, 2])
    opt = make_optimizer(cfg, mlp.parameters(), steps_per_epoch=5)
    assert type(opt) is cls and len(opt._p) == 1
    assert opt.schedule.kind == schedule and opt.schedule.base_lr == 0.05
    assert opt.weight_decay == 0.01 and opt.max_grad_norm == 2.0
    if schedule != "constant":
        assert opt.schedule.total_steps == 20
    if name == "momentum":
        assert opt.momentum == 0.8
    assert opt.lr == 0.05
    with pytest.raises(ValueError, match="steps_per_epoch"):
        make_optimizer(cfg, mlp.parameters(), 0)


@pytest.mark.parametrize("make", [lambda p: Adam(p, lr=1e-2), lambda p: Momentum(p, lr=1e-2)], ids=["adam", "momentum"])
def test_state_of_parameters_with_zero_gradient_flushes_to_zero_not_subnormal(make):
    """Documented flush to zero: moments below FLT_MIN become 0 (they used to stick as subnormals,
    making every later step up to 8x slower); the parameters still follow the float64 reference."""
    n, steps = 64, 2000
    p, (g,) = problem(n=n, steps=1)
    g[: n // 2] = 0.0
    g[0] = 1e-30                     # g^2 underflows; m decays through the subnormal range
    first = g.copy()
    first[: n // 2] = 1.0            # a real gradient first, so the state starts non-zero
    grads = [first] + [g] * (steps - 1)
    opt = make(p)
    ref = (ref_adam(p, grads, [1e-2] * steps) if isinstance(opt, Adam)
           else ref_sgd(p, grads, [1e-2] * steps, momentum=0.9))
    run(opt, p, grads)
    np.testing.assert_allclose(p, ref, rtol=1e-4, atol=1e-5)
    tiny = np.finfo(np.float32).tiny
    for state in opt._state:
        subnormal = (state != 0) & (np.abs(state) < tiny)
        assert not subnormal.any(), f"{subnormal.sum()} subnormal state values"
    assert (opt._state[0][1: n // 2] == 0).all()     # m (momentum buffer): 0.9^2000 of it is below FLT_MIN


@pytest.mark.parametrize("make", [lambda p: Adam(p, lr=1e-2, weight_decay=0.1), lambda p: SGD(p, lr=1e-2),
                                  lambda p: Momentum(p, lr=1e-2, weight_decay=0.1)])
def test_big_segments_split_across_cores_give_the_same_bits(force_split, make):
    """Segments of >= parallel.MIN_ELEMENTS are updated in slices on the pool: same bits as one call."""
    p0, grads = problem(n=10_007, steps=3)
    one = run(make(p := p0.copy()), p, grads)
    calls = force_split(3, MIN_ELEMENTS=1000)
    split = run(make(p := p0.copy()), p, grads)
    assert calls == [(10_007, 3)] * 3                   # the split path really ran, once per step
    assert np.array_equal(one, split)


def test_is_over_means_exactly_one_flat_buffer():
    mlp = Mlp([4, 3, 2], seed=0)
    flat = mlp.flat_params()
    assert Adam(flat).is_over(flat)
    assert Adam(mlp.parameters()).is_over(flat)            # consecutive views merge into that buffer
    assert not Adam(flat[:-1]).is_over(flat) and not Adam(flat.copy()).is_over(flat)
    assert not Adam([mlp.weights(0), mlp.weights(1)]).is_over(flat)
