r"""Numba kernels of the dense MLP: layer forward/backward, losses, gradient-buffer utilities.

All arrays are float32 and C-contiguous unless stated; ``B`` is the batch, ``N`` the
features of a layer, ``K`` the outputs.

Activations are integer codes (:data:`ACT_CODES`); each derivative is written in terms of
the activation's *output* ``a``, so the backward needs no pre-activation buffer::

    0 identity    a = z                     da/dz = 1
    1 relu        a = max(z, 0)             da/dz = 1 if a > 0 else 0
    2 leaky_relu  a = z if z >= 0 else 0.01 z   da/dz = 1 if a > 0 else 0.01
    3 tanh        a = tanh(z)               da/dz = 1 - a^2
    4 sigmoid     a = 1 / (1 + exp(-z))     da/dz = a (1 - a)
    5 sign        a = sign(z), sign(0) = 0  da/dz = 1   (straight-through estimator)

The dense products themselves are ``np.dot(a, b, out=)`` calls made by :mod:`qatlab.nn`:
NumPy's bundled OpenBLAS is faster than the SciPy BLAS that ``np.dot`` inside ``njit`` binds
to, by more than the extra Python calls cost (see ``Mlp.forward``).
"""
from __future__ import annotations

import numpy as np
from llvmlite import ir
from numba import njit, types
from numba.extending import intrinsic

IDENTITY, RELU, LEAKY_RELU, TANH, SIGMOID, SIGN = 0, 1, 2, 3, 4, 5
ACT_CODES = {"identity": IDENTITY, "relu": RELU, "leaky_relu": LEAKY_RELU,
             "tanh": TANH, "sigmoid": SIGMOID, "sign": SIGN}
LEAKY_SLOPE = np.float32(0.01)

_ZERO = np.float32(0.0)
_ONE = np.float32(1.0)
# Reassociation lets reductions vectorise; no 'nnan'/'ninf', so NaN and inf keep their meaning.
_RED = {"nsz", "contract", "reassoc"}


@njit(cache=True, nogil=True, error_model="numpy")
def bias_act_inplace(z, b, act):
    """z[i, j] = act(z[i, j] + b[j]) in place; z (B, N), b (N,), act an activation code.

    In place on purpose: with separate in/out arrays that may alias, LLVM guards the vector
    loop with an overlap check and falls back to scalar code when they are the same array.
    """
    B, N = z.shape
    if act == RELU:
        for i in range(B):
            for j in range(N):
                v = z[i, j] + b[j]
                z[i, j] = _ZERO if v < _ZERO else v
    elif act == LEAKY_RELU:
        for i in range(B):
            for j in range(N):
                v = z[i, j] + b[j]
                z[i, j] = v * LEAKY_SLOPE if v < _ZERO else v
    elif act == TANH:
        for i in range(B):
            for j in range(N):
                z[i, j] = np.tanh(z[i, j] + b[j])
    elif act == SIGMOID:
        for i in range(B):
            for j in range(N):
                z[i, j] = _ONE / (_ONE + np.exp(-(z[i, j] + b[j])))
    elif act == SIGN:
        for i in range(B):
            for j in range(N):
                z[i, j] = np.sign(z[i, j] + b[j])
    else:
        for i in range(B):
            for j in range(N):
                z[i, j] = z[i, j] + b[j]


@njit(cache=True, nogil=True, error_model="numpy")
def bias_grad(dz, out):
    """out[j] = sum_i dz[i, j]; dz (B, N), out (N,) (float32 accumulation, row by row)."""
    out[:] = _ZERO
    for i in range(dz.shape[0]):
        for j in range(dz.shape[1]):
            out[j] += dz[i, j]


