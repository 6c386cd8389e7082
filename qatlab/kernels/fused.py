"""One whole training step of a small dense MLP in one Numba call.

:func:`train_step` chains the same kernels :class:`qatlab.nn.Mlp`, the losses and the optimizers
call one by one from Python (absmean ternary projection, ``np.dot``, bias + activation, the
loss, the activation derivative, the ternary STE, the optimizer update), in the same order on
the same buffers, so a step gives the same numbers either way. What it saves is the Python
between them: about twenty calls and their argument checks per step, a quarter of a 64-256-10
step at batch 64. :class:`qatlab.train.fused_step.FusedStep` decides when it applies and keeps the Python
objects (scratch, gradients, quantizer alphas, optimizer counters) in step with it.

Runs of steps in one call: :func:`train_steps` (UPDATE steps, gathering each batch), and phase
training's :func:`predicted_steps` (predicted gradients and their updates) and
:func:`predict_block` (a predict block's steps: those, its CORRECT steps with their folds into the
predictor, and the metrics rows due among them: a PREDICT row step's loss and each layer's
:func:`layer_sums`).

The model, its activations, the optimizer and a run's batches, outputs and predictor travel as the
named structures of :mod:`qatlab.kernels.state` (passed as plain tuples, named on entry). ``np.dot``
inside ``njit`` binds SciPy's BLAS.
"""
from __future__ import annotations

import math

import numpy as np
from numba import njit

from .dense import (IDENTITY, act_backward_inplace, bias_act_inplace, count_correct, mse, softmax_cross_entropy,
                    sum_squares, two_sign_counts)
from .fakequant import fq_noise_saturation, ternary_backward, ternary_forward
from .optim_kernels import (adam_constants, adam_element, adam_kernel, fused_row, momentum_constants,
                            momentum_element, momentum_kernel, sgd_constants, sgd_element, sgd_kernel)
from .clock import monotonic_ns
from .phase_kernels import (anchor_trend, clamp01, compare_vectors, copy_sum_squares, fold_correction, norms3,
                            prediction, relative_error_cosine)
from .state import Activations, Batches, BlockOut, BlockPlan, Net, Opt, Predictor, RunOut, Schedule, Stash

FORWARD, BACKWARD, UPDATE = 0, 1, 2   # how far a step goes: loss only, + gradients, + optimizer update

# predict_block's outputs, named in one place. result float64 (len(BLOCK_RESULT),): slot i holds
# BLOCK_RESULT[i] (the kernel writes it through the R_* indices); corrections (steps, 6 columns) holds one
# CORRECT step per row, row_out (rows, 5) one metrics row per row, columns as named here.
BLOCK_RESULT = ("made", "clipped", "norm", "loss", "updates", "lr", "opt_norm", "corrections", "right",
                "predict_ns", "correct_ns", "bad_gradient", "forwards")
(R_MADE, R_CLIPPED, R_NORM, R_LOSS, R_UPDATES, R_LR, R_OPT_NORM, R_CORRECTIONS, R_RIGHT, R_PREDICT_NS,
 R_CORRECT_NS, R_BAD_GRADIENT, R_FORWARDS) = range(len(BLOCK_RESULT))
CORRECTION_COLUMNS = ("step", "loss", "sumsq", "relative_error", "cosine", "reset")
ROW_COLUMNS = ("loss", "ns", "gain", "norm", "updates")
# pstate float64 (len(PREDICTOR_STATE),): the predictor's scalars, read and written back by predict_block.
PREDICTOR_STATE = ("anchor_step", "correction_step", "gain", "gain_num", "gain_den", "spacing", "next_correct")


