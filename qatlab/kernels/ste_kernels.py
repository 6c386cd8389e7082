r"""Numba kernels of the 2-layer ternary STE trainer (:class:`qatlab.train.ste_trainer.SteTrainer`).

Network (no biases), ``x`` (B, I), latents ``W1`` (H, I), ``W2`` (O, H)::

    Q(W)  = alpha * clamp(rint(W * float32(1/alpha)), -1, 1),  alpha = max(float32(mean|W|), eps)
    h     = relu(x @ Q(W1).T)                     (B, H)
    y     = h @ Q(W2).T                           (B, O)
    L     = mean((y - t)^2)                       over B*O, accumulated in float64
    dy    = 2 (y - t) / (B*O)                     (B, O)
    dQ2   = dy.T @ h                              (O, H)
    dh    = (dy @ Q(W2)) * [h > 0]                (B, H)
    dQ1   = dh.T @ x                              (H, I)
    dW    = ste(dQ, W) * [|W| <= clip]           (the ternary STE, u = W / alpha)
    W    -= lr * dW

``Q`` and the STE are the main engine's kernels (:func:`~qatlab.kernels.fakequant.ternary_forward`,
:func:`~qatlab.kernels.fakequant.ste_grad` with s = alpha, range [-1, 1]); what is SteTrainer's own
here is the step around them: no biases, the MSE over B*O, plain SGD, the latent clip and the record
of which latents got a gradient.

Everything is float32 except the loss and the absmean (float64 accumulators). Dense
products call ``np.dot(a, b, out)`` (Numba's BLAS binding); nothing allocates. A step whose
loss is not finite returns before the update, so the latents keep their last finite values.
"""
from __future__ import annotations

from typing import NamedTuple

import numpy as np
from numba import njit

from .fakequant import all_finite, ste_grad, ternary_forward

_ZERO = np.float32(0.0)
_ONE = np.float32(1.0)


class SteScratch(NamedTuple):
    """A step's buffers (float32 unless said): passed to the kernels as a plain tuple, named on entry."""

    wq1: np.ndarray         # Q(W1) (H, I)
    wq2: np.ndarray         # Q(W2) (O, H)
    h: np.ndarray           # hidden activations (B, H)
    y: np.ndarray           # outputs (B, O)
    dy: np.ndarray          # dL/dy (B, O)
    dh: np.ndarray          # dL/dh (B, H)
    dq1: np.ndarray         # dL/dQ(W1) (H, I)
    dq2: np.ndarray         # dL/dQ(W2) (O, H)
    touched1: np.ndarray    # uint8 like W1: 1 where a step's gradient was non-zero
    touched2: np.ndarray    # uint8 like W2


@njit(cache=True, nogil=True, error_model="numpy")
def dense(x, wq, relu, out):
    """out = x @ wq.T, then relu in place if ``relu``; x (B, I), wq (O, I), out (B, O).

    relu keeps NaN (``v < 0 -> 0``) so a diverging network stays visibly non-finite.
    """
    np.dot(x, wq.T, out)
    if relu:
        for b in range(out.shape[0]):
            for j in range(out.shape[1]):
                v = out[b, j]
                out[b, j] = _ZERO if v < _ZERO else v


@njit(cache=True, nogil=True, error_model="numpy")
def ste_sgd(w, dq, ste, alpha, lr, clip, touched):
    """w -= lr * dW with dW = ste(dq, w) * [|w| <= clip] (the ternary STE at alpha); touched[i] |= (dW != 0).

    w, dq float32 (n,); touched uint8 (n,); ste code 0..3; alpha, lr, clip float32. One loop per STE
    kind (the kind a constant in each), so each vectorises.
    """
    inv = _ONE / alpha
    if ste == 0:
        _sgd_loop(w, dq, 0, inv, lr, clip, touched)
    elif ste == 1:
        _sgd_loop(w, dq, 1, inv, lr, clip, touched)
    elif ste == 2:
        _sgd_loop(w, dq, 2, inv, lr, clip, touched)
    else:
        _sgd_loop(w, dq, 3, inv, lr, clip, touched)


