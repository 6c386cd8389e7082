"""Slow, obviously-correct numpy references for qatlab's quantizers and kernels.

Everything here is written from the formulas in issue 2 / the module docstrings of
``qatlab.quant`` and ``qatlab.kernels.fakequant``, never by calling qatlab. Forward
references compute in float32 exactly as specified (multiply by ``float32(1/s)``,
ties-to-even ``np.rint``, clamp, ``(q - zp) * s``) so they can be compared bit for
bit; gradient references compute in float64 and are compared with a tolerance.
"""
from __future__ import annotations

import math

import numpy as np

F32 = np.float32
F32_EPS = float(np.finfo(np.float32).eps)


# ----------------------------------------------------------------------------- ranges

def integer_range(bits: int, symmetric: bool, narrow: bool) -> tuple[int, int] | None:
    """The table of issue 2; ``None`` where the range would have a single level.

    symmetric [-2^(b-1), 2^(b-1)-1]; narrow symmetric [-(2^(b-1)-1), 2^(b-1)-1];
    affine [0, 2^b-1] (narrow affine drops level 0: [1, 2^b-1]).
    """
    if symmetric:
        hi = 2 ** (bits - 1) - 1
        lo = -hi if narrow else -(2 ** (bits - 1))
    else:
        lo, hi = (1 if narrow else 0), 2 ** bits - 1
    return None if hi <= lo else (lo, hi)


# ----------------------------------------------------------------------------- forward

def _scalar_q(xi: np.float32, inv_s: np.float32, zp: np.float32):
    """v = rint(x * inv_s) + zp for ONE float32 element (plain scalar arithmetic)."""
    return F32(np.rint(F32(xi * inv_s)) + zp)


def fq_forward_loop(x, s, zp, qmin, qmax) -> np.ndarray:
    """Plain element-by-element loop in float32 scalars; NaN stays NaN."""
    x = np.asarray(x, dtype=F32)
    s32 = F32(s)
    inv_s = F32(F32(1.0) / s32)
    z = F32(zp)
    out = np.empty(x.shape, dtype=F32)
    flat_in, flat_out = x.reshape(-1), out.reshape(-1)
    for i in range(flat_in.size):
        v = _scalar_q(flat_in[i], inv_s, z)
        if v < qmin:
            v = F32(qmin)
        elif v > qmax:
            v = F32(qmax)
        flat_out[i] = F32(F32(v - z) * s32)
    return out


def fq_forward(x, s, zp, qmin, qmax) -> np.ndarray:
    """Vectorized float32 forward: clamp(rint(x * f32(1/s)) + zp, qmin, qmax) - zp) * s."""
    x = np.asarray(x, dtype=F32)
    s32 = F32(s)
    inv_s = F32(1.0) / s32
    z = F32(zp)
    v = np.rint(x * inv_s) + z
    q = np.where(v < qmin, F32(qmin), np.where(v > qmax, F32(qmax), v))  # NaN passes through
    return ((q - z) * s32).astype(F32)


def fq_forward_divide(x, s, zp, qmin, qmax) -> np.ndarray:
    """The variant we do NOT implement: x / s instead of x * (1/s) (used to show the difference)."""
    x = np.asarray(x, dtype=F32)
    s32, z = F32(s), F32(zp)
    v = np.clip(np.rint(x / s32) + z, qmin, qmax)
    return ((v - z) * s32).astype(F32)


def fq_mask(x, s, zp, qmin, qmax) -> np.ndarray:
    """True where the clamp did not act: qmin <= rint(x * f32(1/s)) + zp <= qmax (NaN -> False)."""
    x = np.asarray(x, dtype=F32)
    v = np.rint(x * (F32(1.0) / F32(s))) + F32(zp)
    return (v >= qmin) & (v <= qmax)


def _channel_slices(x: np.ndarray, axis: int):
    axis %= x.ndim
    for ch in range(x.shape[axis]):
        idx = [slice(None)] * x.ndim
        idx[axis] = ch
        yield ch, tuple(idx)


def fq_forward_pc(x, axis, s, zp, qmin, qmax) -> np.ndarray:
    """Per-channel forward: slice ``ch`` along ``axis`` uses s[ch], zp[ch]."""
    x = np.asarray(x, dtype=F32)
    out = np.empty_like(x)
    for ch, idx in _channel_slices(x, axis):
        out[idx] = fq_forward(x[idx], s[ch], zp[ch], qmin, qmax)
    return out


def fq_mask_pc(x, axis, s, zp, qmin, qmax) -> np.ndarray:
    x = np.asarray(x, dtype=F32)
    out = np.empty(x.shape, dtype=bool)
    for ch, idx in _channel_slices(x, axis):
        out[idx] = fq_mask(x[idx], s[ch], zp[ch], qmin, qmax)
    return out


# ----------------------------------------------------------------------------- STE backward

