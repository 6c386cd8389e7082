"""Property tests (hypothesis) of FakeQuantize: idempotence, outputs on the grid, noise bound,
backward zero exactly where the SteKind says, per-channel = per-tensor on every slice."""
from __future__ import annotations

import math
import os

import numpy as np
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from hypothesis.extra import numpy as hnp

import qatlab as ql
import reference as ref

F32 = np.float32
# QATLAB_HYPOTHESIS_EXAMPLES=5000 for a deep search; the default keeps the file to a few seconds.
N_EXAMPLES = int(os.environ.get("QATLAB_HYPOTHESIS_EXAMPLES", "60"))
SETTINGS = settings(max_examples=N_EXAMPLES, deadline=None, suppress_health_check=[HealthCheck.too_slow])


@st.composite
def quantizers(draw, ste=None):
    bits = draw(st.integers(1, 16))
    symmetric = draw(st.booleans())
    narrow = draw(st.booleans())
    rng_ = ref.integer_range(bits, symmetric, narrow)
    if rng_ is None:
        narrow = False
        rng_ = ref.integer_range(bits, symmetric, narrow)
    qmin, qmax = rng_
    zp = 0 if symmetric and draw(st.booleans()) else draw(st.integers(qmin, qmax))
    scale = float(F32(draw(st.floats(1e-5, 1e2, allow_nan=False, allow_infinity=False))))
    kind = ste if ste is not None else draw(st.sampled_from([k.value for k in ql.SteKind]))
    return ql.FakeQuantize(bits=bits, symmetric=symmetric, narrow_range=narrow, scale=scale, zero_point=zp, ste=kind)


@st.composite
def quantizer_and_input(draw, inside=False, ste=None):
    fq = draw(quantizers(ste=ste))
    lo, hi = fq.float_range()
    if inside:
        elems = st.floats(lo, hi, width=32, allow_nan=False, allow_infinity=False)
    else:
        r = float(F32(1.5 * max(abs(lo), abs(hi)) + fq.scale))
        elems = st.floats(-r, r, width=32, allow_nan=False, allow_infinity=False)
    x = draw(hnp.arrays(np.float32, st.integers(1, 40), elements=elems))
    return fq, x


def nonzero_grad(n, seed=0):
    r = np.random.default_rng(seed)
    return (r.uniform(0.5, 2.0, n) * r.choice([-1.0, 1.0], n)).astype(F32)


@SETTINGS
@given(quantizer_and_input())
def test_idempotent(case):
    fq, x = case
    y = fq.forward(x)
    assert np.array_equal(fq.forward(y), y)


@SETTINGS
@given(quantizer_and_input())
def test_matches_reference_and_stays_on_grid(case):
    fq, x = case
    qmin, qmax = fq.quant_range()
    y = fq.forward(x)
    assert np.array_equal(y, ref.fq_forward(x, fq.scale, fq.zero_point, qmin, qmax))
    lo, hi = fq.float_range()
    assert np.all(y >= lo) and np.all(y <= hi)
    q = y.astype(np.float64) / float(F32(fq.scale)) + fq.zero_point
    k = np.rint(q)
    # y = (k - zp) * s is itself rounded to float32: the error in units of s scales with |k - zp|
    assert np.all(np.abs(q - k) <= 1e-3 + np.abs(k - fq.zero_point) * 2.0 ** -22)
    assert np.all((k >= qmin) & (k <= qmax))


@SETTINGS
@given(quantizer_and_input(inside=True))
def test_noise_bounded_for_in_range_inputs(case):
    """noise <= s^2/4, up to float32 rounding of x*(1/s) and of (q-zp)*s (|x| * 2^-21 at most)."""
    fq, x = case
    s = fq.scale
    slack = float(np.max(np.abs(x))) * 2.0 ** -21
    assert fq.quantization_noise(x) <= (s / 2 + slack) ** 2
    assert np.max(np.abs(x.astype(np.float64) - fq.forward(x))) <= s / 2 + slack
    assert fq.saturation_fraction(x) == 0.0


