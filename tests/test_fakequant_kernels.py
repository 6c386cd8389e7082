"""The Numba kernels of qatlab.kernels.fakequant, each against its slow numpy reference."""
from __future__ import annotations

import math

import numpy as np
import pytest

import reference as ref
from qatlab.kernels import fakequant as K

F32 = np.float32
STE_CODES = {"identity": 0, "clipped_identity": 1, "tanh": 2, "hard_tanh": 3}

# (s, zp, qmin, qmax, symmetric)
CASES = [
    (0.05, 0, -128, 127, True),
    (0.05, 0, -127, 127, True),       # narrow
    (0.3, 0, -1, 1, True),            # ternary (2-bit narrow)
    (0.7, 0, -1, 0, True),            # 1-bit symmetric
    (0.02, 100, 0, 255, False),
    (0.25, 3, 0, 15, False),
    (1e-3, 0, -32768, 32767, True),   # 16 bit
    (0.1, 0, 0, 1, False),            # 1-bit affine
]


def scalars(s, zp, qmin, qmax, symmetric):
    """Kernel scalars exactly as FakeQuantize builds them (float32)."""
    s32, z32 = F32(s), F32(zp)
    inv_s = F32(1.0) / s32
    if symmetric:
        c, h = -z32 * s32, s32 * F32(qmax if qmax > 0 else -qmin)
    else:
        c, h = (F32((qmin + qmax) / 2) - z32) * s32, s32 * F32((qmax - qmin) / 2)
    return dict(inv_s=F32(inv_s), s=s32, zp=z32, c=F32(c), inv_h=F32(F32(1.0) / h),
                qmin=F32(qmin), qmax=F32(qmax))


