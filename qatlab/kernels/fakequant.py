r"""Fake-quantization kernels (per-tensor and per-channel), float32 in and out.

Notation: ``s`` scale (> 0), ``inv_s = float32(1 / s)``, ``zp`` zero-point,
``[qmin, qmax]`` the integer range, ``g`` the upstream gradient.

Forward (ties-to-even, multiply-by-inverse, as ``torch.fake_quantize_per_tensor_affine``)::

    v = rint(x * inv_s) + zp          # float32
    q = clamp(v, qmin, qmax)
    y = (q - zp) * s

NaN inputs give NaN outputs (the clamp is written so NaN passes through);
+-inf saturate to the ends of the range.

Backward, with ``u = (x - c) * inv_h`` the input in units of the range
(``c`` centre and ``h`` half-width of the float range, chosen by the caller)::

    STE 0 IDENTITY          dx = g
    STE 1 CLIPPED_IDENTITY  dx = g if qmin <= v <= qmax else 0
    STE 2 TANH              dx = g * (1 - tanh(u)^2)   (as sech^2(u) = 4e / (1 + e)^2, e = exp(-2|u|))
    STE 3 HARD_TANH         dx = g * max(0, 1 - |u|)

Per-channel kernels take ``x`` reshaped to ``(outer, C, inner)`` (a view of a
C-contiguous array quantized along one axis) and per-channel parameter arrays
of length ``C``.
"""
from __future__ import annotations

import numpy as np
from numba import njit, types
from numba.extending import intrinsic

# fastmath flags that allow vectorisation but keep NaN/inf semantics intact; error_model="numpy"
# drops the Python ZeroDivisionError check, which otherwise blocks vectorisation of `/`.
_FAST = {"nsz", "arcp", "contract", "afn"}
# ... and for float64 sums: reassociation lets LLVM vectorise them (the order is fixed by the
# compiled code, so deterministic on one machine); NaN and inf still propagate.
_SUMS = {"nsz", "contract", "reassoc"}


@intrinsic
def _f32_from_bits(typingctx, bits):
    """The float32 whose IEEE bit pattern is the int32 ``bits`` (an LLVM bitcast, so loops around it vectorise)."""
    if bits != types.int32:
        return None

    def codegen(context, builder, signature, args):
        return builder.bitcast(args[0], context.get_value_type(types.float32))
    return types.float32(types.int32), codegen


_LOG2E = np.float32(1.4426950408889634)
_LN2_HI, _LN2_LO = np.float32(0.693359375), np.float32(-2.12194440e-4)   # ln 2 = HI + LO, HI exact in 9 bits
_EXP_MIN = np.float32(-87.0)    # exp(-87) = 1.6e-38, the smallest result that stays a normal float32
_F0, _F1 = np.float32(0.0), np.float32(1.0)


@njit(cache=True, nogil=True, fastmath=_FAST, error_model="numpy", inline="always")
def exp_neg(x):
    """exp(x) for float32 x <= 0, relative error < 5e-7; 0 below -87 (the result would be subnormal); NaN in, NaN out.

    ``x = k ln2 + r`` with ``k = rint(x / ln2)``, ``|r| <= ln2 / 2``; ``exp(r)`` by its degree-7 Taylor
    polynomial and ``2^k`` built from its exponent bits: no libm call, so the loops around it vectorise.
    """
    xc = _EXP_MIN if x < _EXP_MIN else x      # written so that NaN passes through
    k = np.rint(xc * _LOG2E)
    r = (xc - k * _LN2_HI) - k * _LN2_LO
    p = _F1 + r * (_F1 + r * (np.float32(1 / 2) + r * (np.float32(1 / 6) + r * (np.float32(1 / 24) + r * (
        np.float32(1 / 120) + r * (np.float32(1 / 720) + r * np.float32(1 / 5040)))))))
    e = p * _f32_from_bits(np.int32((k + np.float32(127.0)) * np.float32(2.0**23)))   # exponent field k + 127
    return _F0 if x < _EXP_MIN else e


@njit(cache=True, nogil=True, fastmath=_FAST, error_model="numpy", inline="always")
def sech2(u):
    """1 - tanh(u)^2 as ``4e / (1 + e)^2`` with ``e = exp(-2|u|)``: float32 relative accuracy in the tails,
    where ``1 - tanh^2`` cancels to nothing; 0 for |u| > 43.5 (the true value is below 1e-37)."""
    e = exp_neg(np.float32(-2.0) * np.abs(u))
    d = _F1 + e
    return np.float32(4.0) * e / (d * d)