@njit(cache=True, nogil=True, error_model="numpy")
def act_backward_inplace(d, a, act, db):
    """d[i, j] *= act'(a[i, j]) in place, then db[j] = sum_i d[i, j].

    d: dL/da on entry, dL/dz on exit (B, N); a: the activation output (B, N); db (N,).
    identity and sign (straight-through) leave d unchanged.
    """
    B, N = d.shape
    db[:] = _ZERO
    for i in range(B):  # one row at a time: the row is still in L1 when db accumulates it
        if act == RELU:
            for j in range(N):
                d[i, j] = d[i, j] if a[i, j] > _ZERO else _ZERO
        elif act == LEAKY_RELU:
            for j in range(N):
                d[i, j] = d[i, j] if a[i, j] > _ZERO else d[i, j] * LEAKY_SLOPE
        elif act == TANH:
            for j in range(N):
                d[i, j] = d[i, j] * (_ONE - a[i, j] * a[i, j])
        elif act == SIGMOID:
            for j in range(N):
                d[i, j] = d[i, j] * (a[i, j] * (_ONE - a[i, j]))
        for j in range(N):
            db[j] += d[i, j]


# exp(x) for x <= 0 in float32 (Cephes expf): x = n ln2 + r, |r| <= ln2/2, exp(r) by a degree-7
# polynomial, times 2^n built from the exponent bits; within 1.02 ulp of exp over [-87.3, 0]
# (tested), and 0 below -87.34 (where exp(x) is below FLT_MIN). Every step vectorises, unlike
# a call to libm's expf per element.
_LOG2E = np.float32(1.4426950408889634)
_LN2_HI, _LN2_LO = np.float32(0.693359375), np.float32(-2.12194440e-4)
_EXP_P = (np.float32(1.9875691500e-4), np.float32(1.3981999507e-3), np.float32(8.3334519073e-3),
          np.float32(4.1665795894e-2), np.float32(1.6666665459e-1), np.float32(5.0000001201e-1))
_EXP_MIN_X = np.float32(-87.33654)


@intrinsic
def _float32_from_bits(typingctx, bits):
    """The float32 whose IEEE-754 bits are the int32 ``bits`` (an LLVM bitcast)."""
    def codegen(context, builder, signature, args):
        return builder.bitcast(args[0], ir.FloatType())
    return types.float32(types.int32), codegen


@njit(cache=True, nogil=True, error_model="numpy", fastmath={"contract"})
def exp_nonpositive_inplace(x):
    """x[i] = exp(x[i]) for finite x[i] <= 0 (see above); x float32 (n,). In place on purpose: with
    separate in/out arrays that alias, LLVM's overlap check falls back to scalar code."""
    p0, p1, p2, p3, p4, p5 = _EXP_P
    for i in range(x.shape[0]):
        small = x[i] < _EXP_MIN_X
        xi = _EXP_MIN_X if small else x[i]
        n = np.rint(xi * _LOG2E)
        r = xi - n * _LN2_HI - n * _LN2_LO
        p = ((((p0 * r + p1) * r + p2) * r + p3) * r + p4) * r + p5
        e = np.int32(-127) if small else np.int32(n)            # 2^-127 -> bits 0 -> 0.0
        x[i] = (p * r * r + r + _ONE) * _float32_from_bits((e + np.int32(127)) << np.int32(23))


@njit(cache=True, nogil=True, error_model="numpy")
def count_correct(logits, labels):
    """Rows i of logits (B, K) float32 whose argmax equals labels[i] (int (B,)); the argmax is
    np.argmax's: the first maximum, or the first NaN of a row holding one."""
    n = 0
    for i in range(logits.shape[0]):
        best = 0
        if logits[i, 0] == logits[i, 0]:
            for k in range(1, logits.shape[1]):
                v = logits[i, k]
                if v != v:
                    best = k
                    break
                if v > logits[i, best]:
                    best = k
        if best == labels[i]:
            n += 1
    return n


