r"""Numba kernels of phase training (:mod:`qatlab.train.phase` and its parts).

All vectors are flat float32 (n,) unless stated; sums are accumulated in float64 and
stored as float32. Nothing allocates but weighted_rows' 4 KiB buffer; results go to ``out=``
buffers or are returned as scalars. The only fastmath flag used is reassociation of sums (NaN
and inf still propagate: the finiteness checks must see them).

Counter-based randomness (no generator state, so any element can be drawn on its own)::

    mix64(z)      = splitmix64 finaliser: z ^= z >> 30; z *= 0xBF58476D1CE4E5B9;
                    z ^= z >> 27; z *= 0x94D049BB133111EB; z ^= z >> 31     (uint64, wrapping)
    draw(key, i)  = mix64(key + (i + 1) * 0x9E3779B97F4A7C15)   i-th output of splitmix64(key)
    uniform(h)    = float32(h >> 40) * 2^-24                      in [0, 1), 24 bits
    slot(h, D)    = ((h >> 32) * D) >> 32                         in [0, D), D < 2^32
    sign(h)       = +1 if h & 1 == 0 else -1

Trit codes, packed 4 per byte, element i of a tensor at bits 2*(i % 4) of byte i // 4::

    0 -> 0,   1 -> +1,   2 -> -1
"""
from __future__ import annotations

import math

import numpy as np
from numba import njit

from .dense import sum_squares

GOLDEN = np.uint64(0x9E3779B97F4A7C15)
_M1 = np.uint64(0xBF58476D1CE4E5B9)
_M2 = np.uint64(0x94D049BB133111EB)
_S1 = np.uint64(1)
_S27 = np.uint64(27)
_S30 = np.uint64(30)
_S31 = np.uint64(31)
_S32 = np.uint64(32)
_S40 = np.uint64(40)
_INV24 = np.float32(1.0 / (1 << 24))
_EXP_MASK = np.uint32(0x7F800000)
_OPTS = dict(cache=True, nogil=True, error_model="numpy")


# --------------------------------------------------------------------------- hashing
@njit(**_OPTS)
def mix64(z):
    """splitmix64 finaliser of a uint64 ``z`` (see module doc); returns uint64."""
    z = np.uint64(z)
    z = (z ^ (z >> _S30)) * _M1
    z = (z ^ (z >> _S27)) * _M2
    return z ^ (z >> _S31)


@njit(**_OPTS)
def draw(key, i):
    """The i-th (0-based) output of splitmix64 seeded with ``key`` (uint64, i >= 0)."""
    return mix64(np.uint64(key) + (np.uint64(i) + _S1) * GOLDEN)


# --------------------------------------------------------------------------- vectors
@njit(**_OPTS)
def all_finite(x):
    """True iff every element of ``x`` (float32 (n,), contiguous) is finite.

    Counts the elements whose exponent bits are all ones (inf and NaN): an integer
    reduction, so it vectorises.
    """
    bits = x.view(np.uint32)
    bad = 0
    for i in range(bits.shape[0]):
        bad += (bits[i] & _EXP_MASK) == _EXP_MASK
    return bad == 0


@njit(fastmath={"reassoc"}, **_OPTS)
def compare_vectors(actual, predicted, out):
    """out[:] = [a.p, a.a, p.p, (a-p).(a-p)] in float64; a, p float32 (n,), out float64 (4,).

    The sums are reassociated (vectorised): 19k floats take 5 us instead of 24 us.
    """
    d = 0.0
    aa = 0.0
    pp = 0.0
    ee = 0.0
    for i in range(actual.shape[0]):
        a = np.float64(actual[i])
        p = np.float64(predicted[i])
        e = a - p
        d += a * p
        aa += a * a
        pp += p * p
        ee += e * e
    out[0] = d
    out[1] = aa
    out[2] = pp
    out[3] = ee