@njit(cache=True, nogil=True, error_model="numpy")
def train_step(x, labels, targets, stage, net, acts, opt, sc, stash, clip):
    """Forward, loss, and (stage >= BACKWARD) backward, (stage == UPDATE) optimizer update.

    x (B, in) float32; labels int64 (B,) for softmax cross-entropy, or targets (B, K) float32 for
    MSE (the other one has 0 rows); net a :class:`~qatlab.kernels.state.Net`, acts its
    :class:`~qatlab.kernels.state.Activations` at batch size B, opt an :class:`~qatlab.kernels.state.Opt`
    (as tuples); sc float64 (8,): the optimizer's ``fused_scalars(lr)``.
    stash: float32 (n,) or (0,): at stage UPDATE the gradient is first copied there and its sum of
    squares s measured (:func:`~qatlab.kernels.phase_kernels.copy_sum_squares`); the update then
    uses it times clip / (sqrt(s) + 1e-6) when clip > 0 and sqrt(s) > clip (no update if s is not
    finite), and the optimizer's own clipping applies on top, as ``Optimizer.step(grad_scale=)``.

    Returns (loss, the optimizer's gradient norm before its clipping (NaN unless that is on), s;
    NaN without a stash). Stops after the forward when an alpha or the loss is not finite (loss
    NaN): nothing else is written then.
    """
    net, acts, opt = Net(*net), Activations(*acts), Opt(*opt)
    ws, wqs, hs, ds, alphas = net.ws, net.wqs, acts.hs, acts.ds, net.alphas
    L = len(ws)
    a = x
    for i in range(L):
        if net.ternary[i]:
            al = ternary_forward(ws[i].reshape(ws[i].size), wqs[i].reshape(wqs[i].size))
            if not np.isfinite(al):
                return math.nan, math.nan, math.nan
            alphas[i] = al
        np.dot(a, wqs[i].T, hs[i])
        bias_act_inplace(hs[i], net.bs[i], IDENTITY if i == L - 1 else net.act)
        a = hs[i]
    if labels.shape[0] > 0:
        loss = softmax_cross_entropy(hs[L - 1], labels, ds[L - 1])
    else:
        loss = mse(hs[L - 1], targets, ds[L - 1])
    if stage == FORWARD or not np.isfinite(loss):
        return loss, math.nan, math.nan
    for i in range(L - 1, -1, -1):
        d = ds[i]
        act_backward_inplace(d, hs[i], IDENTITY if i == L - 1 else net.act, net.dbs[i])
        np.dot(d.T, x if i == 0 else hs[i - 1], net.dws[i])
        if net.ternary[i] and net.stes[i] != 0:
            dw = net.dws[i].reshape(net.dws[i].size)
            ternary_backward(ws[i].reshape(ws[i].size), dw, net.stes[i], alphas[i], dw)
        if i > 0:
            np.dot(d, wqs[i], ds[i - 1])
    if stage == BACKWARD:
        return loss, math.nan, math.nan
    gscale, sumsq = 1.0, math.nan
    if stash.shape[0] > 0:
        sumsq = copy_sum_squares(net.g, stash)
        if not np.isfinite(sumsq):
            return loss, math.nan, sumsq
        if clip > 0 and math.sqrt(sumsq) > clip:
            gscale = clip / (math.sqrt(sumsq) + 1e-6)
    return loss, _update(opt, net.p, net.g, sc, gscale), sumsq


@njit(cache=True, nogil=True, error_model="numpy")
def _update(opt, p, g, sc, gscale):
    """The optimizer step of p (opt an :class:`~qatlab.kernels.state.Opt`) from gscale * g, clipped by its
    own max_grad_norm sc[0] as ``Optimizer.step(grad_scale=gscale)`` does; returns that norm before its
    clipping (NaN if off)."""
    norm = math.nan
    if sc[0] > 0:
        norm = math.sqrt(sum_squares(g)) * gscale
        if norm > sc[0]:
            gscale = gscale * sc[0] / (norm + 1e-6)
    if opt.kind == 0:
        sgd_kernel(p, g, gscale, sc[1], sc[2], sc[3])
    elif opt.kind == 1:
        momentum_kernel(p, g, opt.state0, gscale, sc[1], sc[2], sc[3], sc[4])
    else:
        adam_kernel(p, g, opt.state0, opt.state1, gscale, sc[1], sc[2], sc[3], sc[4], sc[5], sc[6], sc[7])
    return norm


@njit(cache=True, nogil=True, error_model="numpy")
def batch_rows_error(idx, n_rows, labels, n_classes):
    """Why :func:`train_steps` must not run on these batches: 0 none, 1 a row number of idx
    (int64) outside [0, n_rows), 2 a label (labels int64 (n_rows,) or (0,): none) of a row in idx
    outside [0, n_classes). Checks only the rows the steps use, without holding the GIL (the
    numpy reductions it replaces took ~15% of the training threads' GIL time with four runs)."""
    for r in range(idx.shape[0]):
        if idx[r] < 0 or idx[r] >= n_rows:
            return 1
    if labels.shape[0] > 0:
        for r in range(idx.shape[0]):
            if labels[idx[r]] < 0 or labels[idx[r]] >= n_classes:
                return 2
    return 0