def ste_centre_halfwidth(s, zp, qmin, qmax, symmetric):
    """(c, h) of the STE normalisation u = (x - c) / h, in float64.

    symmetric: c = -zp*s, h = qmax*s (the 1-bit range [-1, 0] has qmax = 0: h = s);
    affine: centre and half-width of the float range [(qmin-zp)s, (qmax-zp)s].
    """
    s, zp = float(s), float(zp)
    if symmetric:
        return -zp * s, s * (qmax if qmax > 0 else -qmin)
    lo, hi = (qmin - zp) * s, (qmax - zp) * s
    return (lo + hi) / 2, (hi - lo) / 2


def ste_u(x, s, zp, qmin, qmax, symmetric) -> np.ndarray:
    """u in float64 (the exact formula)."""
    c, h = ste_centre_halfwidth(s, zp, qmin, qmax, symmetric)
    return (np.asarray(x, dtype=np.float64) - c) / h


def ste_u_f32(x, s, zp, qmin, qmax, symmetric) -> np.ndarray:
    """u as the kernels evaluate it, in float32: (x - c) * f32(1/h) with c, h rounded to float32.

    Used only where an *exact* zero pattern (HARD_TANH) is pinned; values are
    checked against :func:`ste_u`.
    """
    s32, z32 = F32(s), F32(zp)
    if symmetric:
        c = -z32 * s32
        h = s32 * F32(qmax if qmax > 0 else -qmin)
    else:
        c = (F32((qmin + qmax) / 2) - z32) * s32
        h = s32 * F32((qmax - qmin) / 2)
    return (np.asarray(x, dtype=F32) - F32(c)) * (F32(1.0) / F32(h))


def ste_backward(kind: str, x, g, s, zp, qmin, qmax, symmetric) -> np.ndarray:
    """dx in float64 for SteKind value ``kind`` (string)."""
    g = np.asarray(g, dtype=np.float64)
    if kind == "identity":
        return g.copy()
    if kind == "clipped_identity":
        return np.where(fq_mask(x, s, zp, qmin, qmax), g, 0.0)
    u = ste_u(x, s, zp, qmin, qmax, symmetric)
    if kind == "tanh":
        return g * (1.0 - np.tanh(u) ** 2)
    if kind == "hard_tanh":
        return g * np.maximum(0.0, 1.0 - np.abs(u))
    raise ValueError(kind)


def ste_backward_loop(kind: str, x, g, s, zp, qmin, qmax, symmetric) -> np.ndarray:
    """Element-by-element version of :func:`ste_backward` with math.tanh (float64)."""
    x = np.asarray(x, dtype=F32).reshape(-1)
    g = np.asarray(g, dtype=F32).reshape(-1)
    c, h = ste_centre_halfwidth(s, zp, qmin, qmax, symmetric)
    inv_s = F32(F32(1.0) / F32(s))
    out = np.empty(x.size)
    for i in range(x.size):
        if kind == "identity":
            out[i] = g[i]
        elif kind == "clipped_identity":
            v = _scalar_q(x[i], inv_s, F32(zp))
            out[i] = g[i] if qmin <= v <= qmax else 0.0
        else:
            u = (float(x[i]) - c) / h
            if kind == "tanh":
                out[i] = float(g[i]) * (1.0 - math.tanh(u) ** 2)
            else:
                out[i] = float(g[i]) * max(0.0, 1.0 - abs(u))
    return out


def ste_backward_pc(kind, x, g, axis, s, zp, qmin, qmax, symmetric) -> np.ndarray:
    x = np.asarray(x, dtype=F32)
    g = np.asarray(g, dtype=F32)
    out = np.empty(x.shape)
    for ch, idx in _channel_slices(x, axis):
        out[idx] = ste_backward(kind, x[idx], g[idx], s[ch], zp[ch], qmin, qmax, symmetric)
    return out


# ----------------------------------------------------------------------------- LSQ

def lsq_dyds(x, s, zp, qmin, qmax) -> np.ndarray:
    """dy/ds (LSQ, Esser et al.): rint(x/s) - x/s inside the range, qmin - zp below, qmax - zp above.

    ``rint(x/s)`` is the forward's integer (float32 ``rint(x * f32(1/s))``, so the
    gradient belongs to the ``y`` that forward produced, also at exact ties) and
    so is the inside/outside decision; the ``- x/s`` term uses float64.
    """
    x = np.asarray(x, dtype=F32)
    v = np.rint(x * (F32(1.0) / F32(s))) + F32(zp)
    xs = x.astype(np.float64) / float(F32(s))
    inside = (v.astype(np.float64) - float(zp)) - xs
    return np.where(v < qmin, float(qmin - zp), np.where(v > qmax, float(qmax - zp), inside))


def lsq_scale_grad(x, g, s, zp, qmin, qmax) -> float:
    """sum(g * dy/ds) * 1/sqrt(N * max(qmax, 1)), N = number of elements (per-tensor)."""
    x = np.asarray(x, dtype=F32)
    terms = np.asarray(g, dtype=np.float64) * lsq_dyds(x, s, zp, qmin, qmax)
    return math.fsum(terms.reshape(-1).tolist()) / math.sqrt(x.size * max(qmax, 1))