@njit(**_OPTS)
def relative_error_cosine(scores):
    """(|a - p| / |a|, cos(a, p)) from :func:`compare_vectors`' scores [a.p, a.a, p.p, e.e]: the
    relative error is 0 if both a and e are 0 and inf if only a is; the cosine is 1 if a and p are
    both 0, 0 if one is."""
    dot, aa, pp, ee = scores[0], scores[1], scores[2], scores[3]
    if aa > 0:
        rel = math.sqrt(ee / aa)
    else:
        rel = 0.0 if ee == 0 else math.inf
    if aa > 0 and pp > 0:
        cos = dot / math.sqrt(aa * pp)
    else:
        cos = 1.0 if aa == 0 and pp == 0 else 0.0
    return rel, cos


@njit(**_OPTS)
def clamp01(v):
    """min(max(v, 0), 1) as Python's min and max give it (NaN stays NaN)."""
    v = 0.0 if 0.0 > v else v
    return 1.0 if 1.0 < v else v


@njit(fastmath={"reassoc"}, **_OPTS)
def copy_sum_squares(src, dst):
    """dst[:] = src and return sum(src^2) in float64, additions reassociated as in
    :func:`qatlab.kernels.dense.sum_squares` (inf or NaN iff src holds inf or NaN).

    src, dst float32 (n,): the copy, the finiteness check and the norm of a real gradient, in one
    loop (Numba's ``dst[:] = src`` alone took 4.9 us for 19k floats; this whole kernel 2.1 us).
    """
    s = 0.0
    for i in range(src.shape[0]):
        v = src[i]
        dst[i] = v
        d = np.float64(v)
        s += d * d
    return s


_CHUNK = 512   # weighted_rows' float64 partial sums: 4 KiB, stays in L1


@njit(**_OPTS)
def weighted_rows(rows, coeffs, out):
    """out[j] = float32(sum_i coeffs[i] * rows[i, j]), float64 sum in row order; rows with
    coeffs[i] == 0 are skipped. rows float32 (B, n), coeffs float64 (B,), out float32 (n,).

    Row by row over chunks of ``_CHUNK`` columns (one 4 KiB float64 buffer per call), so the
    inner loop runs along a row and vectorises: 2 x 19k floats take 7.6 us instead of 36 us.
    """
    n = out.shape[0]
    buf = np.empty(_CHUNK, np.float64)
    for lo in range(0, n, _CHUNK):
        hi = min(lo + _CHUNK, n)
        acc, dst = buf[:hi - lo], out[lo:hi]     # slices: indexing with lo + j does not vectorise
        acc[:] = 0.0
        for i in range(rows.shape[0]):
            c = coeffs[i]
            if c != 0.0:
                src = rows[i, lo:hi]
                for j in range(hi - lo):
                    acc[j] += c * np.float64(src[j])
        for j in range(hi - lo):
            dst[j] = np.float32(acc[j])


@njit(inline="always")
def prediction(a, t, kf, c, sf):
    """One element of :func:`anchor_trend`: a + kf t + sf c in float32, added left to right."""
    return a + kf * t + sf * c


@njit(**_OPTS)
def anchor_trend(anchor, trend, k, corr, corr_scale, out):
    """out[j] = anchor[j] + k * trend[j] + corr_scale * corr[j] in float32 (k and corr_scale rounded
    to float32 once, the sum added left to right, as numpy computes it on float32 arrays); returns
    sum(out^2) in float64 (:func:`qatlab.kernels.dense.sum_squares` of out).

    anchor, trend, corr, out float32 (n,); k, corr_scale float64. The trend is not read when
    k == 0 nor the correction when corr_scale == 0 (adding 0 changes nothing). Float32 because a
    predicted step makes this pass and an optimizer's in one loop
    (:func:`qatlab.kernels.fused.predicted_steps`): with float64 inside it ran at half the width
    and the pair cost as much as two passes.
    """
    n = out.shape[0]
    kf, sf = np.float32(k), np.float32(corr_scale)
    if k != 0.0 and corr_scale != 0.0:
        for j in range(n):
            out[j] = prediction(anchor[j], trend[j], kf, corr[j], sf)
    elif k != 0.0:
        for j in range(n):
            out[j] = anchor[j] + kf * trend[j]
    elif corr_scale != 0.0:
        for j in range(n):
            out[j] = anchor[j] + sf * corr[j]
    else:
        for j in range(n):      # a loop: Numba's slice copy ``out[:] = anchor`` is ~3x slower
            out[j] = anchor[j]
    return sum_squares(out)