@njit(cache=True, nogil=True, error_model="numpy")
def _gather(b, j):
    """Batch j of the :class:`~qatlab.kernels.state.Batches` b into b.xb, b.labels, b.targets; returns the
    (labels, targets) a train_step on it takes (one of them with 0 rows)."""
    B = b.xb.shape[0]
    has_labels = b.Y.shape[0] > 0
    for r in range(B):
        row = b.idx[j * B + r]
        b.xb[r, :] = b.X[row, :]
        if has_labels:
            b.labels[r] = b.Y[row]
            if b.mse_loss:
                b.targets[r, :] = 0.0
                b.targets[r, b.Y[row]] = 1.0
        else:
            b.targets[r, :] = b.T[row, :]
    return (b.labels[:0], b.targets) if b.mse_loss else (b.labels, b.targets[:0])


@njit(cache=True, nogil=True, error_model="numpy")
def train_steps(batches, net, acts, opt, scs, stash, out):
    """``len(scs)`` UPDATE steps of :func:`train_step` in a row, each on its own batch gathered here.

    batches a :class:`~qatlab.kernels.state.Batches` (MSE targets: T's rows, or the one-hot rows of
    its labels as :class:`qatlab.train.loss.BatchLoss` makes them); net, acts, opt as in train_step;
    scs float64 (steps, 8): each step's optimizer scalars (``Optimizer.fused_scalars``). stash a
    :class:`~qatlab.kernels.state.Stash`: stash and clip as in train_step, every step; each stashed
    gradient added to acc (float32 adds). Step j writes the :class:`~qatlab.kernels.state.RunOut`
    out's losses[j], norms[j], sumsqs[j] (train_step's) and correct[j] (rows whose argmax is the
    label; 0 without labels).

    Returns the steps made: all, or j + 1 when step j's loss (or an alpha) or its stashed
    gradient is not finite -- that step updated nothing (acc included), as in train_step, and the
    later ones did not run.
    """
    b, s, out = Batches(*batches), Stash(*stash), RunOut(*out)
    has_labels = b.Y.shape[0] > 0
    hs = Activations(*acts).hs
    for j in range(scs.shape[0]):
        step_labels, step_targets = _gather(b, j)
        loss, norm, sumsq = train_step(b.xb, step_labels, step_targets, UPDATE, net, acts, opt, scs[j], s.stash,
                                       s.clip)
        out.losses[j], out.norms[j], out.sumsqs[j] = loss, norm, sumsq
        if not np.isfinite(loss) or (s.stash.shape[0] > 0 and not np.isfinite(sumsq)):
            return j + 1
        if s.acc.shape[0] > 0:
            if s.acc_fresh and j == 0:
                for i in range(s.acc.shape[0]):
                    s.acc[i] = s.stash[i]
            else:
                for i in range(s.acc.shape[0]):
                    s.acc[i] += s.stash[i]
        out.correct[j] = count_correct(hs[len(hs) - 1], b.labels) if has_labels else 0
    return scs.shape[0]


@njit(cache=True, nogil=True, error_model="numpy")
def _predicted_update(opt, p, sc, gscale, anchor, trend, k, corr, corr_scale, out):
    """:func:`_update` from gscale * g with g = anchor_trend(anchor, trend, k, corr, corr_scale)
    made element by element in the same loop (also written to out), without the optimizer's own
    clipping (sc[0] must be 0): one pass over the arrays instead of three (prediction, its sum of
    squares, update), with the numbers of anchor_trend followed by :func:`_update`."""
    kf, sf = np.float32(k), np.float32(corr_scale)
    state0, state1 = opt.state0, opt.state1
    if opt.kind == 0:
        gs, l2f, dec, lrf = sgd_constants(gscale, sc[1], sc[2], sc[3])
        for i in range(p.shape[0]):
            g = out[i] = prediction(anchor[i], trend[i], kf, corr[i], sf)
            p[i] = sgd_element(p[i], g, gs, l2f, dec, lrf)
    elif opt.kind == 1:
        gs, l2f, dec, lrf, muf = momentum_constants(gscale, sc[1], sc[2], sc[3], sc[4])
        for i in range(p.shape[0]):
            g = out[i] = prediction(anchor[i], trend[i], kf, corr[i], sf)
            p[i], state0[i] = momentum_element(p[i], g, state0[i], gs, l2f, dec, lrf, muf)
    else:
        gs, l2f, dec, c1, b2f, c2, st, inv_bc, ep = adam_constants(gscale, sc[1], sc[2], sc[3], sc[4], sc[5],
                                                                   sc[6], sc[7])
        for i in range(p.shape[0]):
            g = out[i] = prediction(anchor[i], trend[i], kf, corr[i], sf)
            p[i], state0[i], state1[i] = adam_element(p[i], g, state0[i], state1[i], gs, l2f, dec, c1, b2f, c2, st,
                                                      inv_bc, ep)


