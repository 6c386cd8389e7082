"""FakeQuantize and the observers against PyTorch (CPU). Every test skips cleanly without torch.

Documented differences, each pinned by a test below:

* NaN input: ours gives NaN; torch's fake_quantize gives the qmin level.
* torch.fake_quantize_per_channel_affine casts ``zp + rint(x/s)`` to int64 *before* clamping, so
  +inf (and finite values beyond int64 range) wrap to INT64_MIN and come out as the qmin level;
  ours saturates them to qmax, as torch's per-tensor op does. Bit-exact comparison per channel
  is therefore on inputs whose ``x/s`` fits in int64 (and on -inf, where both give qmin).
* MovingAverageMinMaxObserver keeps its running min/max in float64 (an accumulated statistic),
  torch in float32, so after several updates the qparams agree to ~1 ulp, not bit for bit.
* LSQ: torch sums the per-element scale gradient in float32, ours in float64; same formula with
  ``grad_factor = 1/sqrt(N * max(qmax, 1))`` (for 1-bit symmetric qmax = 0: we use max(qmax, 1)).
"""
from __future__ import annotations

import math

import numpy as np
import pytest

import qatlab as ql
import reference as ref

F32 = np.float32

TORCH_CONFIGS = [  # bits, symmetric, narrow
    (b, sym, nar) for b in (1, 2, 3, 4, 5, 6, 8, 10, 12, 16) for sym in (True, False) for nar in (False, True)
    if ref.integer_range(b, sym, nar) is not None and not (not sym and nar)]


def inputs(rng, n, s, zp, qmin, qmax):
    lo, hi = (qmin - zp) * s, (qmax - zp) * s
    span = max(hi - lo, s)
    x = rng.uniform(lo - span, hi + span, n)                       # in range and out of range
    m = n // 4
    x[:m] = (rng.integers(qmin - zp - 2, qmax - zp + 2, m) + 0.5) * s  # exact ties
    x[m:m + 6] = [0.0, -0.0, lo, hi, 1e20, -1e20]
    return x.astype(F32)