@njit(cache=True, nogil=True, fastmath=_FAST, error_model="numpy")
def fq_forward(x, inv_s, s, zp, qmin, qmax, out):
    """out[i] = fake-quantized x[i]; x, out: float32 (n,) (may alias); scalars float32."""
    for i in range(x.shape[0]):
        v = np.rint(x[i] * inv_s) + zp
        if v < qmin:
            v = qmin
        elif v > qmax:
            v = qmax
        out[i] = (v - zp) * s


@njit(cache=True, nogil=True, fastmath=_FAST, error_model="numpy")
def fq_forward_mask(x, inv_s, s, zp, qmin, qmax, out, mask):
    """Forward as :func:`fq_forward`, plus mask[i] = 1 where the clamp did not act (uint8 (n,))."""
    for i in range(x.shape[0]):
        v = np.rint(x[i] * inv_s) + zp
        inside = (v >= qmin) & (v <= qmax)
        mask[i] = inside
        if v < qmin:
            v = qmin
        elif v > qmax:
            v = qmax
        out[i] = (v - zp) * s


@njit(cache=True, nogil=True, fastmath=_FAST, error_model="numpy")
def fq_backward(x, g, ste, inv_s, zp, qmin, qmax, c, inv_h, out):
    """out[i] = STE gradient (see module doc); x, g, out float32 (n,); ste int code 0..3.

    out may be g itself (the usual call: the gradient is rewritten in place); that case runs a
    loop over one array, which LLVM vectorises, where the two-array loop on aliased arrays takes
    its scalar fallback (measured 3-8x slower inside the fused training step).
    """
    if g.ctypes.data == out.ctypes.data:
        for i in range(x.shape[0]):
            out[i] = ste_grad(ste, out[i], x[i], inv_s, zp, qmin, qmax, c, inv_h)
    else:
        for i in range(x.shape[0]):
            out[i] = ste_grad(ste, g[i], x[i], inv_s, zp, qmin, qmax, c, inv_h)


@njit(cache=True, nogil=True, fastmath=_FAST, error_model="numpy", inline="always")
def ste_grad(ste, g, x, inv_s, zp, qmin, qmax, c, inv_h):
    """The STE gradient of one element (float32 g at float32 x); see the module doc."""
    if ste == 1:
        v = np.rint(x * inv_s) + zp
        return g if (v >= qmin) & (v <= qmax) else np.float32(0.0)
    if ste == 2:
        return g * sech2((x - c) * inv_h)
    if ste == 3:
        a = np.float32(1.0) - np.abs((x - c) * inv_h)
        return g * a if a > np.float32(0.0) else np.float32(0.0)
    return g


@njit(cache=True, nogil=True, error_model="numpy", fastmath=_SUMS)
def fq_noise_saturation(x, inv_s, s, zp, qmin, qmax):
    """(sum (x - fq(x))^2, count of clamped elements, sum x^2) over x float32 (n,); sums float64."""
    sq = 0.0
    sat = 0
    signal = 0.0
    for i in range(x.shape[0]):   # branch-free, so that it vectorises
        v = np.rint(x[i] * inv_s) + zp
        sat += (v < qmin) | (v > qmax)
        c = qmin if v < qmin else (qmax if v > qmax else v)
        d = np.float64(x[i]) - np.float64((c - zp) * s)
        sq += d * d
        signal += np.float64(x[i]) * np.float64(x[i])
    return sq, sat, signal


@njit(cache=True, nogil=True, error_model="numpy")
def fq_lsq_scale_grad(x, g, inv_s, zp, qmin, qmax):
    """LSQ: sum_i g[i] * dy[i]/ds as float64, with dy/ds = rint(x/s) - x/s inside the range,
    qmin - zp below it and qmax - zp above it (before the gradient-scale factor)."""
    acc = 0.0
    for i in range(x.shape[0]):
        xs = x[i] * inv_s
        v = np.rint(xs) + zp
        if v < qmin:
            d = qmin - zp
        elif v > qmax:
            d = qmax - zp
        else:
            d = np.rint(xs) - xs
        acc += np.float64(g[i]) * np.float64(d)
    return acc


