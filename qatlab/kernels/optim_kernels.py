"""Numba kernels of the optimizers (see :mod:`qatlab.optim` for the update rules and the
flush to zero); p, g and the state are float32 (n,), updated in place."""
from __future__ import annotations

import numpy as np
from numba import njit

FLT_MIN = np.float32(np.finfo(np.float32).tiny)   # smallest normal float32: state below it is flushed to 0


# -- kernels: p, g, state float32 (n,); scalars arrive as Python floats (fast to dispatch) and
# are rounded to float32 once, so the loop runs in float32 like torch's CPU kernels.
@njit(cache=True, nogil=True, error_model="numpy")
def _sgd_kernel(p, g, gscale, l2, decay, lr):
    """p = p * decay - lr * (g * gscale + l2 * p)."""
    gs, l2f, dec, lrf = np.float32(gscale), np.float32(l2), np.float32(decay), np.float32(lr)
    for i in range(p.shape[0]):
        gi = g[i] * gs + l2f * p[i]
        p[i] = p[i] * dec - lrf * gi


@njit(cache=True, nogil=True, error_model="numpy")
def _momentum_kernel(p, g, buf, gscale, l2, decay, lr, mu):
    """buf = mu * buf + (g * gscale + l2 * p) (flushed to 0 below FLT_MIN);  p = p * decay - lr * buf."""
    gs, l2f, dec, lrf, muf = np.float32(gscale), np.float32(l2), np.float32(decay), np.float32(lr), np.float32(mu)
    for i in range(p.shape[0]):
        gi = g[i] * gs + l2f * p[i]
        b = muf * buf[i] + gi
        if abs(b) < FLT_MIN:
            b = np.float32(0.0)
        buf[i] = b
        p[i] = p[i] * dec - lrf * b


@njit(cache=True, nogil=True, error_model="numpy")
def _adam_kernel(p, g, m, v, gscale, l2, decay, b1, b2, step_size, bc2_sqrt, eps):
    """Adam with bias correction and m, v flushed to 0 below FLT_MIN (see module doc); decay = 1 - lr wd
    (decoupled) or l2 = wd.
    sqrt(v) / sqrt(1 - b2^t) is computed as a multiply by the inverse (saves a division,
    within 1 ulp of torch's division)."""
    gs, l2f, dec = np.float32(gscale), np.float32(l2), np.float32(decay)
    c1, b2f, c2 = np.float32(1.0 - b1), np.float32(b2), np.float32(1.0 - b2)
    st, inv_bc, ep = np.float32(step_size), np.float32(1.0 / bc2_sqrt), np.float32(eps)
    for i in range(p.shape[0]):
        gi = g[i] * gs + l2f * p[i]
        mi = m[i] + c1 * (gi - m[i])
        vi = b2f * v[i] + c2 * gi * gi
        if abs(mi) < FLT_MIN:
            mi = np.float32(0.0)
        if vi < FLT_MIN:
            vi = np.float32(0.0)
        m[i] = mi
        v[i] = vi
        p[i] = p[i] * dec - st * mi / (np.sqrt(vi) * inv_bc + ep)
