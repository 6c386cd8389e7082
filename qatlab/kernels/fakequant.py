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
    STE 2 TANH              dx = g * (1 - tanh(u)^2)   (tanh: float32 rational approx., |err| < 5e-7)
    STE 3 HARD_TANH         dx = g * max(0, 1 - |u|)

Per-channel kernels take ``x`` reshaped to ``(outer, C, inner)`` (a view of a
C-contiguous array quantized along one axis) and per-channel parameter arrays
of length ``C``.
"""
from __future__ import annotations

import numpy as np
from numba import njit

# fastmath flags that allow vectorisation but keep NaN/inf semantics intact; error_model="numpy"
# drops the Python ZeroDivisionError check, which otherwise blocks vectorisation of `/`.
_FAST = {"nsz", "arcp", "contract", "afn"}
# ... and for float64 sums: reassociation lets LLVM vectorise them (the order is fixed by the
# compiled code, so deterministic on one machine); NaN and inf still propagate.
_SUMS = {"nsz", "contract", "reassoc"}


# Rational minimax approximation of tanh in float32 (the form used by Eigen's fast
# tanh): |error| < 5e-7 over the whole line, and it vectorises where libm's tanh does not.
_TANH_CLAMP = np.float32(7.90531110763549805)
_A = (np.float32(4.89352455891786e-03), np.float32(6.37261928875436e-04), np.float32(1.48572235717979e-05),
      np.float32(5.12229709037114e-08), np.float32(-8.60467152213735e-11), np.float32(2.00018790482477e-13),
      np.float32(-2.76076847742355e-16))
_B = (np.float32(4.89352518554385e-03), np.float32(2.26843463243900e-03), np.float32(1.18534705686654e-04),
      np.float32(1.19825839466702e-06))


@njit(cache=True, nogil=True, fastmath=_FAST, error_model="numpy", inline="always")
def tanh32(u):
    """tanh(u) for a float32 scalar, |error| < 5e-7; NaN in, NaN out."""
    if u > _TANH_CLAMP:
        u = _TANH_CLAMP
    elif u < -_TANH_CLAMP:
        u = -_TANH_CLAMP
    u2 = u * u
    p = ((((((_A[6] * u2 + _A[5]) * u2 + _A[4]) * u2 + _A[3]) * u2 + _A[2]) * u2 + _A[1]) * u2 + _A[0]) * u
    q = ((_B[3] * u2 + _B[2]) * u2 + _B[1]) * u2 + _B[0]
    return p / q


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
        t = tanh32((x - c) * inv_h)
        return g * (np.float32(1.0) - t * t)
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


@njit(cache=True, nogil=True, error_model="numpy")
def ternary_backward(w, g, ste, alpha, out):
    """STE of the ternary projection (s = alpha, qmax = 1, u = w/alpha); see :func:`fq_backward`.
    alpha: the float32 value returned by :func:`ternary_forward` (passed as a Python float)."""
    inv = np.float32(1.0) / np.float32(alpha)
    fq_backward(w, g, ste, inv, np.float32(0.0), np.float32(-1.0), np.float32(1.0), np.float32(0.0), inv, out)