@njit(cache=True, nogil=True, error_model="numpy")
def predicted_steps(anchor, trend, ks, corr, corr_scales, gain, max_norm, out, opt, p, scs):
    """``len(ks)`` predicted steps of phase training, each ``out = anchor_trend(anchor, trend, ks[j],
    corr, corr_scales[j])`` (the prediction) and an optimizer update from ``gain * out`` clipped
    to global norm ``max_norm`` (0: off) as PhaseTrainer clips, by the optimizer of
    :func:`train_step` (``opt`` an :class:`~qatlab.kernels.state.Opt` tuple, ``scs[j]`` as there); no update
    when gain is 0.

    A step that cannot be clipped -- max_norm 0, or gain * (|anchor| + |k| |trend| + |s| |corr|)
    (triangle inequality, with a 1e-6 margin for rounding) <= max_norm -- and whose optimizer does
    no clipping of its own is made in one pass (:func:`_predicted_update`), the others as
    anchor_trend, its norm, then :func:`_update`: the same numbers either way.

    anchor, trend, corr, out, p float32 (n,); ks, corr_scales float64 (steps,); scs float64
    (steps, 8). Returns (steps whose gradient was clipped, the last step's norm of gain * out,
    the last step's norm as the optimizer's own clipping measured it: NaN unless that is on).
    """
    return _predicted_run(anchor, trend, ks, corr, corr_scales, gain, max_norm, out, Opt(*opt), p, scs,
                          _clip_bounds(anchor, trend, corr, gain, max_norm))


@njit(cache=True, nogil=True, error_model="numpy")
def _clip_bounds(anchor, trend, corr, gain, max_norm):
    """(|anchor|, |trend|, |corr|) for :func:`predicted_steps`' one-pass test; zeros when no step
    can be clipped (gain 0 or max_norm 0) and the norms are not needed."""
    if gain == 0.0 or max_norm <= 0:
        return 0.0, 0.0, 0.0
    return norms3(anchor, trend, corr)


@njit(cache=True, nogil=True, error_model="numpy")
def _predicted_run(anchor, trend, ks, corr, corr_scales, gain, max_norm, out, opt, p, scs, bounds):
    """:func:`predicted_steps` with the clipping bounds given (:func:`_clip_bounds`: computed once
    by a caller that makes its predicted steps in two parts)."""
    clipped = 0
    norm = opt_norm = math.nan
    last = ks.shape[0] - 1
    if gain == 0.0:     # no updates: only the last prediction is left in out
        sumsq = anchor_trend(anchor, trend, ks[last], corr, corr_scales[last], out)
        return clipped, math.sqrt(sumsq * gain * gain), opt_norm
    bound_a, bound_t, bound_c = bounds
    one_pass = False
    for j in range(ks.shape[0]):
        k, s = ks[j], corr_scales[j]
        bound = gain * (bound_a + abs(k) * bound_t + abs(s) * bound_c) * (1.0 + 1e-6)
        one_pass = scs[j, 0] == 0.0 and (max_norm == 0.0 or bound <= max_norm)
        if one_pass:
            _predicted_update(opt, p, scs[j], gain, anchor, trend, k, corr, s, out)
            continue
        sumsq = anchor_trend(anchor, trend, k, corr, s, out)
        norm = math.sqrt(sumsq * gain * gain)
        scale = 1.0
        if max_norm > 0 and norm > max_norm:
            scale = max_norm / (norm + 1e-6)
            clipped += 1
        opt_norm = _update(opt, p, out, scs[j], scale * gain)
    if one_pass:                                 # the last step's norm, measured once
        norm, opt_norm = math.sqrt(sum_squares(out) * gain * gain), math.nan
    return clipped, norm, opt_norm


LAYER_SUMS = 8   # layer_sums' numbers per layer