@njit(fastmath={"reassoc"}, **_OPTS)
def norms3(a, b, c):
    """(|a|, |b|, |c|) of three float32 (n,) vectors, float64 sums in one pass."""
    sa = sb = sc = 0.0
    for j in range(a.shape[0]):
        x, y, z = np.float64(a[j]), np.float64(b[j]), np.float64(c[j])
        sa += x * x
        sb += y * y
        sc += z * z
    return np.sqrt(sa), np.sqrt(sb), np.sqrt(sc)


@njit(**_OPTS)
def fold_correction(corr, decay, actual, predicted, weight):
    """corr[j] = float32(decay * corr[j] + weight * (actual[j] - predicted[j])) in place.

    corr, actual, predicted float32 (n,); decay, weight float64.
    """
    for j in range(corr.shape[0]):
        e = np.float64(actual[j]) - np.float64(predicted[j])
        corr[j] = np.float32(decay * np.float64(corr[j]) + weight * e)


# --------------------------------------------------------------------------- ternary
@njit(**_OPTS)
def ternarize_threshold(g, threshold, packed):
    """Deterministic trits of one tensor: q = sign(g) where |g| > threshold * mean|g|, else 0.

    g float32 (n,), packed uint8 (ceil(n/4),) overwritten. Returns (scale, n_pos, n_neg) with
    scale = mean |g| over the non-zeros (0.0 if none): the least-squares scale of that support.
    """
    n = g.shape[0]
    total = 0.0
    for i in range(n):
        total += abs(np.float64(g[i]))
    tau = threshold * (total / n) if n > 0 else 0.0
    s_sum = 0.0
    n_pos = 0
    n_neg = 0
    for b in range(packed.shape[0]):
        byte = 0
        for r in range(4):
            i = 4 * b + r
            if i < n:
                v = np.float64(g[i])
                if abs(v) > tau:
                    s_sum += abs(v)
                    if v > 0:
                        byte |= 1 << (2 * r)
                        n_pos += 1
                    else:
                        byte |= 2 << (2 * r)
                        n_neg += 1
        packed[b] = byte
    nnz = n_pos + n_neg
    scale = s_sum / nnz if nnz > 0 else 0.0
    return scale, n_pos, n_neg


@njit(**_OPTS)
def ternarize_stochastic(g, key, offset, packed):
    """Unbiased stochastic trits of one tensor, scale s = max|g|.

    q_i = sign(g_i) with probability p_i = float32(|g_i| / s), else 0, decided by
    uniform(draw(key, offset + i)) < p_i; so E[s q_i] = g_i up to the 2^-24 resolution.
    g float32 (n,), key uint64, offset int (global index of g[0]), packed uint8 (ceil(n/4),)
    overwritten. Returns (scale, n_pos, n_neg); scale 0.0 (all trits 0) if g == 0.
    """
    n = g.shape[0]
    s = np.float32(0.0)
    for i in range(n):
        a = abs(g[i])
        if a > s:
            s = a
    n_pos = 0
    n_neg = 0
    for b in range(packed.shape[0]):
        byte = 0
        for r in range(4):
            i = 4 * b + r
            if i < n and s > 0:
                v = g[i]
                p = abs(v) / s
                u = np.float32(draw(key, offset + i) >> _S40) * _INV24
                if u < p:
                    if v > 0:
                        byte |= 1 << (2 * r)
                        n_pos += 1
                    else:
                        byte |= 2 << (2 * r)
                        n_neg += 1
        packed[b] = byte
    return np.float64(s), n_pos, n_neg


