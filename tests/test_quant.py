"""FakeQuantize: integer ranges, forward (bit-exact vs the numpy reference), STE backward,
LSQ scale gradient, statistics, per-channel mode, validation and bad input."""
from __future__ import annotations

import math

import numpy as np
import pytest

import qatlab as ql
import reference as ref
from qatlab.quant import as_float32, integer_range

F32 = np.float32
KINDS = [k.value for k in ql.SteKind]


# ----------------------------------------------------------------------------- helpers

def valid_configs():
    """Every (bits, symmetric, narrow_range) whose range has at least two levels."""
    return [(b, sym, nar) for b in range(1, 17) for sym in (True, False) for nar in (False, True)
            if ref.integer_range(b, sym, nar) is not None]


def data(rng, n, s, zp, qmin, qmax, special=True):
    """In-range and out-of-range values, exact ties at (k + 0.5) steps, +-0, and (optionally) +-inf/NaN."""
    lo, hi = (qmin - zp) * s, (qmax - zp) * s
    span = max(hi - lo, s)
    x = rng.uniform(lo - 0.3 * span, hi + 0.3 * span, n)
    m = n // 4
    x[:m] = (rng.integers(qmin - zp - 3, qmax - zp + 3, m) + 0.5) * s
    x[m:m + 4] = [0.0, -0.0, lo, hi]
    x = x.astype(F32)
    if special:
        x[-3:] = [np.inf, -np.inf, np.nan]
    return x


def snapshot(obj):
    return {k: (np.array(v, copy=True) if isinstance(v, np.ndarray) else v) for k, v in obj.param.values().items()}


def assert_same_snapshot(a, b):
    assert a.keys() == b.keys()
    for k in a:
        assert np.array_equal(np.asarray(a[k], dtype=object if k in ("name", "ste") else None),
                              np.asarray(b[k], dtype=object if k in ("name", "ste") else None)), k


def make(bits=8, symmetric=True, narrow=False, scale=0.05, zp=0, **kw):
    return ql.FakeQuantize(bits=bits, symmetric=symmetric, narrow_range=narrow, scale=scale, zero_point=zp, **kw)


# ----------------------------------------------------------------------------- integer ranges

@pytest.mark.parametrize("bits", range(1, 17))
@pytest.mark.parametrize("symmetric", [True, False])
@pytest.mark.parametrize("narrow", [False, True])
def test_integer_range_table(bits, symmetric, narrow):
    expect = ref.integer_range(bits, symmetric, narrow)
    if expect is None:
        with pytest.raises(ValueError, match="bits"):
            integer_range(bits, symmetric, narrow)
        with pytest.raises(ValueError, match="bits"):
            ql.FakeQuantize(bits=bits, symmetric=symmetric, narrow_range=narrow, zero_point=1 if not symmetric else 0)
        return
    assert integer_range(bits, symmetric, narrow) == expect
    zp = 0 if expect[0] <= 0 else expect[0]
    fq = ql.FakeQuantize(bits=bits, symmetric=symmetric, narrow_range=narrow, zero_point=zp)
    assert fq.quant_range() == expect
    assert all(type(v) is int for v in fq.quant_range())


def test_integer_range_explicit_values():
    assert integer_range(8, True, False) == (-128, 127)
    assert integer_range(8, True, True) == (-127, 127)
    assert integer_range(8, False, False) == (0, 255)
    assert integer_range(16, True, False) == (-32768, 32767)
    assert integer_range(16, False, False) == (0, 65535)
    assert integer_range(2, True, True) == (-1, 1)  # ternary
    assert integer_range(4, False, True) == (1, 15)


def test_one_bit_decisions():
    """1-bit symmetric = two levels {-s, 0} (range [-1, 0], as torch quant_min=-1, quant_max=0);
    1-bit narrow symmetric would be the single level [0, 0] and is rejected; 1-bit affine = [0, 1]."""
    fq = ql.FakeQuantize(bits=1, symmetric=True, scale=0.5)
    assert fq.quant_range() == (-1, 0)
    assert fq.float_range() == (-0.5, 0.0)
    y = fq.forward(np.array([-3.0, -0.3, -0.25, 0.0, 0.2, 5.0], F32))
    assert np.array_equal(y, np.array([-0.5, -0.5, 0.0, 0.0, 0.0, 0.0], F32))  # -0.25/0.5 = -0.5 -> ties to 0
    with pytest.raises(ValueError, match="bits"):
        ql.FakeQuantize(bits=1, symmetric=True, narrow_range=True)
    fa = ql.FakeQuantize(bits=1, symmetric=False, scale=0.5)
    assert fa.quant_range() == (0, 1)
    assert np.array_equal(fa.forward(np.array([-1.0, 0.2, 0.3, 9.0], F32)), np.array([0.0, 0.0, 0.5, 0.5], F32))
    # no division by zero anywhere for the 1-bit range (qmax = 0)
    dx, ds = fq.backward(np.ones(4, F32), np.array([-1, -0.25, 0.0, 1], F32), return_scale_grad=True)
    assert np.all(np.isfinite(dx)) and math.isfinite(ds)
    fq.ste = "hard_tanh"
    assert np.all(np.isfinite(fq.backward(np.ones(3, F32), np.array([-0.5, 0.0, 0.25], F32))))


@pytest.mark.parametrize("bits", [0, -1, 17, 32])
def test_bits_out_of_range_names_field_and_range(bits):
    with pytest.raises(ValueError, match="bits") as err:
        ql.FakeQuantize(bits=bits)
    assert "16" in str(err.value) or "1" in str(err.value)
    fq = make()
    before = snapshot(fq)
    with pytest.raises(ValueError, match="bits") as err:
        fq.bits = bits
    msg = str(err.value)
    assert ("16" in msg) if bits > 16 else ("1" in msg and "16" in msg), msg
    assert_same_snapshot(before, snapshot(fq))


def test_integer_range_rejects_bits_outside_1_16():
    for bits in (0, -2, 17):
        with pytest.raises(ValueError, match="bits") as err:
            integer_range(bits, True, False)
        assert "16" in str(err.value)


def test_with_defaults():
    for bits in (1, 2, 4, 8, 16):
        for sym in (True, False):
            fq = ql.FakeQuantize.with_defaults(bits, sym)
            assert (fq.bits, fq.symmetric, fq.scale, fq.zero_point) == (bits, sym, 1.0, 0)
            assert fq.axis is None and fq.enabled
            assert fq.quant_range() == ref.integer_range(bits, sym, False)