@njit(cache=True, nogil=True, error_model="numpy")
def layer_sums(w, dw, used, ternary, alpha, out):
    """A metrics row's sums of one layer into out float64 (LAYER_SUMS,): the sum of squares of its
    weight gradient dw, the count of its non-zero entries, the negative and the positive entries of
    the weights it used (``used``), then for a ternary layer (``ternary``) fq_noise_saturation of
    its latent weights w at ``alpha`` (float32: noise, saturated count, signal) and alpha; zeros
    for a float layer. w, dw, used float32 (n,)."""
    g_neg, g_pos, neg, pos = two_sign_counts(dw, used)
    out[0], out[1], out[2], out[3] = sum_squares(dw), g_neg + g_pos, neg, pos
    out[4:] = 0.0
    if ternary:
        out[4], out[5], out[6] = fq_noise_saturation(w, np.float32(1.0) / alpha, alpha, np.float32(0.0),
                                                     np.float32(-1.0), np.float32(1.0))
        out[7] = alpha


@njit(cache=True, nogil=True, error_model="numpy")
def _row_sums(net, out):
    """:func:`layer_sums` of every layer of the :class:`~qatlab.kernels.state.Net` net into out[LAYER_SUMS * i:]."""
    for i in range(len(net.ws)):
        w, dw, wq = net.ws[i], net.dws[i], net.wqs[i]
        layer_sums(w.reshape(w.size), dw.reshape(dw.size), wq.reshape(wq.size), net.ternary[i], net.alphas[i],
                   out[LAYER_SUMS * i:LAYER_SUMS * (i + 1)])


