r"""Numba kernels of the convolution and max-pooling layers (float32, NCHW batches).

A convolution is im2col + one matrix product (made by :mod:`qatlab.nn.layers` with NumPy's BLAS)::

    cols[r, q]  = x[b, c, oh*sh - ph + i, ow*sw - pw + j]   (0 outside the image)
                  r = (c*kh + i)*kw + j   (C*kh*kw rows),   q = (b*OH + oh)*OW + ow   (B*OH*OW columns)
    z           = Wq @ cols                                  Wq: the (Cout, C*kh*kw) view of the weight
    y[b, o, p]  = act(z[o, b*P + p] + bias[o])               P = OH*OW      (:func:`cols_to_nchw`)

and its backward::

    dz[o, b*P + p] = dy[b, o, p] * act'(y[b, o, p]),  db[o] = sum dz[o, :]   (:func:`nchw_to_cols`)
    dWq = dz @ cols.T,   dcols = Wq.T @ dz,   dx = col2im(dcols)              (:func:`col2im`)

With a ReLU (or no activation) followed by a max pool, :func:`bias_act_pool` pools z + bias and
applies the activation to the pooled values only (both commute with max), and :func:`pool_to_cols`
is the backward of both at once: the activation map (B, Cout, OH, OW) is never written.

Activation codes and derivatives are those of :mod:`qatlab.kernels.dense` (in terms of the output).
Max pooling keeps the flat index (within the H x W plane) of each window's maximum, so its backward
is one scatter-add. The kernels work on a range of images, so callers may run ranges on several
threads (they write disjoint parts); every sum runs inside one call in a fixed order, so the results
do not depend on the thread count. Arrays are indexed flat with unsigned integers: Numba then drops
the negative-index wraparound tests and the copy loops vectorise.
"""
from __future__ import annotations

import numpy as np
from numba import njit

from .dense import LEAKY_RELU, LEAKY_SLOPE, RELU, SIGMOID, SIGN, TANH

_ZERO = np.float32(0.0)
_ONE = np.float32(1.0)
# Reassociation lets the bias-gradient sums vectorise; no 'nnan'/'ninf': NaN and inf keep their meaning.
_RED = {"nsz", "contract", "reassoc"}