@njit(**_OPTS)
def weighted_trits(packed, scales, coeffs, byte_offset, tensor, out):
    """out[i] = float32(sum_k coeffs[k] * scales[k, tensor] * trit_k[i]) for one tensor, float64 sums
    in row order; rows with coeffs[k] == 0 are skipped.

    packed uint8 (K, B) rows of packed trits, the tensor's bytes start at ``byte_offset``;
    scales float32 (K, T); coeffs float64 (K,); out float32 (n,) for the tensor's n elements.
    """
    for i in range(out.shape[0]):
        byte_i = byte_offset + (i >> 2)
        shift = 2 * (i & 3)
        acc = 0.0
        for k in range(packed.shape[0]):
            c = coeffs[k]
            if c != 0.0:
                code = (packed[k, byte_i] >> shift) & 3
                if code == 1:
                    acc += c * np.float64(scales[k, tensor])
                elif code == 2:
                    acc -= c * np.float64(scales[k, tensor])
        out[i] = np.float32(acc)


# --------------------------------------------------------------------------- VSA
@njit(**_OPTS)
def vsa_project(g, proj_key, k, y):
    """y = R g: element i adds sign(h) g_i / sqrt(k) to y[slot(h, D)] for its k hashes.

    h = draw(draw(proj_key, i), s) for s < k. g float32 (n,), proj_key uint64, k >= 1,
    y float64 (D,) overwritten. R (D, n) is never stored: each column is re-hashed.
    """
    dim = np.uint64(y.shape[0])
    for d in range(y.shape[0]):
        y[d] = 0.0
    inv = 1.0 / np.sqrt(np.float64(k))
    for i in range(g.shape[0]):
        base = draw(proj_key, i)
        v = np.float64(g[i]) * inv
        for s in range(k):
            h = draw(base, s)
            d = ((h >> _S32) * dim) >> _S32
            if h & _S1:
                y[d] -= v
            else:
                y[d] += v


@njit(**_OPTS)
def vsa_bind_bundle(y, key, bundle):
    """bundle[d] += float32(sign(draw(key, d)) * scale * q[d]), the bound ternarised projection.

    q = absmean trits of y: q[d] = sign(y[d]) if |y[d]| > 0.5 * mean|y| else 0 (that is
    clamp(rint(y / mean|y|), -1, 1)); scale = mean |y| over the non-zeros. y float64 (D,),
    key uint64, bundle float32 (D,) accumulated in place. Returns scale.
    """
    dim = y.shape[0]
    total = 0.0
    for d in range(dim):
        total += abs(y[d])
    tau = 0.5 * total / dim
    s_sum = 0.0
    nnz = 0
    for d in range(dim):
        if abs(y[d]) > tau:
            s_sum += abs(y[d])
            nnz += 1
    scale = s_sum / nnz if nnz > 0 else 0.0
    for d in range(dim):
        if abs(y[d]) > tau:
            q = scale if y[d] > 0 else -scale
            if draw(key, d) & _S1:
                q = -q
            bundle[d] += np.float32(q)
    return scale


@njit(**_OPTS)
def vsa_unbind_backproject(bundle, key, proj_key, k, z, out):
    """out = R^T (key * bundle): unbind with the tensor's +-1 key, then back-project.

    z[d] = sign(draw(key, d)) * bundle[d] (float64 scratch (D,)); out[i] = float32(sum_s
    sign(h) z[slot(h, D)] / sqrt(k)) with the same hashes h as :func:`vsa_project`.
    bundle float32 (D,), out float32 (n,).
    """
    dim = np.uint64(bundle.shape[0])
    for d in range(bundle.shape[0]):
        b = np.float64(bundle[d])
        z[d] = -b if draw(key, d) & _S1 else b
    inv = 1.0 / np.sqrt(np.float64(k))
    for i in range(out.shape[0]):
        base = draw(proj_key, i)
        acc = 0.0
        for s in range(k):
            h = draw(base, s)
            d = ((h >> _S32) * dim) >> _S32
            if h & _S1:
                acc -= z[d]
            else:
                acc += z[d]
        out[i] = np.float32(acc * inv)