@njit(cache=True, nogil=True, error_model="numpy")
def predict_block(predictor, plan, batches, net, acts, opt, schedule, out):
    """``len(lrs)`` steps of phase training's predict block in one call. Arguments (as tuples):
    :class:`~qatlab.kernels.state.Predictor`, :class:`~qatlab.kernels.state.BlockPlan` (first, pos,
    every, has_trend, decay, weight, threshold, learn_gain, max_norm, clip, rows below),
    :class:`~qatlab.kernels.state.Batches`, net, acts and opt as in :func:`train_step`,
    :class:`~qatlab.kernels.state.Schedule` (consts, t0, lrs, scs, ks, cs) and
    :class:`~qatlab.kernels.state.BlockOut` (result, corrections, row_out, row_sums).

    From step ``first`` at block position ``pos`` (1-based): the step at position ``pstate[6]`` is
    CORRECT, and after a CORRECT step at position j the spacing ``pstate[5]`` grows by 1 up to
    ``every`` and the next CORRECT step is at j + spacing (PhaseTrainer's ramp); the others are
    PREDICT; each one as PhaseTrainer's per-step protocol makes it, timed by kind.

    Predictor: ``anchor`` and ``staging`` float32 (n,) (the anchor g1; the buffer a CORRECT step's
    real gradient goes to -- it then becomes the anchor and the old anchor the next staging
    buffer), ``trend``, ``corr`` (the correction, folded in place), ``pred`` (a CORRECT step's
    prediction), ``scores`` float64 (4,) (its comparison); ``pstate`` (its ``state``, float64
    (:data:`PREDICTOR_STATE`)) in/out: anchor_step, correction_step (-1: none), gain, the gain's running
    sums a.p and p.p, the CORRECT spacing and the block position of the next CORRECT step (the last
    two are read, and written back as the steps made left them). A step s predicts
    ``anchor_trend(anchor, trend, k, corr, c)`` with k = s - anchor_step (0 without a trend:
    ``has_trend``), c = decay^(s - correction_step) (0 with none).

    - PREDICT: :func:`predicted_steps` (gain, max_norm) at ``lrs[u] * gain``.
    - CORRECT: :func:`train_step` UPDATE at ``lrs[u]``, its real gradient into staging, clipped to
      ``clip``; then its prediction and the fold of GradientPredictor.fold: relative error, cosine,
      the gain (``learn_gain``: clamp(sum a.p / sum p.p, 0, 1)), and the correction reset
      (relative error > ``threshold``) or folded (``weight``); then the swap of anchor and staging.
    - ``rows`` int64 (r,), increasing: the steps (run indices) that log a metrics row. A PREDICT one
      first measures its loss (a forward pass on its batch); after the step, row_out[c] (float64
      (r, :data:`ROW_COLUMNS`)) receives its loss, nanoseconds since the call began, the gain, the
      norm of its gradient (gain * prediction, or the real one) and the optimizer updates made
      before it, and row_sums[c] (float64 (r, LAYER_SUMS * layers)) :func:`layer_sums` of each layer
      (its weights, gradient -- the prediction on a PREDICT step -- and used weights).

    u counts the optimizer updates made (none at gain 0): update u is the optimizer's step t0 + u
    + 1 at the learning rate lrs[u] (float64 (steps,): the schedule's at t0 + u) times the gain,
    its scalars from :func:`~qatlab.kernels.optim_kernels.fused_row` (opt, consts) into scs
    (float64 (steps, 8) scratch). ks, cs float64 (steps,) scratch. Batch j (of step j) is as in
    :func:`train_steps`; only the batches of CORRECT steps and measured ones are read. PREDICT steps
    write their prediction to net.g, where a CORRECT step's real gradient goes too.

    result (:data:`BLOCK_RESULT`) receives: steps made, PREDICT steps clipped, the last step's gradient
    norm (gain * prediction, or the real one), the last measured loss (NaN if none), optimizer
    updates made, the last one's learning rate and optimizer norm (NaN unless its clipping is on),
    CORRECT steps made, rows whose argmax is the label over the measured batches, nanoseconds in
    PREDICT and in CORRECT steps (:func:`qatlab.kernels.clock.monotonic_ns`), 1.0 if it stopped at
    a CORRECT step whose loss is finite and gradient not (else 0.0), and the forward passes run
    (the batches read). corrections (steps, :data:`CORRECTION_COLUMNS`): row c = the c-th CORRECT
    step's run index, loss, sum of squares of its gradient, relative error, cosine, 1.0 if the
    correction was reset.

    Stops before a step whose loss (or an alpha) is not finite, and before a CORRECT step whose
    gradient is not finite: neither makes an update, and the steps made are the ones before.
    """
    pr, pl, b, model, o = Predictor(*predictor), BlockPlan(*plan), Batches(*batches), Net(*net), Opt(*opt)
    sch, bo = Schedule(*schedule), BlockOut(*out)
    anchor, staging, trend, corr, pred, scores, pstate = pr
    lrs, scs, ks, cs, result, rows = sch.lrs, sch.scs, sch.ks, sch.cs, bo.result, pl.rows
    t_start = monotonic_ns()
    count = lrs.shape[0]
    anchor_step, corr_step, gain, g_num, g_den = pstate[0], pstate[1], pstate[2], pstate[3], pstate[4]  # in order
    spacing, next_correct = int(pstate[5]), int(pstate[6])
    result[:] = 0.0
    result[R_NORM] = result[R_LOSS] = result[R_LR] = result[R_OPT_NORM] = math.nan
    a_buf, s_buf = anchor, staging
    u = made = n_corr = right = ri = 0
    ns_correct = 0
    has_labels = b.Y.shape[0] > 0
    hs = Activations(*acts).hs
    stopped = False
    while made < count and not stopped:
        j = made
        while j < count and pl.pos + j != next_correct:
            j += 1
        n = j - made                                   # PREDICT steps before step j (CORRECT, or the end)
        if n > 0:
            for q in range(n):
                step = pl.first + made + q
                ks[q] = np.float64(step - anchor_step) if pl.has_trend else 0.0
                cs[q] = pl.decay ** np.float64(step - corr_step) if corr_step >= 0 else 0.0
            n_upd = n if gain != 0.0 else 0
            for q in range(n_upd):
                fused_row(o.kind, sch.consts, sch.t0 + u + q + 1, lrs[u + q] * gain, scs[q])
            bounds = _clip_bounds(a_buf, trend, corr, gain, pl.max_norm)
            q, base = 0, made
            while q < n:
                row = ri < rows.shape[0] and rows[ri] < base + n    # the next row's step is in this stretch
                end = rows[ri] - base if row else n
                if end > q:                                    # the PREDICT steps before it
                    clipped, result[R_NORM], opt_norm = _predicted_run(a_buf, trend, ks[q:end], corr, cs[q:end],
                                                                       gain, pl.max_norm, model.g, o, model.p,
                                                                       scs[q:min(end, n_upd)], bounds)
                    result[R_CLIPPED] += clipped
                    made += end - q
                    if n_upd:
                        u += end - q
                        result[R_LR], result[R_OPT_NORM] = lrs[u - 1] * gain, opt_norm
                if not row:
                    break
                step_labels, step_targets = _gather(b, made)
                loss = train_step(b.xb, step_labels, step_targets, FORWARD, net, acts, opt, scs[0], s_buf, 0.0)[0]
                result[R_LOSS] = loss
                result[R_FORWARDS] += 1
                if not np.isfinite(loss):
                    stopped = True
                    break
                if has_labels:
                    right += count_correct(hs[len(hs) - 1], b.labels)
                clipped, result[R_NORM], opt_norm = _predicted_run(a_buf, trend, ks[end:end + 1], corr,
                                                                   cs[end:end + 1], gain, pl.max_norm, model.g, o,
                                                                   model.p, scs[end:min(end + 1, n_upd)], bounds)
                result[R_CLIPPED] += clipped
                made += 1
                if n_upd:
                    u += 1
                    result[R_LR], result[R_OPT_NORM] = lrs[u - 1] * gain, opt_norm
                _log_row(bo.row_out[ri], bo.row_sums[ri], loss, monotonic_ns() - t_start, gain, result[R_NORM],
                         u - 1 if n_upd else u, model)
                ri += 1
                q = end + 1
        if stopped or j == count:
            break
        t_correct = monotonic_ns()                     # the CORRECT step j
        step = pl.first + j
        fused_row(o.kind, sch.consts, sch.t0 + u + 1, lrs[u], scs[0])
        step_labels, step_targets = _gather(b, j)
        loss, opt_norm, sumsq = train_step(b.xb, step_labels, step_targets, UPDATE, net, acts, opt, scs[0], s_buf,
                                           pl.clip)
        result[R_LOSS] = loss
        result[R_FORWARDS] += 1
        if not (np.isfinite(loss) and np.isfinite(sumsq)):
            result[R_BAD_GRADIENT] = 1.0 if np.isfinite(loss) else 0.0
            break
        u += 1
        result[R_NORM], result[R_LR], result[R_OPT_NORM] = math.sqrt(sumsq), lrs[u - 1], opt_norm
        if has_labels:
            right += count_correct(hs[len(hs) - 1], b.labels)
        k = np.float64(step - anchor_step) if pl.has_trend else 0.0
        c = pl.decay ** np.float64(step - corr_step) if corr_step >= 0 else 0.0
        anchor_trend(a_buf, trend, k, corr, c, pred)
        compare_vectors(s_buf, pred, scores)
        rel, cos = relative_error_cosine(scores)
        if pl.learn_gain:
            g_num += scores[0]
            g_den += scores[2]
            if g_den > 0:
                gain = clamp01(g_num / g_den)
        reset = rel > pl.threshold
        if reset:
            corr[:] = 0.0
            corr_step = -1
        else:
            fold_correction(corr, c, s_buf, pred, pl.weight)
            corr_step = step
        cr = bo.corrections[n_corr]                    # CORRECTION_COLUMNS
        cr[0], cr[1], cr[2], cr[3], cr[4], cr[5] = j, loss, sumsq, rel, cos, 1.0 if reset else 0.0
        n_corr += 1
        a_buf, s_buf = s_buf, a_buf                    # the real gradient is the anchor now
        anchor_step = step
        spacing = min(spacing + 1, pl.every)
        next_correct = pl.pos + j + spacing
        made = j + 1
        if ri < rows.shape[0] and rows[ri] == j:
            _log_row(bo.row_out[ri], bo.row_sums[ri], loss, monotonic_ns() - t_start, gain, result[R_NORM], u - 1,
                     model)
            ri += 1
        ns_correct += monotonic_ns() - t_correct
    pstate[0], pstate[1], pstate[2], pstate[3], pstate[4] = anchor_step, corr_step, gain, g_num, g_den
    pstate[5], pstate[6] = spacing, next_correct
    result[R_MADE], result[R_UPDATES], result[R_CORRECTIONS], result[R_RIGHT] = made, u, n_corr, right
    result[R_PREDICT_NS], result[R_CORRECT_NS] = monotonic_ns() - t_start - ns_correct, ns_correct


@njit(cache=True, nogil=True, error_model="numpy")
def _log_row(out, sums, loss, ns, gain, norm, updates, net):
    """predict_block's row_out and row_sums entries of a metrics row (columns: ROW_COLUMNS)."""
    out[0], out[1], out[2], out[3], out[4] = loss, ns, gain, norm, updates
    _row_sums(net, sums)
