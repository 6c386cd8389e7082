"""Numba kernels of the optimizers (see :mod:`qatlab.optim` for the update rules and the
flush to zero); p, g and the state are float32 (n,), updated in place."""
from __future__ import annotations

import math

import numpy as np
from numba import njit

from .fakequant import ternary_ste_clipped

FLT_MIN = np.float32(np.finfo(np.float32).tiny)   # smallest normal float32: state below it is flushed to 0


# -- kernels: p, g, state float32 (n,); scalars arrive as Python floats (fast to dispatch) and
# are rounded to float32 once, so the loop runs in float32 like torch's CPU kernels. Each update
# is an element function (inlined) over those float32 constants, so a kernel that makes the
# gradient element by element (qatlab.kernels.fused.predicted_steps) updates with the same numbers.
@njit(inline="always")
def sgd_constants(gscale, l2, decay, lr):
    """The float32 constants of :func:`sgd_element`."""
    return np.float32(gscale), np.float32(l2), np.float32(decay), np.float32(lr)


@njit(inline="always")
def sgd_element(p, g, gs, l2f, dec, lrf):
    """One element of :func:`sgd_kernel`: the new p."""
    gi = g * gs + l2f * p
    return p * dec - lrf * gi


@njit(inline="always")
def momentum_constants(gscale, l2, decay, lr, mu):
    """The float32 constants of :func:`momentum_element`."""
    return np.float32(gscale), np.float32(l2), np.float32(decay), np.float32(lr), np.float32(mu)


@njit(inline="always")
def momentum_element(p, g, b, gs, l2f, dec, lrf, muf):
    """One element of :func:`momentum_kernel`: the new (p, buf)."""
    gi = g * gs + l2f * p
    b = muf * b + gi
    if abs(b) < FLT_MIN:
        b = np.float32(0.0)
    return p * dec - lrf * b, b


@njit(inline="always")
def adam_constants(gscale, l2, decay, b1, b2, step_size, bc2_sqrt, eps):
    """The float32 constants of :func:`adam_element`."""
    return (np.float32(gscale), np.float32(l2), np.float32(decay), np.float32(1.0 - b1), np.float32(b2),
            np.float32(1.0 - b2), np.float32(step_size), np.float32(1.0 / bc2_sqrt), np.float32(eps))


@njit(inline="always")
def adam_element(p, g, m, v, gs, l2f, dec, c1, b2f, c2, st, inv_bc, ep):
    """One element of :func:`adam_kernel`: the new (p, m, v)."""
    gi = g * gs + l2f * p
    mi = m + c1 * (gi - m)
    vi = b2f * v + c2 * gi * gi
    if abs(mi) < FLT_MIN:
        mi = np.float32(0.0)
    if vi < FLT_MIN:
        vi = np.float32(0.0)
    return p * dec - st * mi / (np.sqrt(vi) * inv_bc + ep), mi, vi


@njit(cache=True, nogil=True, error_model="numpy")
def sgd_kernel(p, g, gscale, l2, decay, lr):
    """p = p * decay - lr * (g * gscale + l2 * p)."""
    gs, l2f, dec, lrf = sgd_constants(gscale, l2, decay, lr)
    for i in range(p.shape[0]):
        p[i] = sgd_element(p[i], g[i], gs, l2f, dec, lrf)


@njit(cache=True, nogil=True, error_model="numpy")
def momentum_kernel(p, g, buf, gscale, l2, decay, lr, mu):
    """buf = mu * buf + (g * gscale + l2 * p) (flushed to 0 below FLT_MIN);  p = p * decay - lr * buf."""
    gs, l2f, dec, lrf, muf = momentum_constants(gscale, l2, decay, lr, mu)
    for i in range(p.shape[0]):
        p[i], buf[i] = momentum_element(p[i], g[i], buf[i], gs, l2f, dec, lrf, muf)


