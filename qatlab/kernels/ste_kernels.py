r"""SteTrainer's step and epoch (:class:`qatlab.train.ste_trainer.SteTrainer`), made of the main kernels.

The network is an :class:`~qatlab.nn.Mlp` ``[I, H, O]``: relu, no biases, both layers absmean
ternary; its buffers arrive as the fused kernels' :class:`~qatlab.kernels.state.Net` and
:class:`~qatlab.kernels.state.Activations`. A step is what :func:`qatlab.kernels.fused.train_step`
does at stage BACKWARD for such a net with its STE codes at 0 (:func:`~qatlab.kernels.fakequant.ternary_forward`,
``np.dot``, :func:`~qatlab.kernels.dense.bias_act_inplace`, :func:`~qatlab.kernels.dense.mse`,
:func:`~qatlab.kernels.dense.act_backward_inplace`: the same kernels in the same order, so the same
numbers), then per layer :func:`~qatlab.kernels.optim_kernels.sgd_ternary_ste`: the ternary STE with
the latent clip, the record of which latents got a gradient, and plain SGD, in one pass.

Why these few lines are not a call of the main fused step and run: its loop over the layers' tuples
is a sizeable share of a step at small sizes (the tests' 6-9-4, batch 4), written out here for two;
its runs (:func:`~qatlab.kernels.fused.train_steps`) update through an optimizer's state and take
batches of one size, where SteTrainer's update needs the clip and the touched record and its epochs
end on a short batch. A step whose loss is not finite returns before the update, so the latents
keep their last finite values.
"""
from __future__ import annotations

import numpy as np
from numba import njit

from .dense import act_backward_inplace, bias_act_inplace, mse
from .fakequant import all_finite, ternary_forward
from .optim_kernels import sgd_ternary_ste
from .state import Activations, Net


@njit(cache=True, nogil=True, error_model="numpy")
def train_step(x, t, net, acts, ste, lr, clip, touched):
    """One SGD step on the batch x (B, I), t (B, O); returns its MSE loss (float64), or -1.0
    without doing anything when x or t holds a NaN or inf.

    net: the :class:`~qatlab.kernels.state.Net` tuple of the 2-layer Mlp (stes all 0), acts its
    :class:`~qatlab.kernels.state.Activations` tuple at B rows; ste code 0..3, lr and clip float32;
    touched uint8 (num_params,), laid out like net.p: set to 1 where a latent's gradient was non-zero.
    """
    if not (all_finite(x.reshape(x.size)) and all_finite(t.reshape(t.size))):
        return -1.0
    return _step(x, t, net, acts, ste, lr, clip, touched)


@njit(cache=True, nogil=True, error_model="numpy")
def _step(x, t, net, acts, ste, lr, clip, touched):
    """:func:`train_step` without the input check: fused.train_step's kernels, in its order, for 2 layers."""
    n, a = Net(*net), Activations(*acts)
    w1, w2, q1, q2 = n.ws[0], n.ws[1], n.wqs[0], n.wqs[1]
    h, y, dh, dy = a.hs[0], a.hs[1], a.ds[0], a.ds[1]
    a1 = ternary_forward(w1.reshape(w1.size), q1.reshape(q1.size))
    a2 = ternary_forward(w2.reshape(w2.size), q2.reshape(q2.size))
    if not (np.isfinite(a1) and np.isfinite(a2)):    # a latent left float32: the loss says so
        return np.nan
    n.alphas[0], n.alphas[1] = a1, a2
    np.dot(x, q1.T, h)
    bias_act_inplace(h, n.bs[0], n.act)               # the biases are 0; the output layer is linear
    np.dot(h, q2.T, y)
    loss = mse(y, t, dy)
    if not np.isfinite(loss):
        return loss
    np.dot(dy.T, h, n.dws[1])
    np.dot(dy, q2, dh)
    act_backward_inplace(dh, h, n.act, n.dbs[0])
    np.dot(dh.T, x, n.dws[0])
    k1 = w1.size                                      # no biases: p and g are W1 then W2, flat
    k2 = k1 + w2.size
    sgd_ternary_ste(n.p[:k1], n.g[:k1], ste, a1, clip, touched[:k1], lr)
    sgd_ternary_ste(n.p[k1:k2], n.g[k1:k2], ste, a2, clip, touched[k1:k2], lr)
    return loss


@njit(cache=True, nogil=True, error_model="numpy")
def train_epoch(X, T, perm, batch_size, net, acts, last_acts, xb, tb, ste, lr, clip, touched):
    """One epoch of :func:`train_step` over rows ``perm`` (int64 (n,)) of X (n, I), T (n, O).

    Batches of ``batch_size`` rows are gathered into xb, tb (>= batch_size rows); acts are the
    Activations at batch_size rows, last_acts at n % batch_size rows (the short last batch; acts
    when there is none). Returns (sample-weighted mean loss, steps run); a non-finite step loss
    stops the epoch and is returned as the loss. X and T must be finite (not checked here).
    """
    n = perm.shape[0]
    total = 0.0
    steps = 0
    for start in range(0, n, batch_size):
        m = min(batch_size, n - start)
        for r in range(m):            # element loops: no array views made per row
            src = perm[start + r]
            for j in range(X.shape[1]):
                xb[r, j] = X[src, j]
            for j in range(T.shape[1]):
                tb[r, j] = T[src, j]
        loss = _step(xb[:m], tb[:m], net, acts if m == batch_size else last_acts, ste, lr, clip, touched)
        steps += 1
        if not np.isfinite(loss):
            return loss, steps
        total += loss * m
    return total / n, steps
