"""Ternary (BitNet b1.58 absmean) quantizer: alpha = mean|W|, T = clamp(rint(W/alpha), -1, 1)."""
from __future__ import annotations

import math

import numpy as np
import pytest

import qatlab as ql
import reference as ref

F32 = np.float32
EPS = float(np.finfo(np.float32).eps)
KINDS = [k.value for k in ql.SteKind]


@pytest.mark.parametrize("shape", [(1,), (7,), (16, 9), (3, 4, 5)])
def test_ternary_quantize_vs_reference(rng, shape):
    w = (rng.standard_normal(shape) * 0.05).astype(F32)
    trits, alpha = ql.ternary_quantize(w)
    rt, ra = ref.ternary_absmean(w)
    assert trits.dtype == np.int8 and trits.shape == w.shape
    assert type(alpha) is float
    assert alpha == ra
    assert math.isclose(alpha, float(np.mean(np.abs(w.astype(np.float64)))), rel_tol=1e-7)
    assert np.array_equal(trits, rt)
    assert set(np.unique(trits)) <= {-1, 0, 1}


def test_ternary_known_values_and_ties():
    w = np.array([0.5, -0.5, 1.5, -1.5, 0.49, 2.0, -3.0, 0.0], F32)  # mean|w| = 9.49 / 8
    alpha = float(F32(9.49 / 8))
    trits, a = ql.ternary_quantize(w)
    assert math.isclose(a, alpha, rel_tol=1e-7)
    assert np.array_equal(trits, np.clip(np.rint(w * (F32(1) / F32(a))), -1, 1).astype(np.int8))
    # exact ties relative to alpha = 1: rint(0.5) = 0, rint(1.5) = 2 -> clamped to 1
    w = np.array([0.5, -0.5, 1.5, -1.5, 1.0, -1.0, 0.0, 0.0], F32)  # mean|w| = 1
    trits, a = ql.ternary_quantize(w)
    assert a == 0.75
    w = np.array([0.5, -0.5, 1.5, -1.5], F32)  # mean|w| = 1 exactly
    trits, a = ql.ternary_quantize(w)
    assert a == 1.0 and trits.tolist() == [0, 0, 1, -1]


def test_ternary_dequantize(rng):
    w = (rng.standard_normal((5, 6)) * 0.2).astype(F32)
    trits, alpha = ql.ternary_quantize(w)
    deq = ql.ternary_dequantize(trits, alpha)
    assert deq.dtype == np.float32 and deq.shape == w.shape
    assert np.array_equal(deq, trits.astype(F32) * F32(alpha))
    assert set(np.unique(deq).tolist()) <= {-F32(alpha), 0.0, F32(alpha)}


def test_all_zero_weights_floor_alpha():
    trits, alpha = ql.ternary_quantize(np.zeros((3, 3), F32))
    assert alpha == EPS and not trits.any()
    tq = ql.TernaryQuantizer()
    assert not tq.forward(np.zeros(4, F32)).any()


@pytest.mark.parametrize("bad", [np.nan, np.inf, -np.inf])
def test_nonfinite_weights_raise(bad):
    w = np.ones(5, F32)
    w[2] = bad
    with pytest.raises(ValueError, match="NaN or inf"):
        ql.ternary_quantize(w)
    tq = ql.TernaryQuantizer()
    tq.forward(np.ones(3, F32) * 0.3)
    alpha = tq.alpha
    with pytest.raises(ValueError):
        tq.forward(w)
    assert tq.alpha == alpha


def test_empty_and_non_numeric_raise():
    with pytest.raises(ValueError, match="empty"):
        ql.ternary_quantize(np.empty(0, F32))
    with pytest.raises(ValueError, match="empty"):
        ql.TernaryQuantizer().forward(np.empty((0, 3), F32))
    with pytest.raises(TypeError, match="w"):
        ql.ternary_quantize(np.array(["x"]))
    with pytest.raises(TypeError):
        ql.ternary_quantize(np.array([1 + 1j]))


def test_int_and_float64_weights_convert():
    trits, alpha = ql.ternary_quantize(np.array([2, -4, 0, 1]))
    assert alpha == 1.75 and trits.tolist() == [1, -1, 0, 1]
    w64 = np.array([0.1, -0.3, 0.02], np.float64)
    assert np.array_equal(ql.ternary_quantize(w64)[0], ql.ternary_quantize(w64.astype(F32))[0])


def test_quantizer_forward_equals_dequantized_trits(rng):
    tq = ql.TernaryQuantizer()
    for _ in range(3):
        w = (rng.standard_normal((12, 8)) * rng.uniform(0.01, 1)).astype(F32)
        y = tq.forward(w)
        trits, alpha = ql.ternary_quantize(w)
        assert tq.alpha == alpha
        assert np.array_equal(y, ql.ternary_dequantize(trits, alpha))
        assert y.dtype == np.float32 and y.shape == w.shape
        t2, a2 = tq.quantize(w)
        assert np.array_equal(t2, trits) and a2 == alpha
    out = np.empty_like(w)
    assert tq(w, out=out) is out