@SETTINGS
@given(quantizer_and_input())
def test_backward_zero_exactly_where_ste_says(case):
    fq, x = case
    qmin, qmax = fq.quant_range()
    g = nonzero_grad(x.size)
    dx = fq.backward(g, x)
    kind = fq.ste.value
    if kind == "identity":
        assert np.array_equal(dx, g)
    elif kind == "clipped_identity":
        mask = ref.fq_mask(x, fq.scale, fq.zero_point, qmin, qmax)
        assert np.array_equal(dx[mask], g[mask]) and np.all(dx[~mask] == 0)
    elif kind == "hard_tanh":
        u = ref.ste_u_f32(x, fq.scale, fq.zero_point, qmin, qmax, fq.symmetric)
        assert np.all(dx[np.abs(u) >= 1] == 0) and np.all(dx[np.abs(u) < 1] != 0)
        assert np.all(dx / g >= 0) and np.all(dx / g <= 1)
        expect = ref.ste_backward(kind, x, g, fq.scale, fq.zero_point, qmin, qmax, fq.symmetric)
        assert np.allclose(dx, expect, rtol=0, atol=4e-6)
    else:
        assert np.all(dx / g >= -1e-6) and np.all(dx / g <= 1 + 1e-6)
        expect = ref.ste_backward(kind, x, g, fq.scale, fq.zero_point, qmin, qmax, fq.symmetric)
        assert np.allclose(dx, expect, rtol=0, atol=2e-6)


@SETTINGS
@given(quantizer_and_input())
def test_lsq_scale_grad_matches_reference(case):
    fq, x = case
    qmin, qmax = fq.quant_range()
    g = nonzero_grad(x.size, seed=1)
    _, ds = fq.backward(g, x, return_scale_grad=True)
    expect = ref.lsq_scale_grad(x, g, fq.scale, fq.zero_point, qmin, qmax)
    # float32 x*(1/s) in the kernel vs float64 x/s in the reference: error ~ |x/s| * 2^-23 per term
    tol = float(np.sum(np.abs(g) * (np.abs(x) / fq.scale + 1))) * 2.0 ** -20 / math.sqrt(x.size * max(qmax, 1))
    assert abs(ds - expect) <= tol + 1e-12


@settings(max_examples=max(N_EXAMPLES // 2, 1), deadline=None)
@given(st.integers(2, 8), st.booleans(), st.integers(0, 2), st.integers(0, 2**32 - 1))
def test_per_channel_equals_per_tensor_on_each_slice(bits, symmetric, axis, seed):
    r = np.random.default_rng(seed)
    shape = tuple(int(v) for v in r.integers(1, 5, 3))
    qmin, qmax = ref.integer_range(bits, symmetric, False)
    C = shape[axis]
    s = r.uniform(0.01, 1.0, C).astype(F32)
    zp = np.zeros(C, np.int64) if symmetric else r.integers(qmin, qmax + 1, C)
    x = (r.standard_normal(shape) * qmax * 0.5).astype(F32)
    fq = ql.FakeQuantize(bits=bits, symmetric=symmetric, scale=s, zero_point=zp, axis=axis, ste="hard_tanh")
    y = fq.forward(x)
    g = nonzero_grad(x.size, seed=2).reshape(shape)
    dx = fq.backward(g, x)
    for c in range(C):
        one = ql.FakeQuantize(bits=bits, symmetric=symmetric, scale=float(s[c]), zero_point=int(zp[c]), ste="hard_tanh")
        xs = np.take(x, c, axis=axis)
        assert np.array_equal(np.take(y, c, axis=axis), one.forward(xs))
        assert np.array_equal(np.take(dx, c, axis=axis), one.backward(np.take(g, c, axis=axis), xs))


@settings(max_examples=max(N_EXAMPLES * 2 // 3, 1), deadline=None)
@given(hnp.arrays(np.float32, st.integers(1, 50), elements=st.floats(-10, 10, width=32)))
def test_ternary_properties(w):
    trits, alpha = ql.ternary_quantize(w)
    assert set(np.unique(trits).tolist()) <= {-1, 0, 1}
    assert alpha >= float(np.finfo(np.float32).eps)
    assert math.isclose(alpha, max(float(np.mean(np.abs(w.astype(np.float64)))), 2.0 ** -23), rel_tol=1e-6)
    tq = ql.TernaryQuantizer()
    y = tq.forward(w)
    assert np.array_equal(y, ql.ternary_dequantize(trits, alpha))
    # idempotent at a fixed alpha: re-quantizing the projection with the same step gives it back
    fixed = ql.FakeQuantize(bits=2, symmetric=True, narrow_range=True, scale=alpha)
    assert np.array_equal(fixed.forward(w), y)
    assert np.array_equal(fixed.forward(y), y)