def test_float_range():
    fq = make(bits=8, scale=0.1)
    assert fq.float_range() == (float(F32(-128) * F32(0.1)), float(F32(127) * F32(0.1)))
    fa = make(bits=4, symmetric=False, scale=0.25, zp=3)
    assert fa.float_range() == (-0.75, 3.0)
    lo, hi = fa.float_range()
    x = np.array([-100, 100], F32)
    assert tuple(fa.forward(x).tolist()) == (lo, hi)


# ----------------------------------------------------------------------------- forward

@pytest.mark.parametrize("bits,symmetric,narrow", valid_configs())
def test_forward_bit_exact_vs_reference(rng, bits, symmetric, narrow):
    qmin, qmax = ref.integer_range(bits, symmetric, narrow)
    zps = [0] if symmetric else [qmin, (qmin + qmax) // 2, qmax]
    if symmetric and qmax > 1:
        zps.append(qmax // 2)
    scales = [0.1, 1 / 3, 2.0 ** -5, 7.0] + list(10 ** rng.uniform(-4, 1, 3))
    for s in scales:
        for zp in zps:
            fq = make(bits, symmetric, narrow, s, zp)
            x = data(rng, 600, s, zp, qmin, qmax)
            y = fq.forward(x)
            assert y.dtype == np.float32 and y.shape == x.shape
            expect = ref.fq_forward(x, s, zp, qmin, qmax)
            assert np.array_equal(y, expect, equal_nan=True), (s, zp)
            assert np.array_equal(y[:64], ref.fq_forward_loop(x[:64], s, zp, qmin, qmax), equal_nan=True)


def test_forward_shapes(rng):
    fq = make(scale=0.03)
    for shape in [(), (0,), (1,), (7, 3), (2, 3, 4, 5), (0, 4)]:
        x = (rng.standard_normal(shape) * 2).astype(F32)
        y = fq.forward(x)
        assert y.shape == x.shape and y.dtype == np.float32
        assert np.array_equal(y, ref.fq_forward(x, 0.03, 0, -128, 127))


@pytest.mark.parametrize("s", [1.0, 0.5, 0.25, 2.0, 0.125])
def test_ties_round_to_even(s):
    """x exactly at (k + 0.5) steps (exact in float32, power-of-two scales) rounds to the even k."""
    halves = np.array([0.5, 1.5, 2.5, 3.5, -0.5, -1.5, -2.5, -3.5, 126.5, -127.5], np.float64)
    expect_q = np.array([0, 2, 2, 4, 0, -2, -2, -4, 126, -128])
    fq = make(bits=8, scale=s)
    y = fq.forward((halves * s).astype(F32))
    assert np.array_equal(y, (expect_q * s).astype(F32))
    # affine, zp = 3: the tie is decided on x/s before adding the zero-point
    fa = make(bits=8, symmetric=False, scale=s, zp=3)
    ya = fa.forward((np.array([0.5, 1.5, -0.5, -1.5, -2.5]) * s).astype(F32))
    assert np.array_equal(ya, (np.array([0, 2, 0, -2, -2]) * s).astype(F32))


def test_forward_multiplies_by_the_inverse(rng):
    """Search (x, s) where rint(x * f32(1/s)) != rint(x / s) in float32 and check we follow the inverse."""
    found = 0
    for _ in range(4000):
        s = F32(rng.uniform(0.01, 1.0))
        k = int(rng.integers(-100, 100))
        x0 = F32((k + 0.5) * s)
        for x in (x0, np.nextafter(x0, F32(np.inf)), np.nextafter(x0, F32(-np.inf))):
            xs = np.array([x], F32)
            by_inverse = ref.fq_forward(xs, s, 0, -128, 127)
            by_division = ref.fq_forward_divide(xs, s, 0, -128, 127)
            if by_inverse[0] != by_division[0]:
                found += 1
                y = make(scale=float(s)).forward(xs)
                assert y[0] == by_inverse[0] and y[0] != by_division[0], (x, s)
        if found >= 20:
            break
    assert found >= 20


def test_nan_propagates_and_inf_saturates():
    """Documented deviation from torch: NaN -> NaN (torch's fake_quantize maps NaN to qmin)."""
    for fq in (make(scale=0.1), make(bits=4, symmetric=False, scale=0.3, zp=5), make(bits=2, narrow=True, scale=0.7)):
        lo, hi = fq.float_range()
        y = fq.forward(np.array([np.nan, np.inf, -np.inf, 1.0, np.nan], F32))
        assert np.isnan(y[0]) and np.isnan(y[4])
        assert y[1] == F32(hi) and y[2] == F32(lo)
        assert np.isfinite(y[3])


def test_outputs_on_grid_and_inside_float_range(rng):
    for fq in (make(scale=0.07), make(bits=3, symmetric=False, scale=0.4, zp=2), make(bits=16, scale=1e-3)):
        qmin, qmax = fq.quant_range()
        x = data(rng, 3000, fq.scale, fq.zero_point, qmin, qmax, special=False)
        y = fq.forward(x)
        lo, hi = fq.float_range()
        assert lo <= y.min() and y.max() <= hi
        q = y.astype(np.float64) / float(F32(fq.scale)) + fq.zero_point
        assert np.allclose(q, np.rint(q), atol=1e-3)
        assert np.all((np.rint(q) >= qmin) & (np.rint(q) <= qmax))


def test_disabled_is_identity(rng):
    fq = make(scale=0.1, enabled=False)
    x = np.concatenate([rng.standard_normal(100) * 50, [np.nan, np.inf, -np.inf]]).astype(F32)
    y = fq.forward(x)
    assert np.array_equal(y, x, equal_nan=True) and y is not x
    g = rng.standard_normal(x.size).astype(F32)
    for kind in KINDS:
        fq.ste = kind
        assert np.array_equal(fq.backward(g, x), g)
    dx, ds = fq.backward(g, x, return_scale_grad=True)
    assert np.array_equal(dx, g) and ds == 0.0
    assert fq.quantization_noise(x) == 0.0 and fq.saturation_fraction(x) == 0.0


def test_out_buffer(rng):
    fq = make(scale=0.02)
    x = rng.standard_normal((5, 6)).astype(F32)
    expect = ref.fq_forward(x, 0.02, 0, -128, 127)
    out = np.empty_like(x)
    assert fq.forward(x, out=out) is out and np.array_equal(out, expect)
    y = x.copy()
    fq.forward(y, out=y)  # in place
    assert np.array_equal(y, expect)
    g = rng.standard_normal(x.shape).astype(F32)
    dx = np.empty_like(x)
    assert fq.backward(g, x, out=dx) is dx


@pytest.mark.parametrize("bad", [
    np.empty((5, 7), F32), np.empty((6, 5), F32), np.empty((5, 6), np.float64), np.empty((5, 6), np.int32),
    np.empty((6, 5), F32).T, [[0.0] * 6] * 5, np.empty(30, F32)])
def test_out_buffer_wrong_raises(rng, bad):
    fq = make()
    x = rng.standard_normal((5, 6)).astype(F32)
    with pytest.raises(ValueError, match="out"):
        fq.forward(x, out=bad)
    with pytest.raises(ValueError, match="out"):
        fq.backward(x, x, out=bad)


# ----------------------------------------------------------------------------- input conversion

def test_non_float_inputs_are_converted(rng):
    fq = make(scale=0.3)
    xi = rng.integers(-60, 60, 50)
    for x in (xi, xi.astype(np.int8), xi.astype(np.uint16).clip(0), xi.tolist(), xi.astype(bool)):
        expect = ref.fq_forward(np.asarray(x).astype(F32), 0.3, 0, -128, 127)
        assert np.array_equal(fq.forward(x), expect)
    x64 = rng.standard_normal(200) * 10  # float64 -> float32 first, then quantized
    assert np.array_equal(fq.forward(x64), ref.fq_forward(x64.astype(F32), 0.3, 0, -128, 127))
    g64 = rng.standard_normal(200)
    assert fq.backward(g64, x64).dtype == np.float32
    assert np.array_equal(fq.backward(g64, x64), fq.backward(g64.astype(F32), x64.astype(F32)))


def test_non_contiguous_inputs(rng):
    fq = make(scale=0.05, ste="hard_tanh")
    base = rng.standard_normal((8, 10)).astype(F32)
    for x in (base[:, ::2], base.T, np.asfortranarray(base), base[::-1]):
        y = fq.forward(x)
        assert y.shape == x.shape
        assert np.array_equal(y, ref.fq_forward(np.ascontiguousarray(x), 0.05, 0, -128, 127))
        g = np.ones_like(x)
        assert np.array_equal(fq.backward(g, x), fq.backward(np.ascontiguousarray(g), np.ascontiguousarray(x)))


@pytest.mark.parametrize("bad", [
    np.array([1, "a"], dtype=object), np.array(["1.0", "2.0"]), np.array([1 + 2j, 3j]),
    np.array([b"ab"]), "abc"])
def test_non_numeric_input_raises_type_error(bad):
    fq = make()
    with pytest.raises(TypeError, match="x"):
        fq.forward(bad)
    with pytest.raises(TypeError, match="grad_output"):
        fq.backward(bad, np.zeros(np.shape(bad), F32))
    with pytest.raises(TypeError, match="x"):
        fq.backward(np.zeros(np.shape(bad), F32), bad)
    with pytest.raises(TypeError):
        fq.quantization_noise(bad)
    with pytest.raises(TypeError):
        as_float32(bad, "w")


def test_as_float32_returns_same_array_when_already_fine():
    a = np.zeros((3, 4), F32)
    assert as_float32(a) is a
    b = as_float32(a.T)
    assert b.flags.c_contiguous and b.dtype == np.float32 and np.array_equal(b, a.T)


@pytest.mark.parametrize("gshape,xshape", [((3,), (4,)), ((2, 3), (3, 2)), ((6,), (2, 3)), ((1, 4), (4,))])
def test_backward_shape_mismatch_names_both_shapes(gshape, xshape):
    fq = make()
    with pytest.raises(ValueError) as err:
        fq.backward(np.zeros(gshape, F32), np.zeros(xshape, F32))
    msg = str(err.value)
    assert str(gshape) in msg and str(xshape) in msg and "grad_output" in msg


# ----------------------------------------------------------------------------- backward

BACKWARD_CONFIGS = [  # bits, symmetric, narrow, scale, zp
    (8, True, False, 0.05, 0),
    (8, True, True, 0.02, 0),
    (4, True, False, 0.3, 0),
    (4, True, False, 0.3, 2),     # symmetric with a zero-point: c = -zp*s
    (2, True, True, 0.6, 0),      # ternary: u = x/s
    (1, True, False, 0.5, 0),     # 1-bit: h = s
    (8, False, False, 0.03, 120),
    (3, False, False, 0.5, 0),
    (16, False, False, 1e-4, 30000),
]


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("cfg", BACKWARD_CONFIGS)
def test_backward_vs_reference(rng, kind, cfg):
    bits, sym, narrow, s, zp = cfg
    fq = make(bits, sym, narrow, s, zp, ste=kind)
    qmin, qmax = fq.quant_range()
    x = data(rng, 2000, s, zp, qmin, qmax, special=False)
    g = rng.uniform(-1, 1, x.size).astype(F32)
    dx = fq.backward(g, x)
    assert dx.dtype == np.float32 and dx.shape == x.shape
    expect = ref.ste_backward(kind, x, g, s, zp, qmin, qmax, sym)
    if kind in ("identity", "clipped_identity"):
        assert np.array_equal(dx, expect.astype(F32))
    else:
        np.testing.assert_allclose(dx, expect, rtol=0, atol=1e-6 if kind == "tanh" else 2e-6)
        np.testing.assert_allclose(dx[:100], ref.ste_backward_loop(kind, x[:100], g[:100], s, zp, qmin, qmax, sym),
                                   rtol=0, atol=2e-6)
    if kind == "hard_tanh":
        u32 = ref.ste_u_f32(x, s, zp, qmin, qmax, sym)
        assert np.all(dx[np.abs(u32) >= 1] == 0)
    if kind == "clipped_identity":
        assert 0 < np.count_nonzero(dx == 0) < x.size  # both sides of the mask are exercised


def test_clipped_mask_equals_forward_saturation(rng):
    """CLIPPED_IDENTITY passes g exactly where the clamp did not act in the forward."""
    fq = make(bits=4, symmetric=False, scale=0.2, zp=4)
    x = data(rng, 3000, 0.2, 4, 0, 15, special=False)
    dx = fq.backward(np.ones_like(x), x)
    assert np.array_equal(dx == 1, ref.fq_mask(x, 0.2, 4, 0, 15))
    # the mask is integer-domain: x half a step beyond the float range still passes (rint brings it back)
    lo, hi = fq.float_range()
    edge = np.array([hi + 0.49 * 0.2, hi + 0.51 * 0.2, lo - 0.49 * 0.2, lo - 0.51 * 0.2], F32)
    assert np.array_equal(fq.backward(np.ones(4, F32), edge), np.array([1, 0, 1, 0], F32))


def test_nan_in_backward_does_not_crash():
    x = np.array([np.nan, 0.1, np.inf, -np.inf], F32)
    g = np.ones(4, F32)
    fq = make(scale=0.1)
    for kind in KINDS:
        fq.ste = kind
        dx = fq.backward(g, x)
        assert dx.shape == (4,)
    fq.ste = "identity"
    assert np.array_equal(fq.backward(g, x), g)
    fq.ste = "clipped_identity"  # same mask as torch: NaN and +-inf are "clamped"
    assert np.array_equal(fq.backward(g, x), np.array([0, 1, 0, 0], F32))


class TestSteNormalisation:
    """u = x/(qmax*s) for symmetric, (x - centre)/half_width for affine, x/s for the ternary range."""

    def test_symmetric_divides_by_the_range(self):
        fq = make(bits=8, scale=0.5, ste="hard_tanh")  # qmax*s = 63.5
        x = np.array([0.0, 31.75, -31.75, 63.5, -63.5, 1.0, 100.0], F32)
        dx = fq.backward(np.ones_like(x), x)
        np.testing.assert_allclose(dx, [1, 0.5, 0.5, 0, 0, 1 - 1 / 63.5, 0], atol=1e-6)
        # NOT u = x/s (which would zero every |x| >= s = 0.5)
        assert dx[5] > 0.98
        fq.ste = "tanh"
        dx = fq.backward(np.ones_like(x), x)
        np.testing.assert_allclose(dx[:5], 1 - np.tanh([0, 0.5, -0.5, 1, -1]) ** 2, atol=1e-6)

    def test_same_shape_at_every_bit_width(self):
        """Measured in units of the range, the surrogate is the same function for every bit width."""
        u = np.linspace(-1.2, 1.2, 49)
        for kind in ("tanh", "hard_tanh"):
            curves = []
            for bits in (3, 4, 8, 12):
                s = 1.0 / (2 ** (bits - 1) - 1)  # qmax*s = 1
                fq = make(bits=bits, scale=s, ste=kind)
                curves.append(fq.backward(np.ones(u.size, F32), u.astype(F32)))
            for c in curves[1:]:
                np.testing.assert_allclose(c, curves[0], atol=2e-6)

    def test_affine_uses_centre_and_half_width(self):
        fq = make(bits=4, symmetric=False, scale=0.1, zp=5, ste="hard_tanh")  # range [-0.5, 1.0]
        x = np.array([0.25, 1.0, -0.5, 0.625, -0.125, 2.0], F32)
        dx = fq.backward(np.ones_like(x), x)
        np.testing.assert_allclose(dx, [1, 0, 0, 0.5, 0.5, 0], atol=1e-6)
        fq.ste = "tanh"
        dx = fq.backward(np.ones_like(x), x)
        np.testing.assert_allclose(dx[:4], 1 - np.tanh([0, 1, -1, 0.5]) ** 2, atol=1e-6)

    def test_ternary_range_is_x_over_s(self):
        fq = make(bits=2, narrow=True, scale=0.4, ste="hard_tanh")
        x = np.array([0.0, 0.2, -0.2, 0.4, -0.4, 0.1, 1.0], F32)
        dx = fq.backward(np.ones_like(x), x)
        np.testing.assert_allclose(dx, np.maximum(0, 1 - np.abs(x / 0.4)), atol=1e-6)
        fq.ste = "tanh"
        np.testing.assert_allclose(fq.backward(np.ones_like(x), x), 1 - np.tanh(x / 0.4) ** 2, atol=1e-6)

    def test_one_bit_symmetric_half_width_is_s(self):
        fq = make(bits=1, scale=0.5, ste="hard_tanh")
        x = np.array([0.0, -0.25, 0.25, -0.5, 0.5], F32)
        np.testing.assert_allclose(fq.backward(np.ones_like(x), x), [1, 0.5, 0.5, 0, 0], atol=1e-6)


def test_backward_uses_current_params_after_observing_forward(rng):
    """With observer_enabled, forward updates scale/zp; backward then uses exactly those."""
    fq = make(bits=4, symmetric=False, scale=1.0, zp=0, observer_enabled=True)
    x = (rng.standard_normal(500) * 3).astype(F32)
    y = fq.forward(x)
    s, zp = fq.scale, fq.zero_point
    assert (s, zp) != (1.0, 0)
    assert np.array_equal(y, ref.fq_forward(x, s, zp, 0, 15))
    dx = fq.backward(np.ones_like(x), x)
    assert np.array_equal(dx == 1, ref.fq_mask(x, s, zp, 0, 15))
    assert (fq.scale, fq.zero_point) == (s, zp)  # backward never observes


# ----------------------------------------------------------------------------- LSQ

@pytest.mark.parametrize("cfg", BACKWARD_CONFIGS)
def test_lsq_scale_grad_vs_reference(rng, cfg):
    bits, sym, narrow, s, zp = cfg
    fq = make(bits, sym, narrow, s, zp)
    qmin, qmax = fq.quant_range()
    x = data(rng, 3000, s, zp, qmin, qmax, special=False).reshape(30, 100)
    g = rng.standard_normal(x.shape).astype(F32)
    dx, ds = fq.backward(g, x, return_scale_grad=True)
    assert isinstance(ds, float)
    assert math.isclose(ds, ref.lsq_scale_grad(x, g, s, zp, qmin, qmax), rel_tol=2e-5, abs_tol=1e-6)
    assert np.array_equal(dx, fq.backward(g, x))  # dx unaffected by asking for d_scale
    assert fq.scale_grad is None  # only stored with learn_scale


def test_lsq_terms():
    """dy/ds = rint(x/s) - x/s inside, qmin - zp below, qmax - zp above; factor 1/sqrt(N*qmax)."""
    fq = make(bits=4, symmetric=True, scale=0.5)  # [-8, 7]
    n = 1
    for xv, d in [(0.6, 1 - 1.2), (0.2, 0 - 0.4), (-0.85, -2 + 1.7), (100.0, 7), (-100.0, -8)]:
        _, ds = fq.backward(np.ones(n, F32), np.array([xv], F32), return_scale_grad=True)
        assert math.isclose(ds, d / math.sqrt(n * 7), rel_tol=1e-6, abs_tol=1e-7), xv
    fa = make(bits=4, symmetric=False, scale=0.5, zp=3)  # [0, 15]
    for xv, d in [(100.0, 15 - 3), (-100.0, 0 - 3)]:
        _, ds = fa.backward(np.ones(1, F32), np.array([xv], F32), return_scale_grad=True)
        assert math.isclose(ds, d / math.sqrt(15), rel_tol=1e-7)
    # the factor uses the number of elements per scale
    x = np.full(16, 100.0, F32)
    _, ds = fq.backward(np.ones(16, F32), x, return_scale_grad=True)
    assert math.isclose(ds, 16 * 7 / math.sqrt(16 * 7), rel_tol=1e-7)


def test_lsq_learn_scale_stores_grad_and_allows_aliasing(rng):
    fq = make(bits=8, scale=0.02, learn_scale=True)
    x = (rng.standard_normal(1000) * 2).astype(F32)
    g = rng.standard_normal(1000).astype(F32)
    dx = fq.backward(g, x)
    expect = ref.lsq_scale_grad(x, g, 0.02, 0, -128, 127)
    assert math.isclose(fq.scale_grad, expect, rel_tol=2e-5)
    g2 = g.copy()
    dx2, ds2 = fq.backward(g2, x, out=g2, return_scale_grad=True)  # out aliases grad_output
    assert dx2 is g2 and np.array_equal(dx2, dx)
    assert ds2 == fq.scale_grad and math.isclose(ds2, expect, rel_tol=2e-5)


def test_lsq_one_bit_uses_max_qmax_1():
    """1-bit symmetric has qmax = 0: the factor is 1/sqrt(N * max(qmax, 1)) instead of a division by 0."""
    fq = make(bits=1, scale=0.5)
    x = np.array([-0.1, -100.0, 100.0, -0.4], F32)
    _, ds = fq.backward(np.ones(4, F32), x, return_scale_grad=True)
    assert math.isclose(ds, ref.lsq_scale_grad(x, np.ones(4), 0.5, 0, -1, 0), rel_tol=1e-6)
    assert math.isfinite(ds)


# ----------------------------------------------------------------------------- statistics

@pytest.mark.parametrize("cfg", BACKWARD_CONFIGS)
def test_noise_saturation_sqnr_vs_reference(rng, cfg):
    bits, sym, narrow, s, zp = cfg
    fq = make(bits, sym, narrow, s, zp)
    qmin, qmax = fq.quant_range()
    x = data(rng, 2000, s, zp, qmin, qmax, special=False)
    y = ref.fq_forward(x, s, zp, qmin, qmax)
    noise = fq.quantization_noise(x)
    assert type(noise) is float
    assert math.isclose(noise, ref.quantization_noise(x, y), rel_tol=1e-12)
    assert math.isclose(noise, float(np.mean((x.astype(np.float64) - fq.forward(x)) ** 2)), rel_tol=1e-9)
    assert fq.saturation_fraction(x) == ref.saturation_fraction(x, s, zp, qmin, qmax)
    assert math.isclose(fq.sqnr_db(x), ref.sqnr_db(x, y), rel_tol=1e-9)
    assert fq.noise_stats(x) == (noise, fq.sqnr_db(x), fq.saturation_fraction(x))   # one pass, same numbers


def test_statistics_edge_cases():
    fq = make(scale=0.25)
    empty = np.empty((0, 3), F32)
    assert fq.quantization_noise(empty) == 0.0 and type(fq.quantization_noise(empty)) is float
    assert fq.saturation_fraction(empty) == 0.0
    assert math.isnan(fq.sqnr_db(empty))
    mse, sqnr, sat = fq.noise_stats(empty)
    assert mse == 0.0 and math.isnan(sqnr) and sat == 0.0
    grid = np.array([0.25, -0.5, 1.0, 0.0], F32)  # on the grid: no noise
    assert fq.quantization_noise(grid) == 0.0 and fq.sqnr_db(grid) == math.inf
    assert math.isnan(fq.sqnr_db(np.zeros(5, F32)))
    assert fq.saturation_fraction(np.array([1e9, -1e9, 0, 0], F32)) == 0.5
    assert fq.quantization_noise(np.array([np.inf], F32)) == math.inf
    assert math.isnan(fq.quantization_noise(np.array([np.nan, 0.0], F32)))


def test_noise_bounded_by_quarter_step_squared_in_range(rng):
    for fq in (make(scale=0.01), make(bits=4, symmetric=False, scale=0.2, zp=7)):
        lo, hi = fq.float_range()
        x = rng.uniform(lo, hi, 5000).astype(F32)
        s = fq.scale
        assert fq.quantization_noise(x) <= s * s / 4
        assert np.max(np.abs(x - fq.forward(x))) <= s / 2 * (1 + 1e-5)
        assert fq.saturation_fraction(x) == 0.0


# ----------------------------------------------------------------------------- per-channel

@pytest.mark.parametrize("axis", [0, 1, 2, -1, -3])
@pytest.mark.parametrize("symmetric", [True, False])
def test_per_channel_forward_backward(rng, axis, symmetric):
    shape = (3, 4, 5)
    C = shape[axis]
    bits = 4
    qmin, qmax = ref.integer_range(bits, symmetric, False)
    s = rng.uniform(0.05, 0.5, C).astype(F32)
    zp = np.zeros(C, np.int64) if symmetric else rng.integers(qmin, qmax + 1, C)
    x = (rng.standard_normal(shape) * 2).astype(F32)
    x.flat[[0, 7, 19]] = [np.inf, -np.inf, np.nan]
    g = rng.uniform(-1, 1, shape).astype(F32)
    for kind in KINDS:
        fq = ql.FakeQuantize(bits=bits, symmetric=symmetric, scale=s, zero_point=zp, axis=axis, ste=kind)
        y = fq.forward(x)
        assert np.array_equal(y, ref.fq_forward_pc(x, axis, s, zp, qmin, qmax), equal_nan=True)
        xf = np.nan_to_num(x, nan=0.0, posinf=9.0, neginf=-9.0)
        dx, ds = fq.backward(g, xf, return_scale_grad=True)
        expect = ref.ste_backward_pc(kind, xf, g, axis, s, zp, qmin, qmax, symmetric)
        np.testing.assert_allclose(dx, expect, rtol=0, atol=0 if kind in ("identity", "clipped_identity") else 2e-6)
        assert ds.shape == (C,)
        np.testing.assert_allclose(ds, ref.lsq_scale_grad_pc(xf, g, axis, s, zp, qmin, qmax), rtol=2e-5, atol=1e-6)
    lo, hi = fq.float_range()
    assert lo.shape == hi.shape == (C,)
    np.testing.assert_array_equal(hi, ((qmax - zp) * s).astype(F32))
    y = fq.forward(x)
    yv = np.moveaxis(np.nan_to_num(y), axis, 0).reshape(C, -1)
    assert np.all(yv >= lo[:, None]) and np.all(yv <= hi[:, None])
    assert math.isclose(fq.quantization_noise(xf), ref.quantization_noise(xf, fq.forward(xf)), rel_tol=1e-12)


def test_per_channel_scalar_params_broadcast(rng):
    x = rng.standard_normal((4, 6)).astype(F32)
    fq = ql.FakeQuantize(bits=8, scale=0.05, axis=1)
    assert np.array_equal(fq.forward(x), ref.fq_forward(x, 0.05, 0, -128, 127))


def test_per_channel_channel_count_mismatch(rng):
    fq = ql.FakeQuantize(bits=8, scale=np.full(3, 0.1), zero_point=np.zeros(3, np.int64), axis=0)
    with pytest.raises(ValueError, match="scale"):
        fq.forward(np.zeros((4, 2), F32))
    with pytest.raises(ValueError, match="axis"):
        ql.FakeQuantize(bits=8, scale=0.1, axis=2).forward(np.zeros((4, 2), F32))
    with pytest.raises(ValueError, match="zero_point"):
        ql.FakeQuantize(bits=8, scale=np.full(3, 0.1), zero_point=np.zeros(2, np.int64), axis=0)


def test_per_channel_values_without_axis_rejected():
    with pytest.raises(ValueError, match="axis"):
        ql.FakeQuantize(bits=8, scale=np.full(3, 0.1), zero_point=np.zeros(3, np.int64))
    fq = make(bits=8, scale=0.1)
    before = snapshot(fq)
    with pytest.raises(ValueError, match="axis"):
        fq.update_params(np.full(3, 0.1), 0)
    with pytest.raises(ValueError, match="axis"):
        fq.scale = np.full(3, 0.1)
    assert_same_snapshot(before, snapshot(fq))
    pc = ql.FakeQuantize(bits=8, scale=np.full(3, 0.1), zero_point=np.zeros(3, np.int64), axis=0)
    with pytest.raises(ValueError, match="axis"):
        pc.axis = None


def test_per_channel_shapes_rechecked_when_one_field_is_set():
    fq = ql.FakeQuantize(bits=8, scale=np.full(3, 0.1, F32), zero_point=np.zeros(3, np.int64), axis=0)
    before = snapshot(fq)
    with pytest.raises(ValueError, match="zero_point: shape"):
        fq.scale = np.full(2, 0.1, F32)
    with pytest.raises(ValueError, match="zero_point: shape"):
        fq.zero_point = np.zeros(4, np.int64)
    assert_same_snapshot(before, snapshot(fq))


@pytest.mark.parametrize("field", ["bits", "axis"])
def test_booleans_are_not_integers(field):
    with pytest.raises(TypeError, match=field):
        ql.FakeQuantize(**{field: True})
    fq = make()
    before = snapshot(fq)
    with pytest.raises(TypeError, match=field):
        setattr(fq, field, True)
    assert_same_snapshot(before, snapshot(fq))
    with pytest.raises(ValueError, match="zero_point"):
        ql.FakeQuantize(zero_point=True)


@pytest.mark.parametrize("axis", [None, 0])
def test_disabled_backward_gives_a_zero_scale_gradient_of_the_scale_shape(rng, axis):
    scale = 0.1 if axis is None else np.full(3, 0.1, F32)
    zp = 0 if axis is None else np.zeros(3, np.int64)
    fq = make(scale=scale, zp=zp, axis=axis, learn_scale=True)
    x = rng.standard_normal((3, 5)).astype(F32)
    fq.backward(x, x)
    assert np.any(np.asarray(fq.scale_grad) != 0)
    fq.enabled = False
    dx, d_scale = fq.backward(x, x, return_scale_grad=True)
    assert np.array_equal(dx, x)
    assert np.shape(d_scale) == np.shape(scale) and not np.any(d_scale)
    assert np.shape(fq.scale_grad) == np.shape(scale) and not np.any(fq.scale_grad)   # not the last enabled one


# ----------------------------------------------------------------------------- validation

BAD_FIELDS = [
    ("bits", 0), ("bits", 17), ("scale", 0.0), ("scale", -1.0), ("scale", float("nan")), ("scale", float("inf")),
    ("scale", "abc"), ("scale", "0.5"), ("scale", None), ("scale", np.array([0.1, -0.1])), ("scale", np.ones((2, 2))),
    ("zero_point", 128), ("zero_point", -129), ("zero_point", 1.5), ("zero_point", "a"),
    ("ste", "bogus"), ("ste", 7),
]


@pytest.mark.parametrize("field,value", BAD_FIELDS)
def test_bad_field_names_field_and_leaves_object_unchanged(field, value):
    fq = make(bits=8, scale=0.1, ste="tanh")
    before = snapshot(fq)
    x = np.linspace(-20, 20, 101, dtype=F32)
    y_before = fq.forward(x)
    with pytest.raises(ValueError) as err:
        setattr(fq, field, value)
    assert field in str(err.value)
    assert_same_snapshot(before, snapshot(fq))
    assert np.array_equal(fq.forward(x), y_before)
    with pytest.raises(ValueError) as err:
        ql.FakeQuantize(**{"bits": 8, "scale": 0.1, field: value})
    assert field in str(err.value)


@pytest.mark.parametrize("bits,symmetric,narrow,zp", [(4, True, False, 8), (4, True, True, -8), (4, False, False, -1),
                                                      (4, False, False, 16), (2, True, True, 2)])
def test_zero_point_outside_range_reports_range(bits, symmetric, narrow, zp):
    qmin, qmax = ref.integer_range(bits, symmetric, narrow)
    with pytest.raises(ValueError, match="zero_point") as err:
        ql.FakeQuantize(bits=bits, symmetric=symmetric, narrow_range=narrow, zero_point=zp)
    assert f"[{qmin}, {qmax}]" in str(err.value)


@pytest.mark.parametrize("zp", [np.zeros((2, 2)), np.array([]), np.zeros((2, 2), np.int64), np.array([], np.int64),
                                np.array([0.5, 1.0]), np.array([np.nan]), None])
def test_zero_point_must_be_integer_scalar_or_1d(zp):
    """float-typed arrays are held to the same shape rules as int arrays (2-D / empty rejected)."""
    fq = make(bits=8, scale=0.1)
    before = snapshot(fq)
    with pytest.raises(ValueError, match="zero_point"):
        fq.zero_point = zp
    with pytest.raises(ValueError, match="zero_point"):
        fq.update_params(0.1, zp)
    assert_same_snapshot(before, snapshot(fq))


def test_zero_point_integral_floats_accepted():
    fq = make(bits=8, symmetric=False, scale=0.1)
    fq.update_params(0.1, 7.0)
    assert fq.zero_point == 7 and type(fq.zero_point) is int
    fq.axis = 0
    fq.update_params(np.array([0.1, 0.2]), np.array([3.0, 4.0]))
    assert fq.zero_point.dtype == np.int64 and fq.zero_point.tolist() == [3, 4]


def test_changing_range_fields_revalidates_zero_point():
    fq = make(bits=8, symmetric=False, scale=0.1, zp=200)
    before = snapshot(fq)
    with pytest.raises(ValueError, match="zero_point"):
        fq.bits = 4  # zp 200 outside [0, 15]
    with pytest.raises(ValueError, match="zero_point"):
        fq.symmetric = True  # zp 200 outside [-128, 127]
    assert_same_snapshot(before, snapshot(fq))
    fs = make(bits=8, zp=-128)
    with pytest.raises(ValueError, match="zero_point"):
        fs.narrow_range = True
    assert fs.narrow_range is False


@pytest.mark.parametrize("scale", [1e39, 3.4e38, 1e34, 1e-45, 1e-39, float("inf"),
                                   np.array([0.1, 1e39]), np.array([1e-45, 0.1], F32)])
def test_scale_that_float32_cannot_hold_is_refused_everywhere(scale):
    """Beyond float32 max (forward gave NaN), subnormal (1/s overflows) or with levels past float32
    max: refused by the constructor, the Param setter and update_params, nothing changed."""
    per_channel = np.ndim(scale) == 1
    with pytest.raises(ValueError, match=r"scale: must be a finite number > 0 that float32 holds"):
        ql.FakeQuantize(bits=8, scale=scale, axis=0 if per_channel else None)
    fq = ql.FakeQuantize(bits=8, scale=np.full(2, 0.1) if per_channel else 0.1, axis=0 if per_channel else None)
    before = snapshot(fq)
    with pytest.raises(ValueError, match="scale"):
        fq.update_params(scale, np.zeros(2, np.int64) if per_channel else 0)
    with pytest.raises(ValueError, match="scale"):
        fq.scale = scale
    assert_same_snapshot(before, snapshot(fq))


def test_extreme_scales_float32_holds_give_finite_levels(rng):
    x = rng.standard_normal(64).astype(F32) * F32(1e30)
    for s in (ql.quant.SCALE_MIN, ql.quant.SCALE_MAX):
        fq = ql.FakeQuantize(bits=16, symmetric=True, scale=s)
        assert np.all(np.isfinite(fq.forward(x))) and np.all(np.isfinite(fq.float_range()))


@pytest.mark.parametrize("scale,zp,field", [(-1.0, 0, "scale"), (float("nan"), 0, "scale"), (0.0, 0, "scale"),
                                            (0.5, 300, "zero_point"), (0.5, 2.5, "zero_point"),
                                            (np.ones(3), np.zeros(2, np.int64), "zero_point")])
def test_update_params_is_all_or_nothing(scale, zp, field):
    fq = make(bits=8, scale=0.1, zp=5)
    before = snapshot(fq)
    with pytest.raises(ValueError, match=field):
        fq.update_params(scale, zp)
    assert_same_snapshot(before, snapshot(fq))


def test_update_params_sets_both_and_copies_arrays():
    fq = make(bits=8, symmetric=False, scale=0.1, zp=5)
    fq.update_params(0.25, 100)
    assert (fq.scale, fq.zero_point) == (0.25, 100) and type(fq.zero_point) is int
    s = np.array([0.1, 0.2], F32)
    z = np.array([1, 2])
    fq.axis = 0
    fq.update_params(s, z)
    s[0] = 99.0
    z[0] = 50
    assert fq.scale[0] == F32(0.1) and fq.zero_point[0] == 1
    events = []
    fq.param.watch(lambda *e: events.append(e), ["scale", "zero_point"])
    fq.update_params(0.5, 3)
    assert events


def test_ste_accepts_strings_and_kinds():
    fq = make(ste="hard_tanh")
    assert fq.ste is ql.SteKind.HARD_TANH
    fq.ste = ql.SteKind.TANH
    assert fq.ste is ql.SteKind.TANH
    fq.ste = "IDENTITY"
    assert fq.ste is ql.SteKind.IDENTITY


# ----------------------------------------------------------------------------- calibrate

def test_calibrate_takes_params_from_observer(rng):
    x = (rng.standard_normal(1000) * 2 + 1).astype(F32)
    for sym in (True, False):
        fq = make(bits=4, symmetric=sym, scale=1.0, zp=0)
        qmin, qmax = fq.quant_range()
        s, zp = fq.calibrate(x)
        rs, rz = ref.minmax_qparams(*ref.batch_minmax(x), qmin, qmax, sym)
        assert (s, zp) == (float(rs), int(rz)) == (fq.scale, fq.zero_point)
        assert np.array_equal(fq.forward(x), ref.fq_forward(x, s, zp, qmin, qmax))


def test_calibrate_per_channel(rng):
    x = (rng.standard_normal((6, 4)) * rng.uniform(0.1, 5, 4)).astype(F32)
    fq = ql.FakeQuantize(bits=8, symmetric=False, axis=1)
    s, zp = fq.calibrate(x)
    rs, rz = ref.minmax_qparams(*ref.batch_minmax(x, axis=1), 0, 255, False)
    assert np.array_equal(s, rs) and np.array_equal(zp, rz)
    assert np.array_equal(fq.forward(x), ref.fq_forward_pc(x, 1, rs, rz, 0, 255))


def test_calibrate_nan_leaves_quantizer_unchanged(rng):
    fq = make(bits=8, scale=0.1, observer_enabled=True)
    x = rng.standard_normal(100).astype(F32)
    fq.forward(x)
    before = snapshot(fq)
    bad = x.copy()
    bad[5] = np.nan
    with pytest.raises(ValueError, match="NaN"):
        fq.calibrate(bad)
    with pytest.raises(ValueError, match="NaN"):
        fq.forward(bad)
    assert_same_snapshot(before, snapshot(fq))
    assert (fq.observer.min_val, fq.observer.max_val) == ref.batch_minmax(x)


# ----------------------------------------------------------------------------- state coherence

def _fresh(fq):
    """A new FakeQuantize with the same field values (copies of arrays): the uncached truth."""
    vals = {k: (np.array(v, copy=True) if isinstance(v, np.ndarray) else v)
            for k, v in fq.param.values().items() if k != "name"}
    return ql.FakeQuantize(**vals)


@pytest.mark.parametrize("change", [
    ("bits", 4), ("symmetric", False), ("narrow_range", True), ("scale", 0.37), ("zero_point", 3),
    ("ste", "hard_tanh"), ("ste", "tanh"), ("enabled", False), ("learn_scale", True), ("axis", 0)])
def test_every_field_change_takes_effect(rng, change):
    """After any field is set, forward/backward/statistics equal those of a freshly built quantizer."""
    fq = make(bits=8, scale=0.05, zp=0)
    x = (rng.standard_normal((4, 50)) * 3).astype(F32)
    g = rng.standard_normal(x.shape).astype(F32)
    fq.forward(x)
    fq.backward(g, x)  # warm any internal cache
    setattr(fq, *change)
    fresh = _fresh(fq)
    assert np.array_equal(fq.forward(x), fresh.forward(x))
    assert np.array_equal(fq.backward(g, x), fresh.backward(g, x))
    assert fq.quantization_noise(x) == fresh.quantization_noise(x)
    assert fq.saturation_fraction(x) == fresh.saturation_fraction(x)


def test_update_params_takes_effect(rng):
    fq = make(bits=8, symmetric=False, scale=0.05, zp=0)
    x = (rng.standard_normal(300) * 3).astype(F32)
    fq.forward(x)
    fq.update_params(0.02, 100)
    assert np.array_equal(fq.forward(x), ref.fq_forward(x, 0.02, 100, 0, 255))


def test_per_channel_scale_array_and_forward_never_disagree(rng):
    """The per-channel scale the quantizer reports is the one forward uses.

    Two ways the stored array can change without a Param event: the caller mutates the
    array it passed to the constructor, or writes into ``fq.scale`` in place. Either the
    write must be refused (read-only / defensive copy) or forward must see it.
    """
    x = (rng.standard_normal((3, 40)) * 2).astype(F32)
    s = np.array([0.1, 0.2, 0.3], F32)
    zp = np.zeros(3, np.int64)
    fq = ql.FakeQuantize(bits=4, scale=s, zero_point=zp, axis=0)
    fq.forward(x)
    try:
        s[1] = 0.05  # the caller's array
    except ValueError:
        pass
    assert np.array_equal(fq.forward(x), ref.fq_forward_pc(x, 0, np.asarray(fq.scale), fq.zero_point, -8, 7))
    try:
        fq.scale[2] = 0.01  # in place on the stored array
    except ValueError:
        pass
    assert np.array_equal(fq.forward(x), ref.fq_forward_pc(x, 0, np.asarray(fq.scale), fq.zero_point, -8, 7))


@pytest.mark.parametrize("first,then", [(1, None), (None, 1), (0, 1)])
def test_calibrate_follows_the_current_axis(rng, first, then):
    """The observer built at construction must not leave calibrate() using a stale axis after
    ``fq.axis`` changes: either calibrate gives parameters for the current axis and forward works,
    or it refuses with a ValueError naming the axis and changes nothing."""
    x = (rng.standard_normal((4, 3)) * rng.uniform(0.5, 3, 3)).astype(F32)
    fq = ql.FakeQuantize(bits=8, axis=first)
    fq.axis = then
    before = snapshot(fq)
    try:
        fq.calibrate(x)
    except ValueError as err:
        assert "axis" in str(err)
        assert_same_snapshot(before, snapshot(fq))
        return
    lo, hi = ref.batch_minmax(x, axis=then)
    rs, rz = ref.minmax_qparams(lo, hi, -128, 127, True)
    assert np.array_equal(np.asarray(fq.scale, F32), rs) and np.array_equal(np.asarray(fq.zero_point), rz)
    assert np.array_equal(fq.forward(x), ref.fq_forward_pc(x, then, np.atleast_1d(rs) * np.ones(x.shape[then], F32),
                                                           np.zeros(x.shape[then], np.int64), -128, 127)
                          if then is not None else ref.fq_forward(x, float(rs), 0, -128, 127))


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("parts", [2, 3])
def test_split_across_cores_is_bit_identical(rng, force_split, kind, parts):
    """Large tensors are split across threads; the result is the same as one thread, bit for bit."""
    fq = make(8, True, False, 0.02, 0, ste=kind)
    x = rng.normal(0, 1.5, 10_007).astype(F32)        # odd size: unequal slices, some clamped values
    g = rng.uniform(-1, 1, x.size).astype(F32)
    y1, dx1 = fq.forward(x), fq.backward(g, x)          # below the threshold: one thread
    calls = force_split(parts, MIN_ELEMENTS=1000)
    y2, dx2 = fq.forward(x), fq.backward(g, x)
    assert [p for _, p in calls] == [parts, parts]      # the split path really ran
    assert np.array_equal(y1, y2) and np.array_equal(dx1, dx2)
    qmin, qmax = fq.quant_range()
    assert np.array_equal(y2, ref.fq_forward(x, 0.02, 0, qmin, qmax))
    inplace = x.copy()
    fq.forward(inplace, out=inplace)                     # out aliasing x, split in slices
    assert np.array_equal(inplace, y1)


def test_ternary_projection_of_a_big_tensor_is_split_with_the_same_bits(rng, force_split):
    """A ternary weight of >= parallel.MIN_ELEMENTS: alpha from float64 sums of slices, the
    projection in slices; finalize's ternary_quantize computes the same alpha."""
    w = rng.normal(0, 0.05, (101, 99)).astype(F32)
    tq = ql.TernaryQuantizer()
    y1, a1 = tq.forward(w).copy(), tq.alpha
    calls = force_split(2, MIN_ELEMENTS=1000)
    y2 = tq.forward(w)
    assert calls == [(8, 2), (w.size, 2)] and np.array_equal(y1, y2)    # the sum's 8 slices, the projection's 2
    assert tq.alpha == a1                # (the sum's slices do not depend on the cores: see test_fakequant_kernels)
    assert ql.ternary_quantize(w)[1] == tq.alpha
    alpha = np.float32(np.abs(w.astype(np.float64)).mean())
    assert np.array_equal(y2, alpha * np.clip(np.rint(w * (F32(1) / alpha)), -1, 1))
    w[3, 4] = np.nan
    with pytest.raises(ValueError, match="NaN"):
        tq.forward(w)
    assert tq.alpha == a1