def lsq_scale_grad_pc(x, g, axis, s, zp, qmin, qmax) -> np.ndarray:
    x = np.asarray(x, dtype=F32)
    g = np.asarray(g, dtype=F32)
    out = np.empty(x.shape[axis])
    for ch, idx in _channel_slices(x, axis):
        out[ch] = lsq_scale_grad(x[idx], g[idx], s[ch], zp[ch], qmin, qmax)
    return out


# ----------------------------------------------------------------------------- statistics

def quantization_noise(x, y) -> float:
    """mean((x - y)^2) in float64 (y = the forward output); 0.0 for empty x."""
    x = np.asarray(x, dtype=np.float64).reshape(-1)
    y = np.asarray(y, dtype=np.float64).reshape(-1)
    if x.size == 0:
        return 0.0
    return math.fsum(((x - y) ** 2).tolist()) / x.size


def saturation_fraction(x, s, zp, qmin, qmax) -> float:
    """Share of elements whose rint(x/s) + zp lies outside [qmin, qmax]."""
    x = np.asarray(x, dtype=F32)
    if x.size == 0:
        return 0.0
    v = np.rint(x * (F32(1.0) / F32(s))) + F32(zp)
    return float(np.count_nonzero((v < qmin) | (v > qmax))) / x.size


def sqnr_db(x, y) -> float:
    """10 log10(sum x^2 / sum (x - y)^2): nan for zero signal, inf for zero noise."""
    x = np.asarray(x, dtype=np.float64).reshape(-1)
    y = np.asarray(y, dtype=np.float64).reshape(-1)
    sig = math.fsum((x * x).tolist())
    noise = math.fsum(((x - y) ** 2).tolist())
    if sig == 0.0:
        return math.nan
    if noise == 0.0:
        return math.inf
    return 10.0 * math.log10(sig / noise)


# ----------------------------------------------------------------------------- observers

def minmax_qparams(lo, hi, qmin, qmax, symmetric):
    """PyTorch's observer formula in float32 (``torch.ao.quantization`` ``_calculate_qparams``).

    The range is first widened to include 0; scale is floored at float32 eps.
    Returns float32 arrays (scale) and int64 arrays (zp) of the shape of lo.
    """
    lo = np.minimum(np.asarray(lo, dtype=F32), F32(0))
    hi = np.maximum(np.asarray(hi, dtype=F32), F32(0))
    if symmetric:
        scale = np.maximum(np.maximum(-lo, hi) / F32((qmax - qmin) / 2), F32(F32_EPS))
        zp = np.zeros(scale.shape, dtype=np.int64)
    else:
        scale = np.maximum((hi - lo) / F32(qmax - qmin), F32(F32_EPS))
        zp = np.clip(qmin - np.rint(lo / scale).astype(np.int64), qmin, qmax)
    return scale.astype(F32), zp


def batch_minmax(x, axis=None):
    """(min, max) per tensor (floats) or per slice along axis (float64 arrays), by plain loops."""
    x = np.asarray(x, dtype=np.float64)
    if axis is None:
        lo, hi = math.inf, -math.inf
        for v in x.reshape(-1).tolist():
            lo, hi = min(lo, v), max(hi, v)
        return lo, hi
    xm = np.moveaxis(x, axis, 0)
    los, his = [], []
    for ch in range(xm.shape[0]):
        lo, hi = batch_minmax(xm[ch])
        los.append(lo)
        his.append(hi)
    return np.array(los), np.array(his)


def running_minmax(batches, axis=None):
    lo = hi = None
    for b in batches:
        blo, bhi = batch_minmax(b, axis)
        lo = blo if lo is None else np.minimum(lo, blo)
        hi = bhi if hi is None else np.maximum(hi, bhi)
    return lo, hi


def moving_average_minmax(batches, c, axis=None):
    """First batch seeds; then m <- m + c * (batch_m - m) (float64)."""
    lo = hi = None
    for b in batches:
        blo, bhi = batch_minmax(b, axis)
        if lo is None:
            lo, hi = np.asarray(blo, dtype=np.float64), np.asarray(bhi, dtype=np.float64)
        else:
            lo = lo + c * (blo - lo)
            hi = hi + c * (bhi - hi)
    return lo, hi


# ----------------------------------------------------------------------------- ternary

def ternary_absmean(w):
    """(trits int8, alpha float): alpha = f32(mean|W|) floored at f32 eps; T = clamp(rint(W * f32(1/alpha)), -1, 1)."""
    w = np.asarray(w, dtype=F32)
    alpha = float(F32(math.fsum(np.abs(w.astype(np.float64)).reshape(-1).tolist()) / w.size))
    alpha = max(alpha, F32_EPS)
    t = np.clip(np.rint(w * (F32(1.0) / F32(alpha))), -1, 1).astype(np.int8)
    return t, alpha