@njit(cache=True, nogil=True, fastmath=_FAST, error_model="numpy")
def fq_forward_pc(x, inv_s, s, zp, qmin, qmax, out):
    """Per-channel forward; x, out float32 (outer, C, inner); inv_s, s, zp float32 (C,)."""
    for o in range(x.shape[0]):
        for ch in range(x.shape[1]):
            a, b, z = inv_s[ch], s[ch], zp[ch]
            for i in range(x.shape[2]):
                v = np.rint(x[o, ch, i] * a) + z
                if v < qmin:
                    v = qmin
                elif v > qmax:
                    v = qmax
                out[o, ch, i] = (v - z) * b


@njit(cache=True, nogil=True, fastmath=_FAST, error_model="numpy")
def fq_backward_pc(x, g, ste, inv_s, zp, qmin, qmax, c, inv_h, out):
    """Per-channel backward; x, g, out float32 (outer, C, inner); inv_s, zp, c, inv_h float32 (C,)."""
    for o in range(x.shape[0]):
        for ch in range(x.shape[1]):
            a, z, cc, ih = inv_s[ch], zp[ch], c[ch], inv_h[ch]
            for i in range(x.shape[2]):
                out[o, ch, i] = ste_grad(ste, g[o, ch, i], x[o, ch, i], a, z, qmin, qmax, cc, ih)


@njit(cache=True, nogil=True, error_model="numpy", fastmath=_SUMS)
def fq_noise_saturation_pc(x, inv_s, s, zp, qmin, qmax):
    """Per-channel (sum of squared error, clamped count, sum x^2); x float32 (outer, C, inner)."""
    sq = 0.0
    sat = 0
    signal = 0.0
    for o in range(x.shape[0]):
        for ch in range(x.shape[1]):
            for i in range(x.shape[2]):
                v = np.rint(x[o, ch, i] * inv_s[ch]) + zp[ch]
                if v < qmin:
                    v = qmin
                    sat += 1
                elif v > qmax:
                    v = qmax
                    sat += 1
                d = np.float64(x[o, ch, i]) - np.float64((v - zp[ch]) * s[ch])
                sq += d * d
                signal += np.float64(x[o, ch, i]) * np.float64(x[o, ch, i])
    return sq, sat, signal


@njit(cache=True, nogil=True, error_model="numpy")
def fq_lsq_scale_grad_pc(x, g, inv_s, zp, qmin, qmax, out):
    """Per-channel LSQ scale gradient sums into out float64 (C,) (see :func:`fq_lsq_scale_grad`)."""
    out[:] = 0.0
    for o in range(x.shape[0]):
        for ch in range(x.shape[1]):
            for i in range(x.shape[2]):
                xs = x[o, ch, i] * inv_s[ch]
                v = np.rint(xs) + zp[ch]
                if v < qmin:
                    d = qmin - zp[ch]
                elif v > qmax:
                    d = qmax - zp[ch]
                else:
                    d = np.rint(xs) - xs
                out[ch] += np.float64(g[o, ch, i]) * np.float64(d)


@njit(cache=True, nogil=True, error_model="numpy", fastmath={"reassoc", "nsz"})
def abs_sum(x):
    """sum(|x|) over x float32 (n,), in float64. `reassoc` lets LLVM vectorise the sum (its order is
    fixed by the compiled code: deterministic on one machine); NaN/inf still propagate."""
    total = 0.0
    for i in range(x.shape[0]):
        total += abs(np.float64(x[i]))
    return total


@njit(cache=True, nogil=True, error_model="numpy")
def abs_mean(x):
    """mean(|x|) over x float32 (n,): :func:`abs_sum` / n; 0.0 for empty x."""
    n = x.shape[0]
    return abs_sum(x) / n if n else 0.0


@njit(cache=True, nogil=True, error_model="numpy", fastmath={"reassoc", "nsz"})
def all_finite(x):
    """True when x float32 (n,) holds no NaN or inf (sum of x*0 is NaN otherwise; vectorised)."""
    s = np.float32(0.0)
    for i in range(x.shape[0]):
        s += x[i] * np.float32(0.0)
    return s == 0


@njit(cache=True, nogil=True, error_model="numpy", fastmath=True)
def _minmax_finite(x):
    lo = x[0]
    hi = x[0]
    for i in range(x.shape[0]):
        lo = min(lo, x[i])
        hi = max(hi, x[i])
    return lo, hi