@njit(cache=True, nogil=True, error_model="numpy", inline="always")
def _sgd_loop(w, dq, ste, inv, lr, clip, touched):
    """:func:`ste_sgd`'s loop at inv = 1 / alpha."""
    for i in range(w.shape[0]):
        wi = w[i]
        g = ste_grad(ste, dq[i], wi, inv, _ZERO, -_ONE, _ONE, _ZERO, inv) if np.abs(wi) <= clip else _ZERO
        touched[i] |= g != _ZERO
        w[i] = wi - lr * g


@njit(cache=True, nogil=True, error_model="numpy")
def train_step(x, t, w1, w2, ste, lr, clip, scratch):
    """One SGD step on the batch (x, t); returns the MSE loss (float64). See the module doc.

    x (B, I), t (B, O); latents w1 (H, I), w2 (O, H) are updated in place; scratch a
    :class:`SteScratch` tuple with B rows of h, y, dy, dh. Returns -1.0 without doing anything if x
    or t holds a NaN or inf.
    """
    return _step(x, t, w1, w2, ste, lr, clip, SteScratch(*scratch))


@njit(cache=True, nogil=True, error_model="numpy")
def _step(x, t, w1, w2, ste, lr, clip, s):
    """:func:`train_step` with the scratch named."""
    if not (all_finite(x.reshape(x.size)) and all_finite(t.reshape(t.size))):
        return -1.0
    wq1, wq2, h, y, dy, dh, dq1, dq2 = s.wq1, s.wq2, s.h, s.y, s.dy, s.dh, s.dq1, s.dq2
    a1 = ternary_forward(w1.reshape(w1.size), wq1.reshape(wq1.size))
    a2 = ternary_forward(w2.reshape(w2.size), wq2.reshape(wq2.size))
    if not (np.isfinite(a1) and np.isfinite(a2)):   # a latent left float32: the loss says so
        return np.nan
    dense(x, wq1, True, h)
    dense(h, wq2, False, y)
    B, O = y.shape
    scale = np.float32(2.0 / (B * O))
    acc = 0.0
    for b in range(B):
        for o in range(O):
            d = y[b, o] - t[b, o]
            acc += np.float64(d) * np.float64(d)
            dy[b, o] = d * scale
    loss = acc / (B * O)
    if not np.isfinite(loss):
        return loss
    np.dot(dy.T, h, dq2)
    np.dot(dy, wq2, dh)
    for b in range(B):
        for j in range(dh.shape[1]):
            dh[b, j] = dh[b, j] if h[b, j] > _ZERO else _ZERO
    np.dot(dh.T, x, dq1)
    ste_sgd(w1.reshape(w1.size), dq1.reshape(dq1.size), ste, a1, lr, clip, s.touched1.reshape(s.touched1.size))
    ste_sgd(w2.reshape(w2.size), dq2.reshape(dq2.size), ste, a2, lr, clip, s.touched2.reshape(s.touched2.size))
    return loss


@njit(cache=True, nogil=True, error_model="numpy")
def train_epoch(X, T, perm, batch_size, w1, w2, ste, lr, clip, xb, tb, scratch):
    """One epoch of :func:`train_step` over rows ``perm`` of X (n, I), T (n, O) in batches.

    xb (>= batch_size, I), tb (>= batch_size, O) receive each gathered batch; the last batch
    may be short. Returns (sample-weighted mean loss, steps run); a non-finite step loss
    stops the epoch and is returned as the loss.
    """
    s = SteScratch(*scratch)
    n = perm.shape[0]
    total = 0.0
    steps = 0
    for start in range(0, n, batch_size):
        m = min(batch_size, n - start)
        for r in range(m):
            src = perm[start + r]
            xb[r, :] = X[src, :]
            tb[r, :] = T[src, :]
        rows = SteScratch(s.wq1, s.wq2, s.h[:m], s.y[:m], s.dy[:m], s.dh[:m], s.dq1, s.dq2, s.touched1, s.touched2)
        loss = _step(xb[:m], tb[:m], w1, w2, ste, lr, clip, rows)
        steps += 1
        if not np.isfinite(loss):
            return loss, steps
        total += loss * m
    return total / n, steps