@njit(cache=True, nogil=True, error_model="numpy")
def softmax_cross_entropy(logits, labels, d_out):
    """Mean softmax cross-entropy; returns the loss (float64) and writes its gradient.

    loss = (1/B) sum_i [logsumexp(logits[i]) - logits[i, labels[i]]]  (max-shifted, stable)
    d_out[i, k] = (softmax(logits[i])[k] - [k == labels[i]]) / B       (skipped if d_out has 0 rows)

    logits (B, K) float32; labels (B,) integers in [0, K); d_out (B, K) float32 C-contiguous or (0, K).
    Raises ValueError for a label outside [0, K). NaN or +-inf logits give a NaN loss (d_out then
    holds no gradient). exp is :func:`exp_nonpositive_inplace`; the row sums s_i are float64, and
    sum_i log(s_i) is taken as the log of products of 16 s_i at a time (each s_i is in [1, K]):
    1/16 of the log calls. Allocates nothing when d_out has B rows (a (B, K) buffer otherwise).
    """
    B, K = logits.shape
    write = d_out.shape[0] > 0
    inv_b = np.float32(1.0 / B)
    for i in range(B):
        if labels[i] < 0 or labels[i] >= K:
            raise ValueError("labels: every label must be in [0, n_classes)")
    e = d_out if write else np.empty((B, K), np.float32)
    nonfinite = _ZERO   # sum of (logit - row max) * 0: NaN if any logit is NaN or +-inf
    total = 0.0
    for i in range(B):
        m = logits[i, 0]
        for k in range(1, K):
            if logits[i, k] > m:
                m = logits[i, k]
        for k in range(K):
            e[i, k] = logits[i, k] - m
            nonfinite += e[i, k] * _ZERO
        total += np.float64(m) - np.float64(logits[i, labels[i]])
    if nonfinite != _ZERO:
        return np.nan
    exp_nonpositive_inplace(e.reshape(-1))
    prod = 1.0
    for i in range(B):
        s = 0.0
        for k in range(K):
            s += e[i, k]
        prod *= s
        if i % 16 == 15:
            total += np.log(prod)
            prod = 1.0
        if write:
            c = np.float32(1.0 / s) * inv_b
            for k in range(K):
                d_out[i, k] *= c
            d_out[i, labels[i]] -= inv_b
    return (total + np.log(prod)) / B


@njit(cache=True, nogil=True, error_model="numpy")
def mse(y, t, d_out):
    """Mean squared error over batch and outputs; returns the loss (float64) and its gradient.

    loss = (1/(B K)) sum_ij (y_ij - t_ij)^2;  d_out = 2 (y - t) / (B K)  (skipped if 0 rows)
    y, t (B, K) float32; d_out (B, K) float32 or (0, K).
    """
    B, K = y.shape
    write = d_out.shape[0] > 0
    c = np.float32(2.0 / (B * K))
    total = 0.0
    for i in range(B):
        for j in range(K):
            d = y[i, j] - t[i, j]
            total += np.float64(d) * np.float64(d)
            if write:
                d_out[i, j] = c * d
    return total / (B * K)


@njit(cache=True, nogil=True, fastmath=_RED, error_model="numpy")
def sum_squares(x):
    """sum_i x[i]^2 accumulated in float64; x (n,) float32."""
    acc = 0.0
    for i in range(x.shape[0]):
        v = np.float64(x[i])
        acc += v * v
    return acc


@njit(cache=True, nogil=True, error_model="numpy")
def scale_inplace(x, s):
    """x[i] *= float32(s); x (n,) float32, s a float."""
    c = np.float32(s)
    for i in range(x.shape[0]):
        x[i] *= c


@njit(cache=True, nogil=True, error_model="numpy")
def sign_counts(x):
    """(count of x < 0, count of x > 0) over x float32 (n,) (NaN counts in neither); vectorised,
    unlike np.count_nonzero on float arrays."""
    neg = 0
    pos = 0
    for i in range(x.shape[0]):
        neg += x[i] < _ZERO
        pos += x[i] > _ZERO
    return neg, pos


@njit(cache=True, nogil=True, error_model="numpy")
def two_sign_counts(a, b):
    """:func:`sign_counts` of a and of b in one call: (a neg, a pos, b neg, b pos)."""
    a_neg, a_pos = sign_counts(a)
    b_neg, b_pos = sign_counts(b)
    return a_neg, a_pos, b_neg, b_pos