@njit(cache=True, nogil=True, error_model="numpy")
def minmax(x):
    """(min, max) of x float32 (n >= 1,) as float64, and whether every element is finite.

    The finiteness check runs first; only all-finite input reaches the min/max loop, which is
    the one place `fastmath=True` is safe (it may assume no NaN/inf). (inf, -inf, False) otherwise.
    """
    if x.shape[0] == 0 or not all_finite(x):
        return np.inf, -np.inf, x.shape[0] == 0
    lo, hi = _minmax_finite(x)
    return np.float64(lo), np.float64(hi), True


@njit(cache=True, nogil=True, error_model="numpy")
def minmax_pc(x, lo, hi):
    """Per-channel min/max of x float32 (outer, C, inner) into lo, hi float64 (C,); returns all-finite."""
    lo[:] = np.inf
    hi[:] = -np.inf
    finite = True
    for o in range(x.shape[0]):
        for ch in range(x.shape[1]):
            for i in range(x.shape[2]):
                v = np.float64(x[o, ch, i])
                if not np.isfinite(v):
                    finite = False
                if v < lo[ch]:
                    lo[ch] = v
                if v > hi[ch]:
                    hi[ch] = v
    return finite


@njit(cache=True, nogil=True, error_model="numpy")
def ternary_trits(w, inv_alpha, out):
    """out[i] = clamp(rint(w[i] * inv_alpha), -1, 1) as int8; w float32 (n,), out int8 (n,)."""
    for i in range(w.shape[0]):
        v = np.rint(w[i] * inv_alpha)
        out[i] = -1 if v < -1 else (1 if v > 1 else np.int8(v))


@njit(cache=True, nogil=True, error_model="numpy")
def ternary_alpha(w):
    """Absmean scale alpha = max(float32(mean|w|), eps) of w float32 (n,); NaN if w holds NaN/inf."""
    return alpha_of_abs_sum(abs_sum(w), w.shape[0])


@njit(cache=True, nogil=True, error_model="numpy")
def alpha_of_abs_sum(total, n):
    """The absmean scale max(float32(total / n), eps) from total = sum|w| (float64) of n > 0
    elements; NaN when total is NaN/inf."""
    alpha = np.float32(total / n)
    if not np.isfinite(alpha):
        return np.float32(np.nan)
    eps = np.float32(1.1920928955078125e-07)
    return eps if alpha < eps else alpha


@njit(cache=True, nogil=True, error_model="numpy")
def ternary_forward(w, out):
    """Absmean ternary projection in one call: alpha = :func:`ternary_alpha` (w),
    out[i] = alpha * clamp(rint(w[i] * float32(1/alpha)), -1, 1); w, out float32 (n,). Returns alpha
    (NaN if w holds NaN/inf, and then out is left unwritten)."""
    alpha = ternary_alpha(w)
    if np.isfinite(alpha):
        fq_forward(w, np.float32(1.0) / alpha, alpha, np.float32(0.0), np.float32(-1.0), np.float32(1.0), out)
    return alpha


@njit(cache=True, nogil=True, error_model="numpy", inline="always")
def ternary_ste_clipped(ste, g, w, inv_alpha, clip):
    """One latent's ternary STE gradient (:func:`ternary_backward`'s, u = w * inv_alpha) with the
    latent clip: 0 where |w| > clip (the gradient of a latent that wandered too far is dropped)."""
    if np.abs(w) <= clip:    # written so that a NaN latent gets 0 too
        return ste_grad(ste, g, w, inv_alpha, np.float32(0.0), np.float32(-1.0), np.float32(1.0), np.float32(0.0),
                        inv_alpha)
    return np.float32(0.0)


@njit(cache=True, nogil=True, error_model="numpy")
def ternary_backward(w, g, ste, alpha, out):
    """STE of the ternary projection (s = alpha, qmax = 1, u = w/alpha); see :func:`fq_backward`.
    alpha: the float32 value returned by :func:`ternary_forward` (passed as a Python float)."""
    inv = np.float32(1.0) / np.float32(alpha)
    fq_backward(w, g, ste, inv, np.float32(0.0), np.float32(-1.0), np.float32(1.0), np.float32(0.0), inv, out)