def sample(rng, n, s, zp, qmin, qmax, special=True):
    """Inputs spanning the range and beyond, with exact ties (k + 0.5 steps) and zeros."""
    lo, hi = (qmin - zp) * s, (qmax - zp) * s
    span = max(hi - lo, s)
    x = rng.uniform(lo - 0.5 * span, hi + 0.5 * span, n)
    k = rng.integers(qmin - zp - 2, qmax - zp + 2, n // 4)
    x[: n // 4] = (k + 0.5) * s
    x[n // 4: n // 4 + 8] = 0.0
    x = x.astype(F32)
    if special:
        x[-3:] = [np.inf, -np.inf, np.nan]
    return x


@pytest.mark.parametrize("case", CASES)
def test_fq_forward_bit_exact(rng, case):
    s, zp, qmin, qmax, _ = case
    p = scalars(*case)
    x = sample(rng, 4001, s, zp, qmin, qmax)
    out = np.empty_like(x)
    K.fq_forward(x, p["inv_s"], p["s"], p["zp"], p["qmin"], p["qmax"], out)
    expect = ref.fq_forward(x, s, zp, qmin, qmax)
    assert np.array_equal(out, expect, equal_nan=True)
    assert np.array_equal(out[:300], ref.fq_forward_loop(x[:300], s, zp, qmin, qmax), equal_nan=True)
    assert np.isnan(out[-1])
    assert out[-3] == (qmax - zp) * F32(s) and out[-2] == (qmin - zp) * F32(s)


def test_fq_forward_in_place(rng):
    p = scalars(*CASES[0])
    x = sample(rng, 1000, *CASES[0][:4])
    expect = ref.fq_forward(x, *CASES[0][:4])
    K.fq_forward(x, p["inv_s"], p["s"], p["zp"], p["qmin"], p["qmax"], x)  # out aliases x
    assert np.array_equal(x, expect, equal_nan=True)


@pytest.mark.parametrize("case", CASES)
def test_fq_forward_mask(rng, case):
    s, zp, qmin, qmax, _ = case
    p = scalars(*case)
    x = sample(rng, 2001, s, zp, qmin, qmax)
    out = np.empty_like(x)
    mask = np.empty(x.shape, np.uint8)
    K.fq_forward_mask(x, p["inv_s"], p["s"], p["zp"], p["qmin"], p["qmax"], out, mask)
    assert np.array_equal(out, ref.fq_forward(x, s, zp, qmin, qmax), equal_nan=True)
    assert np.array_equal(mask.astype(bool), ref.fq_mask(x, s, zp, qmin, qmax))
    assert set(np.unique(mask)) <= {0, 1}
    assert mask[-1] == 0 and mask[-2] == 0 and mask[-3] == 0  # NaN, -inf, +inf


@pytest.mark.parametrize("case", CASES)
@pytest.mark.parametrize("kind", list(STE_CODES))
def test_fq_backward(rng, case, kind):
    s, zp, qmin, qmax, sym = case
    p = scalars(*case)
    x = sample(rng, 2000, s, zp, qmin, qmax, special=False)
    g = rng.uniform(-1, 1, x.size).astype(F32)
    out = np.empty_like(x)
    K.fq_backward(x, g, STE_CODES[kind], p["inv_s"], p["zp"], p["qmin"], p["qmax"], p["c"], p["inv_h"], out)
    expect = ref.ste_backward(kind, x, g, s, zp, qmin, qmax, sym)
    if kind in ("identity", "clipped_identity"):
        assert np.array_equal(out, expect.astype(F32))  # a copy or a zero: exact
    elif kind == "tanh":
        np.testing.assert_allclose(out, expect, rtol=0, atol=1e-6)
    else:
        np.testing.assert_allclose(out, expect, rtol=0, atol=2e-6)
        u32 = ref.ste_u_f32(x, s, zp, qmin, qmax, sym)
        assert np.all(out[np.abs(u32) >= 1] == 0)
        assert np.all(out[(np.abs(u32) < 1) & (g != 0)] != 0)


def test_fq_backward_loop_reference_agrees(rng):
    """The vectorized and the element-loop references describe the same thing."""
    s, zp, qmin, qmax, sym = CASES[4]
    x = sample(rng, 200, s, zp, qmin, qmax, special=False)
    g = rng.uniform(-1, 1, x.size).astype(F32)
    for kind in STE_CODES:
        np.testing.assert_allclose(ref.ste_backward(kind, x, g, s, zp, qmin, qmax, sym),
                                   ref.ste_backward_loop(kind, x, g, s, zp, qmin, qmax, sym), atol=1e-12)


@pytest.mark.parametrize("kind", list(STE_CODES))
def test_fq_backward_out_may_alias_g(rng, kind):
    """out = g (in place, its own loop) gives the two-array loop's numbers bit for bit, NaN included."""
    s, zp, qmin, qmax, sym = CASES[0]
    p = scalars(*CASES[0])
    x = sample(rng, 500, s, zp, qmin, qmax, special=True)
    g = rng.uniform(-1, 1, x.size).astype(F32)
    g[:3] = [np.nan, np.inf, 0.0]
    args = (STE_CODES[kind], p["inv_s"], p["zp"], p["qmin"], p["qmax"], p["c"], p["inv_h"])
    expect = np.empty_like(g)
    K.fq_backward(x, g, *args, expect)
    K.fq_backward(x, g, *args, g)
    np.testing.assert_array_equal(g, expect)      # (the two-array loop is checked against numpy above)


def test_exp_neg_relative_error():
    x = np.concatenate([np.linspace(-87, 0, 200001), [-1e-30, -0.0, -86.99]]).astype(F32)
    e = np.array([K.exp_neg(v) for v in x])
    ref = np.exp(x.astype(np.float64))
    assert (np.abs(e - ref) / ref).max() < 5e-7
    assert K.exp_neg(F32(0.0)) == 1.0
    assert K.exp_neg(F32(-87.5)) == 0.0 and K.exp_neg(F32(-np.inf)) == 0.0   # below the normal floats
    assert math.isnan(K.exp_neg(F32(np.nan)))


def test_sech2_keeps_float32_accuracy_in_the_tails():
    # 1 - tanh(u)^2 cancels where tanh(u) rounds near 1: at 4 bits, scale 0.05, u reaches ~16, where
    # the true value is ~1e-14; the sech^2 form keeps a float32 relative error there.
    u = np.concatenate([np.linspace(-43, 43, 172001), [0.0]]).astype(F32)
    got = np.array([K.sech2(v) for v in u])
    ref = 1.0 / np.cosh(u.astype(np.float64)) ** 2
    assert (np.abs(got - ref) / ref).max() < 5e-7
    assert K.sech2(F32(0.0)) == 1.0
    assert K.sech2(F32(44.0)) == 0.0 and K.sech2(F32(np.inf)) == 0.0 and K.sech2(F32(-np.inf)) == 0.0
    assert math.isnan(K.sech2(F32(np.nan)))


def test_tanh_backward_is_sech2_everywhere():
    u = np.linspace(-40, 40, 100001).astype(F32)
    g = np.ones_like(u)
    out = np.empty_like(u)
    K.fq_backward(u, g, 2, F32(1), F32(0), F32(-128), F32(127), F32(0), F32(1), out)
    ref = 1.0 / np.cosh(u.astype(np.float64)) ** 2
    assert (np.abs(out - ref) / ref).max() < 5e-7


@pytest.mark.parametrize("case", CASES)
def test_fq_noise_saturation(rng, case):
    s, zp, qmin, qmax, _ = case
    p = scalars(*case)
    x = sample(rng, 3000, s, zp, qmin, qmax, special=False)
    sq, sat, signal = K.fq_noise_saturation(x, p["inv_s"], p["s"], p["zp"], p["qmin"], p["qmax"])
    y = ref.fq_forward(x, s, zp, qmin, qmax)
    assert math.isclose(sq / x.size, ref.quantization_noise(x, y), rel_tol=1e-12)
    assert math.isclose(signal, math.fsum((x.astype(np.float64) ** 2).tolist()), rel_tol=1e-12)
    assert sat / x.size == ref.saturation_fraction(x, s, zp, qmin, qmax)
    assert sat > 0


def test_fq_noise_saturation_empty_and_special():
    p = scalars(*CASES[0])
    args = (p["inv_s"], p["s"], p["zp"], p["qmin"], p["qmax"])
    assert K.fq_noise_saturation(np.empty(0, F32), *args) == (0.0, 0, 0.0)
    sq, sat, signal = K.fq_noise_saturation(np.array([np.inf, 0.0], F32), *args)
    assert sq == math.inf and sat == 1 and signal == math.inf
    sq, sat, signal = K.fq_noise_saturation(np.array([np.nan, 0.0], F32), *args)
    assert math.isnan(sq) and sat == 0 and math.isnan(signal)


@pytest.mark.parametrize("case", CASES)
def test_fq_lsq_scale_grad(rng, case):
    s, zp, qmin, qmax, _ = case
    p = scalars(*case)
    x = sample(rng, 3000, s, zp, qmin, qmax, special=False)
    g = rng.standard_normal(x.size).astype(F32)
    got = K.fq_lsq_scale_grad(x, g, p["inv_s"], p["zp"], p["qmin"], p["qmax"])
    expect = ref.lsq_scale_grad(x, g, s, zp, qmin, qmax) * math.sqrt(x.size * max(qmax, 1))
    assert math.isclose(got, expect, rel_tol=1e-5, abs_tol=1e-4)


# ----------------------------------------------------------------------------- per-channel kernels

def pc_setup(rng, shape=(3, 5, 7), symmetric=True):
    C = shape[1]
    s = rng.uniform(0.01, 0.5, C).astype(F32)
    if symmetric:
        qmin, qmax = -8, 7
        zp = np.zeros(C, np.int64)
    else:
        qmin, qmax = 0, 15
        zp = rng.integers(0, 16, C)
    x = (rng.standard_normal(shape) * 2).astype(F32)
    x[0, :, 0] = (np.arange(C) + 0.5) * s  # ties
    return x, s, zp, qmin, qmax


def pc_scalars(s, zp, qmin, qmax, symmetric):
    per = [scalars(si, zi, qmin, qmax, symmetric) for si, zi in zip(s, zp)]
    arr = {k: np.array([d[k] for d in per], F32) for k in ("inv_s", "s", "zp", "c", "inv_h")}
    arr["qmin"], arr["qmax"] = F32(qmin), F32(qmax)
    return arr


@pytest.mark.parametrize("symmetric", [True, False])
def test_fq_forward_pc(rng, symmetric):
    x, s, zp, qmin, qmax = pc_setup(rng, symmetric=symmetric)
    x[1, 2, 3], x[2, 0, 1], x[0, 4, 6] = np.inf, -np.inf, np.nan
    p = pc_scalars(s, zp, qmin, qmax, symmetric)
    out = np.empty_like(x)
    K.fq_forward_pc(x, p["inv_s"], p["s"], p["zp"], p["qmin"], p["qmax"], out)
    assert np.array_equal(out, ref.fq_forward_pc(x, 1, s, zp, qmin, qmax), equal_nan=True)


@pytest.mark.parametrize("symmetric", [True, False])
@pytest.mark.parametrize("kind", list(STE_CODES))
def test_fq_backward_pc(rng, symmetric, kind):
    x, s, zp, qmin, qmax = pc_setup(rng, symmetric=symmetric)
    g = rng.uniform(-1, 1, x.shape).astype(F32)
    p = pc_scalars(s, zp, qmin, qmax, symmetric)
    out = np.empty_like(x)
    K.fq_backward_pc(x, g, STE_CODES[kind], p["inv_s"], p["zp"], p["qmin"], p["qmax"], p["c"], p["inv_h"], out)
    expect = ref.ste_backward_pc(kind, x, g, 1, s, zp, qmin, qmax, symmetric)
    np.testing.assert_allclose(out, expect, rtol=0, atol=0 if kind in ("identity", "clipped_identity") else 2e-6)


@pytest.mark.parametrize("symmetric", [True, False])
def test_fq_noise_saturation_pc_and_lsq_pc(rng, symmetric):
    x, s, zp, qmin, qmax = pc_setup(rng, symmetric=symmetric)
    g = rng.standard_normal(x.shape).astype(F32)
    p = pc_scalars(s, zp, qmin, qmax, symmetric)
    sq, sat, signal = K.fq_noise_saturation_pc(x, p["inv_s"], p["s"], p["zp"], p["qmin"], p["qmax"])
    y = ref.fq_forward_pc(x, 1, s, zp, qmin, qmax)
    assert math.isclose(sq / x.size, ref.quantization_noise(x, y), rel_tol=1e-12)
    assert math.isclose(signal, math.fsum((x.astype(np.float64) ** 2).ravel().tolist()), rel_tol=1e-12)
    n_sat = sum(ref.saturation_fraction(np.take(x, c, axis=1), s[c], zp[c], qmin, qmax) * x.size / x.shape[1]
                for c in range(x.shape[1]))
    assert sat == round(n_sat)
    acc = np.full(x.shape[1], 123.0)  # overwritten, not accumulated into
    K.fq_lsq_scale_grad_pc(x, g, p["inv_s"], p["zp"], p["qmin"], p["qmax"], acc)
    n = x.size // x.shape[1]
    expect = ref.lsq_scale_grad_pc(x, g, 1, s, zp, qmin, qmax) * math.sqrt(n * max(qmax, 1))
    np.testing.assert_allclose(acc, expect, rtol=1e-5, atol=1e-5)


# ----------------------------------------------------------------------------- reductions and trits

def test_abs_mean(rng):
    x = rng.standard_normal(10001).astype(F32)
    assert math.isclose(K.abs_mean(x), math.fsum(np.abs(x.astype(np.float64))) / x.size, rel_tol=1e-13)
    assert K.abs_mean(np.empty(0, F32)) == 0.0
    assert math.isclose(K.abs_sum(x), math.fsum(np.abs(x.astype(np.float64))), rel_tol=1e-13)
    assert K.abs_sum(np.empty(0, F32)) == 0.0
    assert K.alpha_of_abs_sum(K.abs_sum(x), x.size) == K.ternary_alpha(x) == np.float32(K.abs_mean(x))
    assert K.alpha_of_abs_sum(0.0, 5) == np.float32(np.finfo(np.float32).eps)
    assert np.isnan(K.alpha_of_abs_sum(np.inf, 5))


@pytest.mark.parametrize("cores", [1, 2, 3, 8])
def test_sum_slices_adds_fixed_slice_sums_in_order_whatever_the_cores(rng, force_split, cores):
    from qatlab.runtime import parallel
    x = rng.standard_normal(10001).astype(F32)
    calls = force_split(cores, MIN_ELEMENTS=1000)
    total = parallel.sum_slices(K.abs_sum, x)
    assert calls == [(parallel.MAX_PARTS, min(cores, parallel.MAX_PARTS))]   # 8 slices over the cores
    bounds = [x.size * k // parallel.MAX_PARTS for k in range(parallel.MAX_PARTS + 1)]
    assert total == sum(K.abs_sum(x[lo:hi]) for lo, hi in zip(bounds, bounds[1:]))     # the same bits for any cores
    assert math.isclose(total, math.fsum(np.abs(x.astype(np.float64))), rel_tol=1e-13)
    assert parallel.sum_slices(K.abs_sum, x[:999]) == K.abs_sum(x[:999]) and len(calls) == 1


def test_minmax(rng):
    x = rng.standard_normal(1001).astype(F32)
    lo, hi, finite = K.minmax(x)
    assert (lo, hi) == ref.batch_minmax(x) and finite
    for bad in (np.inf, -np.inf, np.nan):
        y = x.copy()
        y[500] = bad
        assert K.minmax(y)[2] is False


def test_minmax_pc(rng):
    x = rng.standard_normal((4, 3, 5)).astype(F32)
    lo, hi = np.empty(3), np.empty(3)
    assert K.minmax_pc(x, lo, hi)
    rlo, rhi = ref.batch_minmax(x, axis=1)
    assert np.array_equal(lo, rlo) and np.array_equal(hi, rhi)
    x[3, 2, 4] = np.nan
    assert not K.minmax_pc(x, lo, hi)


def test_ternary_trits(rng):
    w = (rng.standard_normal(5000) * 0.1).astype(F32)
    w[:6] = [0.05, -0.05, 0.15, -0.15, 0.25, -0.25]  # ties at alpha = 0.1: rint(+-0.5)=0, rint(+-1.5)=+-2 -> clamp
    alpha = F32(0.1)
    out = np.empty(w.size, np.int8)
    K.ternary_trits(w, F32(1) / alpha, out)
    expect = np.clip(np.rint(w * (F32(1) / alpha)), -1, 1).astype(np.int8)
    assert np.array_equal(out, expect)
    assert set(np.unique(out)) <= {-1, 0, 1}