@pytest.mark.parametrize("kind", KINDS)
def test_quantizer_backward_uses_s_alpha_qmax_1(rng, kind):
    """u = w/alpha: the STE of the ternary projection is the literal formula of the reference."""
    tq = ql.TernaryQuantizer(ste=kind)
    w = (rng.standard_normal(2000) * 0.1).astype(F32)
    g = rng.uniform(-1, 1, w.size).astype(F32)
    tq.forward(w)
    alpha = tq.alpha
    dx = tq.backward(g, w)
    expect = ref.ste_backward(kind, w, g, alpha, 0, -1, 1, True)
    if kind in ("identity", "clipped_identity"):
        assert np.array_equal(dx, expect.astype(F32))
    else:
        np.testing.assert_allclose(dx, expect, rtol=0, atol=2e-6)
    u = w.astype(np.float64) / alpha
    if kind == "tanh":
        np.testing.assert_allclose(dx, g * (1 - np.tanh(u) ** 2), atol=2e-6)
    if kind == "hard_tanh":
        np.testing.assert_allclose(dx, g * np.maximum(0, 1 - np.abs(u)), atol=2e-6)
    if kind == "clipped_identity":  # passes where |w/alpha| rounds into [-1, 1], i.e. |w| < 1.5 alpha
        keep = np.abs(u) < 1.5 - 1e-6
        assert np.array_equal(dx[keep], g[keep])


def test_backward_shape_mismatch_and_out(rng):
    tq = ql.TernaryQuantizer()
    w = rng.standard_normal((3, 4)).astype(F32)
    tq.forward(w)
    with pytest.raises(ValueError) as err:
        tq.backward(np.ones((4, 3), F32), w)
    assert "(4, 3)" in str(err.value) and "(3, 4)" in str(err.value)
    out = np.empty_like(w)
    assert tq.backward(np.ones_like(w), w, out=out) is out
    with pytest.raises(ValueError, match="out"):
        tq.forward(w, out=np.empty((4, 3), F32))
    with pytest.raises(TypeError, match="grad_output"):
        tq.backward(np.array([["a"] * 4] * 3), w)


def test_backward_uses_alpha_of_last_forward(rng):
    tq = ql.TernaryQuantizer(ste="hard_tanh")
    w1 = (rng.standard_normal(100) * 0.1).astype(F32)
    w2 = w1 * 10
    tq.forward(w1)
    g = np.ones_like(w1)
    d1 = tq.backward(g, w2)  # alpha from w1: most of w2 is beyond |u| >= 1
    np.testing.assert_allclose(d1, ref.ste_backward("hard_tanh", w2, g, tq.alpha, 0, -1, 1, True), atol=2e-6)
    tq.forward(w2)
    d2 = tq.backward(g, w2)
    np.testing.assert_allclose(d2, ref.ste_backward("hard_tanh", w2, g, tq.alpha, 0, -1, 1, True), atol=2e-6)
    assert not np.array_equal(d1, d2)


def test_ste_parameter_syncs_and_validates():
    tq = ql.TernaryQuantizer()
    assert tq.ste is ql.SteKind.IDENTITY
    tq.ste = "tanh"
    assert tq.ste is ql.SteKind.TANH
    w = np.array([0.0, 0.1, -0.3, 2.0], F32)
    tq.forward(w)
    g = np.ones_like(w)
    np.testing.assert_allclose(tq.backward(g, w), ref.ste_backward("tanh", w, g, tq.alpha, 0, -1, 1, True), atol=2e-6)
    tq.ste = ql.SteKind.CLIPPED_IDENTITY
    assert np.array_equal(tq.backward(g, w), ref.ste_backward("clipped_identity", w, g, tq.alpha, 0, -1, 1, True))
    with pytest.raises(ValueError, match="ste"):
        tq.ste = "nope"
    assert tq.ste is ql.SteKind.CLIPPED_IDENTITY
    with pytest.raises(ValueError, match="ste"):
        ql.TernaryQuantizer(ste="nope")


def test_fractions_noise_saturation(rng):
    tq = ql.TernaryQuantizer()
    w = (rng.standard_normal(5000) * 0.3).astype(F32)
    tq.forward(w)
    trits, alpha = ql.ternary_quantize(w)
    fr = tq.fractions(w)
    assert math.isclose(sum(fr), 1.0)
    assert fr == tuple(np.count_nonzero(trits == t) / w.size for t in (-1, 0, 1))
    y = ql.ternary_dequantize(trits, alpha)
    assert math.isclose(tq.quantization_noise(w), ref.quantization_noise(w, y), rel_tol=1e-12)
    assert math.isclose(tq.sqnr_db(w), ref.sqnr_db(w, y), rel_tol=1e-9)
    assert tq.saturation_fraction(w) == ref.saturation_fraction(w, alpha, 0, -1, 1)
    assert tq.saturation_fraction(w) == np.count_nonzero(np.abs(w * (F32(1) / F32(alpha))) >= 1.5) / w.size
    assert tq.noise_stats(w) == (tq.quantization_noise(w), tq.sqnr_db(w), tq.saturation_fraction(w))