@njit(cache=True, nogil=True, error_model="numpy")
def adam_kernel(p, g, m, v, gscale, l2, decay, b1, b2, step_size, bc2_sqrt, eps):
    """Adam with bias correction and m, v flushed to 0 below FLT_MIN (see module doc); decay = 1 - lr wd
    (decoupled) or l2 = wd.
    sqrt(v) / sqrt(1 - b2^t) is computed as a multiply by the inverse (saves a division,
    within 1 ulp of torch's division)."""
    gs, l2f, dec, c1, b2f, c2, st, inv_bc, ep = adam_constants(gscale, l2, decay, b1, b2, step_size, bc2_sqrt, eps)
    for i in range(p.shape[0]):
        p[i], m[i], v[i] = adam_element(p[i], g[i], m[i], v[i], gs, l2f, dec, c1, b2f, c2, st, inv_bc, ep)


@njit(cache=True, nogil=True, error_model="numpy")
def fused_row(code, consts, t, lr, out):
    """out float64 (8,) = the scalars :func:`qatlab.kernels.fused.train_step` takes for step t
    (1-based) at learning rate lr: max_grad_norm, l2, decay, then the update kernel's own
    (SGD: lr; momentum: lr, mu; Adam: b1, b2, lr / (1 - b1^t), sqrt(1 - b2^t), eps), zero-padded.
    code: 0 SGD, 1 momentum, 2 Adam; consts: (max_grad_norm, weight_decay, decoupled (1.0 or 0.0),
    mu, b1, b2, eps) (:meth:`qatlab.optim.Optimizer.fused_constants`). Decoupled weight decay makes
    decay = 1 - lr * weight_decay and l2 = 0, else decay = 1 and l2 = weight_decay."""
    max_grad_norm, wd, decoupled, mu, b1, b2, eps = consts
    out[:] = 0.0
    out[0] = max_grad_norm
    if decoupled != 0.0:
        out[2] = 1.0 - lr * wd
    else:
        out[1], out[2] = wd, 1.0
    if code == 2:
        tf = np.float64(t)     # a float power: libm's pow, as Python's b ** t
        out[3], out[4], out[5], out[6], out[7] = b1, b2, lr / (1.0 - b1 ** tf), math.sqrt(1.0 - b2 ** tf), eps
    else:
        out[3] = lr
        if code == 1:
            out[4] = mu


@njit(cache=True, nogil=True, error_model="numpy")
def fused_rows(code, consts, t, lrs, out):
    """out[j] = :func:`fused_row` (code, consts, t + j, lrs[j]) for each row j; lrs float64 (steps,),
    out float64 (steps, 8)."""
    for j in range(lrs.shape[0]):
        fused_row(code, consts, t + j, lrs[j], out[j])


@njit(cache=True, nogil=True, error_model="numpy")
def sgd_ternary_ste(p, g, ste, alpha, clip, touched, lr):
    """SGD on ternary latents p from g = dL/dQ(p), the gradient made element by element: g' = the
    ternary STE of g at the layer's alpha with the latent clip (:func:`~qatlab.kernels.fakequant.ternary_ste_clipped`),
    touched[i] |= g' != 0, then p = :func:`sgd_element` (p, g') at lr (no l2, no decay).

    p, g float32 (n,); touched uint8 (n,); ste code 0..3; alpha, clip, lr rounded to float32. One
    pass instead of three (STE, clip, update); one loop per STE kind (a constant in each), so each vectorises.
    """
    inv = np.float32(1.0) / np.float32(alpha)
    c = sgd_constants(1.0, 0.0, 1.0, lr)
    clip32 = np.float32(clip)
    if ste == 0:
        _sgd_ternary_ste_loop(p, g, 0, inv, clip32, touched, c)
    elif ste == 1:
        _sgd_ternary_ste_loop(p, g, 1, inv, clip32, touched, c)
    elif ste == 2:
        _sgd_ternary_ste_loop(p, g, 2, inv, clip32, touched, c)
    else:
        _sgd_ternary_ste_loop(p, g, 3, inv, clip32, touched, c)


@njit(cache=True, nogil=True, error_model="numpy", inline="always")
def _sgd_ternary_ste_loop(p, g, ste, inv, clip, touched, c):
    """:func:`sgd_ternary_ste`'s loop at inv = 1 / alpha, c = its :func:`sgd_constants`."""
    gs, l2f, dec, lrf = c
    for i in range(p.shape[0]):
        gi = ternary_ste_clipped(ste, g[i], p[i], inv, clip)
        touched[i] |= gi != np.float32(0.0)
        p[i] = sgd_element(p[i], gi, gs, l2f, dec, lrf)