@njit(cache=True, nogil=True, inline="always")
def _valid(n_out, stride, offset, size):
    """[lo, hi) of the output positions o with 0 <= o*stride + offset < size."""
    lo = 0 if offset >= 0 else (-offset + stride - 1) // stride
    hi = min(n_out, (size - 1 - offset) // stride + 1) if size - 1 - offset >= 0 else 0
    return lo, max(hi, lo)


_U = np.uint64     # flat indices as unsigned integers (module doc)


@njit(cache=True, nogil=True, error_model="numpy")
def _im2col_valid(x, kh, kw, b_lo, b_hi, cols):
    """:func:`im2col` at stride 1 without padding, image by image: each (b, c) plane stays in L1 and no
    row needs bounds checks (faster than the general loop; ``bench conv``)."""
    B, C, H, W = x.shape
    OH, OW = H - kh + 1, W - kw + 1
    P = OH * OW
    N = B * P
    xf, cf = x.reshape(-1), cols.reshape(-1)
    for b in range(b_lo, b_hi):
        for c in range(C):
            xo = (b * C + c) * H * W
            for i in range(kh):
                for j in range(kw):
                    d = _U(((c * kh + i) * kw + j) * N + b * P)
                    src = _U(xo + i * W + j)
                    for oh in range(OH):
                        for ow in range(OW):
                            cf[d + _U(oh * OW + ow)] = xf[src + _U(oh * W + ow)]


@njit(cache=True, nogil=True, error_model="numpy")
def im2col(x, kh, kw, sh, sw, ph, pw, b_lo, b_hi, cols):
    """cols[:, b*P:(b+1)*P] (module doc) for images b_lo <= b < b_hi of x (B, C, H, W); cols
    (C*kh*kw, B*OH*OW) C-contiguous; zero where the window leaves x. Ranges of b are independent."""
    if sh == 1 and sw == 1 and ph == 0 and pw == 0:
        _im2col_valid(x, kh, kw, b_lo, b_hi, cols)
        return
    B, C, H, W = x.shape
    OH = (H + 2 * ph - kh) // sh + 1
    OW = (W + 2 * pw - kw) // sw + 1
    P = OH * OW
    N = B * P
    xf, cf = x.reshape(-1), cols.reshape(-1)
    for c in range(C):
        for i in range(kh):
            for j in range(kw):
                r = (c * kh + i) * kw + j
                off = j - pw
                lo, hi = _valid(OW, sw, off, W)
                for b in range(b_lo, b_hi):
                    for oh in range(OH):
                        d = _U(r * N + b * P + oh * OW)
                        ih = oh * sh - ph + i
                        if ih < 0 or ih >= H:
                            for ow in range(OW):
                                cf[d + _U(ow)] = _ZERO
                            continue
                        for ow in range(lo):
                            cf[d + _U(ow)] = _ZERO
                        src = _U(((b * C + c) * H + ih) * W + off)
                        if sw == 1:
                            for ow in range(lo, hi):
                                cf[d + _U(ow)] = xf[src + _U(ow)]
                        else:
                            for ow in range(lo, hi):
                                cf[d + _U(ow)] = xf[src + _U(ow * sw)]
                        for ow in range(hi, OW):
                            cf[d + _U(ow)] = _ZERO


@njit(cache=True, nogil=True, error_model="numpy")
def _col2im_valid(cols, kh, kw, b_lo, b_hi, dx):
    """:func:`col2im` at stride 1 without padding, image by image (as :func:`_im2col_valid`)."""
    B, C, H, W = dx.shape
    OH, OW = H - kh + 1, W - kw + 1
    P = OH * OW
    N = B * P
    cf, df = cols.reshape(-1), dx.reshape(-1)
    for b in range(b_lo, b_hi):
        for c in range(C):
            xo = (b * C + c) * H * W
            for k in range(xo, xo + H * W):
                df[_U(k)] = _ZERO
            for i in range(kh):
                for j in range(kw):
                    src = _U(((c * kh + i) * kw + j) * N + b * P)
                    d = _U(xo + i * W + j)
                    for oh in range(OH):
                        for ow in range(OW):
                            df[d + _U(oh * W + ow)] += cf[src + _U(oh * OW + ow)]


@njit(cache=True, nogil=True, error_model="numpy")
def col2im(cols, kh, kw, sh, sw, ph, pw, b_lo, b_hi, dx):
    """dx[b] (C, H, W) for b_lo <= b < b_hi = the sum of every cols entry (C*kh*kw, B*OH*OW) into
    the pixel :func:`im2col` read it from, in (c, i, j, oh, ow) order (entries from the padding are
    dropped); dx (B, C, H, W) C-contiguous. Ranges of b are independent."""
    if sh == 1 and sw == 1 and ph == 0 and pw == 0:
        _col2im_valid(cols, kh, kw, b_lo, b_hi, dx)
        return
    B, C, H, W = dx.shape
    OH = (H + 2 * ph - kh) // sh + 1
    OW = (W + 2 * pw - kw) // sw + 1
    P = OH * OW
    N = B * P
    cf, df = cols.reshape(-1), dx.reshape(-1)
    for b in range(b_lo, b_hi):
        base = b * C * H * W
        for k in range(base, base + C * H * W):
            df[_U(k)] = _ZERO
        for c in range(C):
            for i in range(kh):
                for j in range(kw):
                    r = (c * kh + i) * kw + j
                    off = j - pw
                    lo, hi = _valid(OW, sw, off, W)
                    for oh in range(OH):
                        ih = oh * sh - ph + i
                        if ih < 0 or ih >= H:
                            continue
                        src = _U(r * N + b * P + oh * OW)
                        dst = _U(((b * C + c) * H + ih) * W + off)
                        if sw == 1:
                            for ow in range(lo, hi):
                                df[dst + _U(ow)] += cf[src + _U(ow)]
                        else:
                            for ow in range(lo, hi):
                                df[dst + _U(ow * sw)] += cf[src + _U(ow)]


@njit(cache=True, nogil=True, error_model="numpy")
def cols_to_nchw(z, bias, act, b_lo, b_hi, y):
    """y[b, o, p] = act(z[o, b*P + p] + bias[o]) for images b_lo <= b < b_hi; z (Cout, B*P), bias (Cout,),
    y (B, Cout, P)."""
    B, Co, P = y.shape
    for b in range(b_lo, b_hi):
        for o in range(Co):
            bo = bias[o]
            q = b * P
            if act == RELU:
                for p in range(P):
                    v = z[o, q + p] + bo
                    y[b, o, p] = _ZERO if v < _ZERO else v
            elif act == LEAKY_RELU:
                for p in range(P):
                    v = z[o, q + p] + bo
                    y[b, o, p] = v * LEAKY_SLOPE if v < _ZERO else v
            elif act == TANH:
                for p in range(P):
                    y[b, o, p] = np.tanh(z[o, q + p] + bo)
            elif act == SIGMOID:
                for p in range(P):
                    y[b, o, p] = _ONE / (_ONE + np.exp(-(z[o, q + p] + bo)))
            elif act == SIGN:
                for p in range(P):
                    y[b, o, p] = np.sign(z[o, q + p] + bo)
            else:
                for p in range(P):
                    y[b, o, p] = z[o, q + p] + bo


@njit(cache=True, nogil=True, error_model="numpy", fastmath=_RED)
def nchw_to_cols(dy, y, act, b_lo, b_hi, dz, db):
    """dz[o, b*P + p] = dy[b, o, p] * act'(y[b, o, p]) for images b_lo <= b < b_hi, and db[o] = the sum
    of those (per image a vectorised sum, whose order depends on P only); dy, y (B, Cout, P) (y the
    activation output), dz (Cout, B*P), db (Cout,)."""
    B, Co, P = dy.shape
    for o in range(Co):
        acc = _ZERO
        for b in range(b_lo, b_hi):
            q = b * P
            if act == RELU:
                for p in range(P):
                    dz[o, q + p] = dy[b, o, p] if y[b, o, p] > _ZERO else _ZERO
            elif act == LEAKY_RELU:
                for p in range(P):
                    dz[o, q + p] = dy[b, o, p] if y[b, o, p] > _ZERO else dy[b, o, p] * LEAKY_SLOPE
            elif act == TANH:
                for p in range(P):
                    dz[o, q + p] = dy[b, o, p] * (_ONE - y[b, o, p] * y[b, o, p])
            elif act == SIGMOID:
                for p in range(P):
                    dz[o, q + p] = dy[b, o, p] * (y[b, o, p] * (_ONE - y[b, o, p]))
            else:   # identity, and sign's straight-through estimator
                for p in range(P):
                    dz[o, q + p] = dy[b, o, p]
            s = _ZERO
            for p in range(P):
                s += dz[o, q + p]
            acc += s
        db[o] = acc


@njit(cache=True, nogil=True, error_model="numpy")
def _window_scan(xf, xo, corner, kh, kw, W, bias):
    """(max, flat index) of one window of x + bias holding a NaN or an infinity: the first maximum,
    a NaN wins."""
    at = corner
    best = xf[_U(xo + corner)] + bias
    for i in range(kh):
        for j in range(kw):
            k = corner + i * W + j
            v = xf[_U(xo + k)] + bias
            if best == best and not v <= best:
                best = v
                at = k
    return best, at


@njit(cache=True, nogil=True, error_model="numpy")
def _pool_plane(xf, xo, bias, H, W, kh, kw, sh, sw, yf, jf, yo, OH, OW):
    """Max pool of one H x W plane of x + bias (x the flat xf from offset xo) into OH x OW outputs of yf
    from offset yo, with the flat index ih*W + iw of each window's first maximum in jf (a NaN wins and
    stays). Branch-free for finite windows (the max, then the first index equal to it by integer
    arithmetic): data-dependent branches made it 10x slower. 2x2 and 1x2 windows at their own stride
    (the Cnn's pools) are unrolled. bias = -0.0 leaves every value as it is."""
    if kw == 2 and sw == 2 and sh == kh and kh <= 2:
        down = W if kh == 2 else 0             # 1x2: the "second row" is the first again, never chosen
        for oh in range(OH):
            for ow in range(OW):
                k = kh * oh * W + 2 * ow
                a = xf[_U(xo + k)] + bias
                b = xf[_U(xo + k + 1)] + bias
                c = xf[_U(xo + k + down)] + bias
                d = xf[_U(xo + k + down + 1)] + bias
                if (a + b + c + d) * _ZERO != _ZERO:       # a NaN or an infinity in the window
                    m, at = _window_scan(xf, xo, k, kh, 2, W, bias)
                else:
                    m = max(max(a, b), max(c, d))
                    ia, ib, ic = np.int64(a == m), np.int64(b == m), np.int64(c == m)
                    at = k + (1 - ia) * (ib + (1 - ib) * (ic * down + (1 - ic) * (down + 1)))
                yf[_U(yo + oh * OW + ow)] = m
                jf[_U(yo + oh * OW + ow)] = at
        return
    for oh in range(OH):
        for ow in range(OW):
            corner = oh * sh * W + ow * sw
            m = xf[_U(xo + corner)] + bias
            bad = _ZERO
            for i in range(kh):
                for j in range(kw):
                    v = xf[_U(xo + corner + i * W + j)] + bias
                    m = max(m, v)
                    bad += v * _ZERO               # NaN when the window holds a NaN or an inf
            if bad != bad:
                m, at = _window_scan(xf, xo, corner, kh, kw, W, bias)
            else:
                at = corner
                for i in range(kh - 1, -1, -1):
                    for j in range(kw - 1, -1, -1):
                        k = corner + i * W + j
                        at += (k - at) * np.int64(xf[_U(xo + k)] + bias == m)
            yf[_U(yo + oh * OW + ow)] = m
            jf[_U(yo + oh * OW + ow)] = at


_KEEP = np.float32(-0.0)     # x + (-0.0) == x for every float x, -0.0 included


@njit(cache=True, nogil=True, error_model="numpy")
def maxpool_forward(x, kh, kw, sh, sw, y, idx):
    """y[b, c, oh, ow] = max of the kh x kw window of x (B, C, H, W) at (oh*sh, ow*sw); idx (int32,
    shape of y) gets the flat index ih*W + iw of the first maximum (a NaN wins and stays).
    x, y, idx C-contiguous."""
    B, C, OH, OW = y.shape
    H, W = x.shape[2], x.shape[3]
    xf, yf, jf = x.reshape(-1), y.reshape(-1), idx.reshape(-1)
    for plane in range(B * C):
        _pool_plane(xf, plane * H * W, _KEEP, H, W, kh, kw, sh, sw, yf, jf, plane * OH * OW, OH, OW)


@njit(cache=True, nogil=True, error_model="numpy")
def bias_act_pool(z, bias, act, kh, kw, H, W, b_lo, b_hi, y, idx):
    """y[b, o] = the kh x kw max pool (stride = window) of act(z[o, b*P:(b+1)*P] + bias[o]) seen as an
    H x W plane (P = H*W), for images b_lo <= b < b_hi, and idx its argmax as :func:`maxpool_forward`'s;
    z (Cout, B*P), y and idx (B, Cout, OH, OW). act: RELU or IDENTITY, which commute with max: the
    pool runs on z + bias and act on its outputs only. Where the window's maximum is <= 0 the ReLU's
    index can differ from the pool of the activations', but the gradient it routes is 0 there."""
    B, Co, OH, OW = y.shape
    P = H * W
    N = z.shape[1]
    zf, yf, jf = z.reshape(-1), y.reshape(-1), idx.reshape(-1)
    for b in range(b_lo, b_hi):
        for o in range(Co):
            yo = (b * Co + o) * OH * OW
            _pool_plane(zf, o * N + b * P, bias[o], H, W, kh, kw, kh, kw, yf, jf, yo, OH, OW)
            if act == RELU:
                for k in range(yo, yo + OH * OW):
                    v = yf[_U(k)]
                    yf[_U(k)] = _ZERO if v < _ZERO else v


@njit(cache=True, nogil=True, error_model="numpy", fastmath=_RED)
def pool_to_cols(dy, idx, y, act, P, b_lo, b_hi, dz, db):
    """The backward of :func:`bias_act_pool` for images b_lo <= b < b_hi: dz[o, b*P:(b+1)*P] = 0 but
    dz[o, b*P + idx[b, o, q]] = dy[b, o, q] * act'(y[b, o, q]) (windows do not overlap), and db[o] =
    the sum of those; dy, idx, y (B, Cout, OH, OW) (y the pooled activation), dz (Cout, B*P), db (Cout,)."""
    B, Co, OH, OW = dy.shape
    Q = OH * OW
    N = dz.shape[1]
    gf, jf, yf, zf = dy.reshape(-1), idx.reshape(-1), y.reshape(-1), dz.reshape(-1)
    for o in range(Co):
        acc = _ZERO
        for b in range(b_lo, b_hi):
            base = o * N + b * P
            for k in range(base, base + P):
                zf[_U(k)] = _ZERO
            src = (b * Co + o) * Q
            s = _ZERO
            for q in range(src, src + Q):
                d = gf[_U(q)]
                if act == RELU and not yf[_U(q)] > _ZERO:
                    d = _ZERO
                zf[_U(base + jf[_U(q)])] = d
                s += d
            acc += s
        db[o] = acc


@njit(cache=True, nogil=True, error_model="numpy")
def maxpool_backward(dy, idx, dx):
    """dx (B, C, H, W) = 0, then dx[b, c].flat[idx[b, c, oh, ow]] += dy[b, c, oh, ow] (in order);
    all C-contiguous."""
    B, C, H, W = dx.shape
    OH, OW = dy.shape[2], dy.shape[3]
    gf, jf, df = dy.reshape(-1), idx.reshape(-1), dx.reshape(-1)
    df[:] = _ZERO
    for plane in range(B * C):
        xo = plane * H * W
        for k in range(plane * OH * OW, (plane + 1) * OH * OW):
            df[_U(xo + jf[_U(k)])] += gf[_U(k)]