@pytest.mark.parametrize("bits,symmetric,narrow", TORCH_CONFIGS)
def test_forward_equals_torch_per_tensor(torch, rng, bits, symmetric, narrow):
    qmin, qmax = ref.integer_range(bits, symmetric, narrow)
    zps = {0 if symmetric else qmin, qmax, (qmin + qmax) // 2} if not symmetric else {0, qmax // 2}
    for s in [0.1, 1 / 3, 2.0 ** -7, 3.7] + list(10 ** rng.uniform(-4, 1, 4)):
        for zp in zps:
            fq = ql.FakeQuantize(bits=bits, symmetric=symmetric, narrow_range=narrow, scale=float(s), zero_point=zp)
            x = inputs(rng, 500, s, zp, qmin, qmax)
            x[-2:] = [np.inf, -np.inf]
            expect = torch.fake_quantize_per_tensor_affine(torch.from_numpy(x), float(s), int(zp), qmin, qmax).numpy()
            y = fq.forward(x)
            assert np.array_equal(y, expect), (s, zp)
            # truly bit for bit, signed zeros included
            assert np.array_equal(y.view(np.uint32), expect.view(np.uint32)), (s, zp)


def test_nan_is_a_documented_deviation(torch):
    x = np.array([np.nan, 0.3], F32)
    fq = ql.FakeQuantize(bits=8, scale=0.1)
    t = torch.fake_quantize_per_tensor_affine(torch.from_numpy(x), 0.1, 0, -128, 127).numpy()
    y = fq.forward(x)
    assert np.isnan(y[0]) and not np.isnan(t[0])  # torch: NaN -> qmin level
    assert y[1] == t[1]


@pytest.mark.parametrize("axis", [0, 1, 2, -1])
@pytest.mark.parametrize("bits,symmetric", [(8, True), (8, False), (4, True), (4, False), (2, True), (16, False)])
def test_forward_equals_torch_per_channel(torch, rng, axis, bits, symmetric):
    shape = (3, 5, 40)
    C = shape[axis]
    qmin, qmax = ref.integer_range(bits, symmetric, False)
    s = (10 ** rng.uniform(-3, 0, C)).astype(F32)
    zp = np.zeros(C, np.int64) if symmetric else rng.integers(qmin, qmax + 1, C)
    x = np.empty(shape, F32)
    xm = np.moveaxis(x, axis, 0)
    for c in range(C):
        xm[c] = inputs(rng, xm[c].size, float(s[c]), int(zp[c]), qmin, qmax)[rng.permutation(xm[c].size)] \
            .reshape(xm[c].shape)
    x = np.clip(x, -1e6, 1e6)  # keep x/s inside int64 (see module doc)
    x.flat[::97] = -np.inf
    fq = ql.FakeQuantize(bits=bits, symmetric=symmetric, scale=s, zero_point=zp, axis=axis)
    expect = torch.fake_quantize_per_channel_affine(
        torch.from_numpy(x), torch.from_numpy(s), torch.from_numpy(zp.astype(np.int32)), axis % 3, qmin, qmax).numpy()
    y = fq.forward(x)
    assert np.array_equal(y, expect)
    assert np.array_equal(y, ref.fq_forward_pc(x, axis, s, zp, qmin, qmax))


def test_per_channel_positive_infinity_is_a_documented_deviation(torch):
    x = np.array([[np.inf, 1e30, 0.3]], F32)
    s, zp = np.array([0.1], F32), np.array([0], np.int32)
    t = torch.fake_quantize_per_channel_affine(torch.from_numpy(x), torch.from_numpy(s), torch.from_numpy(zp),
                                               0, -128, 127).numpy()
    y = ql.FakeQuantize(bits=8, scale=s, zero_point=zp.astype(np.int64), axis=0).forward(x)
    hi = F32(127) * F32(0.1)
    assert y[0, 0] == hi and y[0, 1] == hi  # ours saturates to qmax, like torch's per-tensor op
    per_tensor = torch.fake_quantize_per_tensor_affine(torch.from_numpy(x), 0.1, 0, -128, 127).numpy()
    assert np.array_equal(y, per_tensor)
    assert y[0, 2] == t[0, 2]


@pytest.mark.parametrize("bits,symmetric,narrow", TORCH_CONFIGS)
def test_clipped_identity_equals_torch_autograd(torch, rng, bits, symmetric, narrow):
    qmin, qmax = ref.integer_range(bits, symmetric, narrow)
    s = float(10 ** rng.uniform(-3, 0))
    zp = 0 if symmetric else int(rng.integers(qmin, qmax + 1))
    x = inputs(rng, 800, s, zp, qmin, qmax)
    x[-2:] = [np.inf, -np.inf]
    g = rng.standard_normal(x.size).astype(F32)
    xt = torch.from_numpy(x.copy()).requires_grad_()
    torch.fake_quantize_per_tensor_affine(xt, s, zp, qmin, qmax).backward(torch.from_numpy(g))
    fq = ql.FakeQuantize(bits=bits, symmetric=symmetric, narrow_range=narrow, scale=s, zero_point=zp,
                         ste="clipped_identity")
    assert np.array_equal(fq.backward(g, x), xt.grad.numpy())


@pytest.mark.parametrize("axis", [0, 1])
def test_clipped_identity_per_channel_equals_torch_autograd(torch, rng, axis):
    x = (rng.standard_normal((6, 7)) * 3).astype(F32)
    C = x.shape[axis]
    s = rng.uniform(0.02, 0.3, C).astype(F32)
    zp = rng.integers(0, 16, C)
    g = rng.standard_normal(x.shape).astype(F32)
    xt = torch.from_numpy(x.copy()).requires_grad_()
    torch.fake_quantize_per_channel_affine(xt, torch.from_numpy(s), torch.from_numpy(zp.astype(np.int32)),
                                           axis, 0, 15).backward(torch.from_numpy(g))
    fq = ql.FakeQuantize(bits=4, symmetric=False, scale=s, zero_point=zp, axis=axis, ste="clipped_identity")
    assert np.array_equal(fq.backward(g, x), xt.grad.numpy())


def _learnable(torch):
    fn = getattr(torch, "_fake_quantize_learnable_per_tensor_affine", None)
    if fn is None:
        pytest.skip("torch has no _fake_quantize_learnable_per_tensor_affine")
    return fn


@pytest.mark.parametrize("bits,symmetric,narrow", [(8, True, False), (8, True, True), (4, False, False),
                                                   (3, True, False), (2, True, True), (1, True, False),
                                                   (12, False, False)])
def test_lsq_scale_grad_equals_torch_learnable(torch, rng, bits, symmetric, narrow):
    fn = _learnable(torch)
    qmin, qmax = ref.integer_range(bits, symmetric, narrow)
    s = float(F32(10 ** rng.uniform(-2, 0)))
    zp = 0 if symmetric else int(rng.integers(qmin, qmax + 1))
    x = inputs(rng, 2000, s, zp, qmin, qmax)
    x = np.clip(x, -1e6, 1e6)
    g = rng.standard_normal(x.size).astype(F32)
    fq = ql.FakeQuantize(bits=bits, symmetric=symmetric, narrow_range=narrow, scale=s, zero_point=zp)
    dx, ds = fq.backward(g, x, return_scale_grad=True)
    xt = torch.from_numpy(x.copy()).requires_grad_()
    st = torch.tensor([s], dtype=torch.float32, requires_grad=True)
    zt = torch.tensor([float(zp)], dtype=torch.float32, requires_grad=True)
    grad_factor = 1.0 / math.sqrt(x.size * max(qmax, 1))
    y = fn(xt, st, zt, qmin, qmax, grad_factor)
    y.backward(torch.from_numpy(g))
    assert np.array_equal(fq.forward(x), y.detach().numpy())
    assert np.array_equal(dx, xt.grad.numpy())  # CLIPPED_IDENTITY is the default STE
    # ours (float64 sum) vs the float64 reference: tight, up to the float32 x*(1/s) per term
    term_tol = float(np.sum(np.abs(g) * (np.abs(x) / s + 1))) * 2.0 ** -20 * grad_factor
    assert abs(ds - ref.lsq_scale_grad(x, g, s, zp, qmin, qmax)) <= term_tol + 1e-9
    # torch accumulates in float32: allow 1e-5 of the sum of |terms| on top
    sum_abs = float(np.sum(np.abs(g * ref.lsq_dyds(x, s, zp, qmin, qmax)))) * grad_factor
    assert abs(ds - st.grad.item()) <= term_tol + 1e-5 * sum_abs


def test_lsq_per_channel_equals_torch_learnable(torch, rng):
    fn = getattr(torch, "_fake_quantize_learnable_per_channel_affine", None)
    if fn is None:
        pytest.skip("torch has no _fake_quantize_learnable_per_channel_affine")
    x = (rng.standard_normal((5, 4, 30)) * 2).astype(F32)
    s = rng.uniform(0.05, 0.3, 4).astype(F32)
    zp = rng.integers(0, 16, 4)
    g = rng.standard_normal(x.shape).astype(F32)
    fq = ql.FakeQuantize(bits=4, symmetric=False, scale=s, zero_point=zp, axis=1)
    _, ds = fq.backward(g, x, return_scale_grad=True)
    st = torch.from_numpy(s.copy()).requires_grad_()
    zt = torch.from_numpy(zp.astype(F32)).requires_grad_()
    n = x.size // 4
    y = fn(torch.from_numpy(x), st, zt, 1, 0, 15, 1.0 / math.sqrt(n * 15))
    y.backward(torch.from_numpy(g))
    np.testing.assert_allclose(ds, st.grad.numpy(), rtol=1e-4, atol=1e-5)


# ----------------------------------------------------------------------------- observers

OBS_RANGES = [(2, True), (4, True), (8, True), (2, False), (4, False), (8, False), (1, False)]


def _torch_obs(torch, cls, bits, symmetric, per_channel, **kw):
    qmin, qmax = ref.integer_range(bits, symmetric, False)
    q = torch.ao.quantization
    dtype = torch.qint8 if symmetric else torch.quint8
    if per_channel:
        scheme = torch.per_channel_symmetric if symmetric else torch.per_channel_affine
    else:
        scheme = torch.per_tensor_symmetric if symmetric else torch.per_tensor_affine
    return getattr(q, cls)(dtype=dtype, qscheme=scheme, quant_min=qmin, quant_max=qmax, **kw), qmin, qmax


@pytest.mark.parametrize("bits,symmetric", OBS_RANGES)
def test_minmax_observer_equals_torch(torch, rng, bits, symmetric):
    tob, qmin, qmax = _torch_obs(torch, "MinMaxObserver", bits, symmetric, False)
    ours = ql.MinMaxObserver()
    for k in range(4):
        x = (rng.standard_normal(200) * rng.uniform(0.1, 5) + rng.uniform(-2, 2)).astype(F32)
        tob(torch.from_numpy(x))
        ours.observe(x)
        ts, tz = tob.calculate_qparams()
        assert ours.calculate_qparams(qmin, qmax, symmetric) == (ts.item(), tz.item())


@pytest.mark.parametrize("data", ["positive", "negative", "zeros"])
def test_minmax_observer_edge_ranges_equal_torch(torch, data):
    x = {"positive": np.array([0.5, 2.0], F32), "negative": np.array([-3.0, -0.25], F32),
         "zeros": np.zeros(4, F32)}[data]
    for symmetric in (True, False):
        tob, qmin, qmax = _torch_obs(torch, "MinMaxObserver", 8, symmetric, False)
        tob(torch.from_numpy(x))
        ours = ql.MinMaxObserver()
        ours.observe(x)
        ts, tz = tob.calculate_qparams()
        assert ours.calculate_qparams(qmin, qmax, symmetric) == (ts.item(), tz.item())


@pytest.mark.parametrize("bits,symmetric", OBS_RANGES)
def test_moving_average_observer_close_to_torch(torch, rng, bits, symmetric):
    tob, qmin, qmax = _torch_obs(torch, "MovingAverageMinMaxObserver", bits, symmetric, False, averaging_constant=0.1)
    ours = ql.MovingAverageMinMaxObserver(averaging_constant=0.1)
    for k in range(6):
        x = (rng.standard_normal(200) * rng.uniform(0.5, 3) + rng.uniform(-1, 1)).astype(F32)
        tob(torch.from_numpy(x))
        ours.observe(x)
        if k == 0:  # the first batch seeds both: identical
            assert ours.calculate_qparams(qmin, qmax, symmetric) == tuple(v.item() for v in tob.calculate_qparams())
    ts, tz = tob.calculate_qparams()
    s, z = ours.calculate_qparams(qmin, qmax, symmetric)
    assert math.isclose(s, ts.item(), rel_tol=1e-6) and abs(z - tz.item()) <= 1


@pytest.mark.parametrize("bits,symmetric", [(8, True), (8, False), (4, False)])
@pytest.mark.parametrize("axis", [0, 1, -1])
def test_per_channel_observers_equal_torch(torch, rng, bits, symmetric, axis):
    tob, qmin, qmax = _torch_obs(torch, "PerChannelMinMaxObserver", bits, symmetric, True, ch_axis=axis)
    tma, _, _ = _torch_obs(torch, "MovingAveragePerChannelMinMaxObserver", bits, symmetric, True, ch_axis=axis,
                           averaging_constant=0.2)
    ours, ours_ma = ql.MinMaxObserver(axis=axis), ql.MovingAverageMinMaxObserver(0.2, axis=axis)
    for k in range(3):
        x = (rng.standard_normal((4, 6, 5)) * rng.uniform(0.1, 3, (1, 6, 1)) + 0.3).astype(F32)
        for o in (tob, tma):
            o(torch.from_numpy(x))
        ours.observe(x)
        ours_ma.observe(x)
    ts, tz = tob.calculate_qparams()
    s, z = ours.calculate_qparams(qmin, qmax, symmetric)
    assert np.array_equal(s, ts.numpy()) and np.array_equal(z, tz.numpy().astype(np.int64))
    ts, tz = tma.calculate_qparams()
    s, z = ours_ma.calculate_qparams(qmin, qmax, symmetric)
    np.testing.assert_allclose(s, ts.numpy(), rtol=1e-6)
    assert np.all(np.abs(z - tz.numpy().astype(np.int64)) <= 1)


def test_calibrated_fakequantize_equals_torch_fake_quantize_module(torch, rng):
    """End to end: torch's FakeQuantize module (observer + fake-quant) and ours give the same output."""
    x = (rng.standard_normal((8, 16)) * 2 + 0.4).astype(F32)
    q = torch.ao.quantization
    tfq = q.FakeQuantize(observer=q.MinMaxObserver, quant_min=0, quant_max=255, dtype=torch.quint8,
                         qscheme=torch.per_tensor_affine)
    ty = tfq(torch.from_numpy(x)).detach().numpy()
    ours = ql.FakeQuantize(bits=8, symmetric=False, observer_enabled=True)
    y = ours.forward(x)
    assert (ours.scale, ours.zero_point) == (tfq.scale.item(), tfq.zero_point.item())
    assert np.array_equal(y, ty)


def test_torch_also_multiplies_by_the_inverse(torch, rng):
    """Where x*(1/s) and x/s round to different levels, torch, the reference and ours agree on the inverse."""
    xs, ss = [], []
    while len(xs) < 50:
        s = F32(rng.uniform(0.01, 1.0))
        x = F32((int(rng.integers(-100, 100)) + 0.5) * s)
        for xx in (x, np.nextafter(x, F32(np.inf)), np.nextafter(x, F32(-np.inf))):
            a = ref.fq_forward(np.array([xx], F32), s, 0, -128, 127)[0]
            b = ref.fq_forward_divide(np.array([xx], F32), s, 0, -128, 127)[0]
            if a != b:
                xs.append(xx)
                ss.append(s)
    for x, s in zip(xs, ss):
        arr = np.array([x], F32)
        t = torch.fake_quantize_per_tensor_affine(torch.from_numpy(arr), float(s), 0, -128, 127).numpy()[0]
        y = ql.FakeQuantize(bits=8, scale=float(s)).forward(arr)[0]
        assert y == t == ref.fq_forward(arr, s, 0, -128, 127)[0]
