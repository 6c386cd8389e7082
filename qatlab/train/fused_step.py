"""FusedStep: a training step of a small :class:`~qatlab.nn.Mlp` as one Numba call.

``step = FusedStep.build(mlp, scratch, grads, opt)`` returns None when the model is outside what
:func:`qatlab.kernels.fused.train_step` covers (see :func:`unsupported_reason`); otherwise
``step(x, labels=...)`` (or ``targets=`` for MSE) does what this does from Python::

    y = mlp.forward(x, scratch)
    loss = cross_entropy_loss(y, labels, grads.d_output_mut())   # or mse_loss(y, targets, ...)
    mlp.backward(x, scratch, grads, need_input_grad=False)
    opt.step(grads.flat())

and leaves the objects as that would (scratch, gradients, the quantizers' alphas, the optimizer's
step count), so metrics, snapshots and a later Python step carry on from it. ``stage`` stops
earlier: FORWARD (loss only; dL/dy is still written), BACKWARD (+ gradients, no update).

Why: at 64-256-10, batch 64, a step is ~20 kernel calls of a few microseconds each; the Python
around them (dispatch, argument checks, views) was a quarter of the step.

``step.steps(X, idx, count, labels=...)`` makes ``count`` such steps in one call, gathering each
batch from the training split itself (what ``run_experiment`` does between metrics rows), with
the numbers of ``count`` single calls.
"""
from __future__ import annotations

import math

import numpy as np

from ..runtime import parallel
from ..kernels.fused import (BACKWARD, FORWARD, LAYER_SUMS, R_FORWARDS, R_LR, R_MADE, R_OPT_NORM, R_UPDATES, UPDATE,
                            batch_rows_error, predict_block, train_step, train_steps)
from ..kernels.state import Activations, Batches, BlockOut, Net, Opt, RunOut, Schedule, Stash
from ..nn import as_f32_2d, as_labels
from ..quant import TernaryQuantizer

__all__ = ["FusedStep", "unsupported_reason", "FORWARD", "BACKWARD", "UPDATE"]

_NO_LABELS = np.zeros(0, np.int64)
_NO_STATE = np.zeros(0, np.float32)
_NO_SCALARS = np.zeros(8)
_NO_OPT = tuple(Opt(0, _NO_STATE, _NO_STATE))     # FORWARD / BACKWARD stages make no update
_STAGES = (FORWARD, BACKWARD, UPDATE)


def unsupported_reason(mlp, scratch, opt=None) -> str | None:
    """Why ``FusedStep`` cannot run this model (None if it can): weight quantizers other than
    None or :class:`TernaryQuantizer`, activation quantizers, an optimizer over anything but
    ``mlp.flat_params()``, or work big enough to be split across cores (:mod:`qatlab.runtime.parallel`)."""
    if any(q is not None and type(q) is not TernaryQuantizer for q in mlp.weight_quantizers):
        return "weight quantizers other than ternary"
    if any(q is not None for q in mlp.activation_quantizers):
        return "activation quantizers"
    if mlp.num_params >= parallel.MIN_ELEMENTS:
        return "parameters split across cores"
    if any(scratch.batch_size * n_in * n_out >= parallel.MIN_MACS for n_in, n_out in zip(mlp.sizes, mlp.sizes[1:])):
        return "matrix products split across cores"
    if opt is not None and not opt.is_over(mlp.flat_params()):
        return "optimizer not over mlp.flat_params()"
    return None


class FusedStep:
    """One training step of ``mlp`` in one call; see the module doc. Build with :meth:`build`."""

    @classmethod
    def build(cls, mlp, scratch, grads, opt=None) -> "FusedStep | None":
        """The fused step, or None when :func:`unsupported_reason` gives a reason."""
        return None if unsupported_reason(mlp, scratch, opt) else cls(mlp, scratch, grads, opt)

    def __init__(self, mlp, scratch, grads, opt=None):
        reason = unsupported_reason(mlp, scratch, opt)
        if reason:
            raise ValueError(f"mlp: FusedStep does not cover this model ({reason})")
        self.mlp, self.scratch, self.grads, self.opt = mlp, scratch, grads, opt
        L = mlp.num_layers
        self._quantizers = mlp.weight_quantizers
        self._ternary = np.array([q is not None for q in self._quantizers], np.int64)
        self._alphas = np.zeros(L, np.float32)
        self._ws = tuple(mlp.weights(i) for i in range(L))
        layers = mlp.kernel_layers(scratch, grads)
        self._wqs = layers.wqs
        self._no_targets = np.zeros((0, mlp.sizes[-1]), np.float32)
        self._rows = {}
        self._ternary_layers = [(i, q) for i, q in enumerate(self._quantizers) if q is not None]
        self._stes = np.zeros(L, np.int64)
        self._w_used = list(self._wqs)
        self._params, self._grads = mlp.flat_params(), grads.flat()
        # the kernels' named structures, as the plain tuples they take (qatlab.kernels.state)
        self._net = tuple(Net(layers.act, self._ternary, self._stes, self._alphas, self._ws, layers.bs, layers.wqs,
                              layers.dws, layers.dbs, self._params, self._grads))
        self._opt = tuple(Opt(*opt.fused_kernel())) if opt is not None else None
        self.stash_sumsq = math.nan
        self._batch_bufs = {}
        self._block = (np.zeros((0, 8)), np.zeros(0), np.zeros(0, np.int64), np.zeros(0), np.zeros(0))
        self._predict = (np.zeros((0, 8)), np.zeros(0), np.zeros(0))
        self.row_sums = np.zeros((0, LAYER_SUMS * L))   # predict_block's metrics-row sums
        self.losses, self.correct, self.stash_sumsqs = self._block[1], self._block[2], self._block[4]   # last steps()

    def _batch_rows(self, B) -> Activations:
        """The batch-B activations (made once per B; pass ``tuple()`` of them to a kernel), with the
        quantizers' STE codes brought up to date (a quantizer's STE may have changed since the last step)."""
        stes = self._stes
        for i, q in self._ternary_layers:
            stes[i] = q.ste_code
        rows = self._rows.get(B)
        if rows is None:
            rows = self._rows[B] = Activations(*self.mlp.kernel_rows(self.scratch, self.grads, B))
        return rows

    def steps(self, X, idx, count: int, labels=None, targets=None, onehot: bool = False, stash=None,
              clip: float = 0.0, accumulate=None, accumulate_fresh: bool = False) -> int:
        """``count`` UPDATE steps in one call, as ``count`` calls of ``self(x_j, ..., stash=stash,
        clip=clip)`` at the optimizer's scheduled learning rates, where batch j is
        ``X[idx[j*B:(j+1)*B]]``.

        X (n, in) float32 C-contiguous (a training split); idx int64 (count * B,) row numbers,
        B <= scratch.batch_size; labels int64 (n,) of X's rows (those of the rows in idx in
        [0, K)): softmax cross-entropy, or MSE against their one-hot rows with ``onehot``; or
        targets float32 (n, K) (MSE). accumulate
        (float32 (n,), with a stash): each step's stashed gradient is added to it (with
        ``accumulate_fresh`` the first one is copied into it); the stash holds the last one.
        Afterwards :attr:`losses` float64, :attr:`correct` int64 (rows whose argmax is the label;
        0 without labels) and :attr:`stash_sumsqs` float64 hold one entry per step made, and the
        objects are left as after the last one. Returns the steps made: ``count``, or fewer when
        a loss or a stashed gradient is not finite (that step, the last one made, updated nothing).
        """
        opt = self.opt
        X, labels, targets, onehot, B = self._run_inputs("steps", X, idx, count, labels, targets, onehot)
        stash, acc = self._check_stash(stash), self._check_stash(accumulate, "accumulate")
        if acc is not _NO_STATE and stash is _NO_STATE:
            raise ValueError("accumulate: needs a stash")
        clip = self._check_clip(clip)
        xb, lab, tgt = self._batch_buffers(B)
        scs, losses, correct, norms, sumsqs = (b[:count] for b in self._block_buffers(count))
        lrs = opt.fused_run_scalars(scs)
        acts = self._batch_rows(B)
        batches = Batches(X, labels, targets, idx, onehot, xb, lab, tgt)
        stashed, out = Stash(stash, clip, acc, bool(accumulate_fresh)), RunOut(losses, correct, norms, sumsqs)
        done = train_steps(tuple(batches), self._net, tuple(acts), self._opt, scs, tuple(stashed), tuple(out))
        self._after(xb, acts.hs)
        last_ok = math.isfinite(losses[done - 1]) and (stash is _NO_STATE or math.isfinite(sumsqs[done - 1]))
        updated = done if last_ok else done - 1
        if updated:
            opt.fused_done(lrs[updated - 1], norms[updated - 1], updated)
        self.losses, self.correct, self.stash_sumsqs = losses[:done], correct[:done], sumsqs[:done]
        return done

    def _run_inputs(self, what, X, idx, count, labels, targets, onehot):
        """Checked inputs of a run of ``count`` steps on batches ``X[idx[j*B:(j+1)*B]]`` (steps()'s
        doc), checked before any step is made: (X, labels, targets, onehot, B)."""
        n_in, n_out = self.mlp.sizes[0], self.mlp.sizes[-1]
        if self.opt is None:
            raise ValueError(f"{what}: needs the optimizer given to FusedStep")
        if not (X.__class__ is np.ndarray and X.dtype == np.float32 and X.ndim == 2 and X.shape[1] == n_in
                and X.flags.c_contiguous):
            raise ValueError(f"X: expected a C-contiguous float32 array of shape (n, {n_in})")
        if isinstance(count, bool) or not isinstance(count, int) or count < 1:
            raise ValueError(f"count: expected an int >= 1, got {count!r}")
        if not (idx.__class__ is np.ndarray and idx.dtype == np.int64 and idx.ndim == 1 and len(idx) % count == 0
                and 1 <= len(idx) // count <= self.scratch.batch_size):
            raise ValueError(f"idx: expected int64 (count * B,) with 1 <= B <= {self.scratch.batch_size}")
        if (labels is None) == (targets is None):
            raise ValueError("labels, targets: give exactly one (labels for cross-entropy, targets for MSE)")
        if labels is not None:
            if not (labels.__class__ is np.ndarray and labels.dtype == np.int64 and labels.shape == (len(X),)):
                raise ValueError(f"labels: expected int64 of shape ({len(X)},)")
            targets = self._no_targets
        else:
            if not (targets.__class__ is np.ndarray and targets.dtype == np.float32
                    and targets.shape == (len(X), n_out) and targets.flags.c_contiguous):
                raise ValueError(f"targets: expected C-contiguous float32 of shape ({len(X)}, {n_out})")
            labels, onehot = _NO_LABELS, True
        bad = batch_rows_error(idx, len(X), labels, n_out)
        if bad == 1:
            raise ValueError(f"idx: row numbers must lie in [0, {len(X)})")
        if bad == 2:
            raise ValueError(f"labels: every label of a row in idx must be in [0, {n_out})")
        return X, labels, targets, bool(onehot), len(idx) // count

    def predict_block(self, X, idx, batch_size: int, run, labels=None, targets=None, onehot: bool = False) -> int:
        """The steps of a :class:`qatlab.train.phase.PredictBlock` ``run`` in one call
        (:func:`qatlab.kernels.fused.predict_block`, whose doc says what each step does): PREDICT
        steps, each prediction written into the gradient buffer (``grads.flat()``) and its update
        made through this step's optimizer at ``run``'s gain times the scheduled learning rate (no
        update at gain 0), and CORRECT steps (UPDATE steps with the staging buffer as the stash,
        clipped, then folded into the predictor); the steps in ``run.plan.rows`` log a metrics row, a
        PREDICT one after measuring its loss (a forward pass): the kernel writes ``run.row_out`` and
        this step's :attr:`row_sums` (float64 (rows, LAYER_SUMS * layers): each layer's
        :func:`~qatlab.kernels.fused.layer_sums` after that step).

        Step j's batch is ``X[idx[j*B:(j+1)*B]]``, B = ``batch_size`` (idx int64; labels / targets /
        onehot as in :meth:`steps`); only the batches of CORRECT steps and the measured one are
        read, and idx may end before the batches of the steps after the last one read (an epoch's
        last rows). The optimizer and the Python objects are left as after those steps.

        Fills ``run.predictor.state``, ``run.result`` and ``run.corrections`` (see the kernel) and returns the
        steps made: all, or the ones before a step whose loss or real gradient is not finite.
        """
        opt = self.opt
        if not (isinstance(batch_size, int) and 1 <= batch_size <= self.scratch.batch_size):
            raise ValueError(f"batch_size: expected an int in [1, {self.scratch.batch_size}], got {batch_size!r}")
        if not (idx.__class__ is np.ndarray and len(idx) % batch_size == 0 and len(idx) // batch_size > run.last_read):
            raise ValueError(f"idx: expected int64 rows of at least {run.last_read + 1} batches of {batch_size}")
        X, labels, targets, onehot, B = self._run_inputs("predict_block", X, idx, len(idx) // batch_size, labels,
                                                         targets, onehot)
        count = run.count
        scs, ks, cs = self._predict_buffers(count)
        lrs = opt.schedule.rates(opt.t, count)
        xb, lab, tgt = self._batch_buffers(B)
        acts = self._batch_rows(B)
        result, n_rows = run.result, len(run.plan.rows)
        if len(self.row_sums) < n_rows:
            self.row_sums = np.zeros((n_rows, LAYER_SUMS * self.mlp.num_layers))
        batches = Batches(X, labels, targets, idx, onehot, xb, lab, tgt)
        predict_block(tuple(run.predictor), tuple(run.plan), tuple(batches), self._net, tuple(acts), self._opt,
                      tuple(Schedule(opt.fused_constants(), opt.t, lrs, scs, ks, cs)),
                      tuple(BlockOut(result, run.corrections, run.row_out, self.row_sums)))
        if result[R_FORWARDS]:
            self._after(xb, acts.hs)
        if result[R_UPDATES]:
            opt.fused_done(result[R_LR], result[R_OPT_NORM], int(result[R_UPDATES]))
        return int(result[R_MADE])

    def _predict_buffers(self, count):
        """predict_block's scratch of at least ``count`` steps: (scalars (count, 8), ks, cs)."""
        if len(self._predict[1]) < count:
            self._predict = (np.zeros((count, 8)), np.zeros(count), np.zeros(count))
        return self._predict

    def _check_stash(self, stash, name="stash"):
        if stash is None:
            return _NO_STATE
        if not (stash.__class__ is np.ndarray and stash.dtype == np.float32 and stash.shape == self._grads.shape
                and stash.flags.c_contiguous):
            raise ValueError(f"{name}: expected a C-contiguous float32 array of shape {self._grads.shape}")
        return stash

    @staticmethod
    def _check_clip(clip):
        if clip != 0.0 and not 0.0 < clip < math.inf:
            raise ValueError(f"clip: expected 0 (off) or a finite number > 0, got {clip!r}")
        return float(clip)

    def _batch_buffers(self, B):
        bufs = self._batch_bufs.get(B)
        if bufs is None:
            bufs = self._batch_bufs[B] = (np.zeros((B, self.mlp.sizes[0]), np.float32), np.zeros(B, np.int64),
                                          np.zeros((B, self.mlp.sizes[-1]), np.float32))
        return bufs

    def _block_buffers(self, count):
        """Buffers of a run of at least ``count`` steps: (scalars, losses, correct, norms, sumsqs)."""
        if len(self._block[1]) < count:
            self._block = (np.zeros((count, 8)), np.zeros(count), np.zeros(count, np.int64), np.zeros(count),
                           np.zeros(count))
        return self._block

    def _after(self, x, hs) -> None:
        """Leave the Python objects as a step on x would (alphas, scratch, gradients)."""
        alphas = self._alphas.tolist()
        for i, q in self._ternary_layers:
            q.alpha = alphas[i]
        self.mlp.after_kernel_forward(self.scratch, self.grads, x, hs, self._w_used)

    def __call__(self, x, labels=None, targets=None, stage=UPDATE, lr=None, stash=None, clip=0.0) -> float:
        """Step on x (B, in) float32 C-contiguous, B <= scratch.batch_size, with int64 ``labels``
        (B,) (softmax cross-entropy) or float32 ``targets`` (B, K) (MSE). lr: this step's learning
        rate (default: the optimizer's schedule). Returns the loss; a non-finite loss returns at
        once with nothing updated (as the Python step would not update).

        stash (float32 (n,), stage UPDATE): receives a copy of the gradient before the update,
        whose float64 sum of squares is then :attr:`stash_sumsq` (no update if it is not finite);
        clip > 0 first scales the update's gradient to global norm <= clip, as PhaseTrainer does
        (factor clip / (norm + 1e-6)). This is phase training's backward step in one call.
        """
        mlp, scratch, opt = self.mlp, self.scratch, self.opt
        x = mlp.checked_input(x, scratch)
        B = x.shape[0]
        if (labels is None) == (targets is None):
            raise ValueError("labels, targets: give exactly one (labels for cross-entropy, targets for MSE)")
        if labels is not None:
            if not (labels.__class__ is np.ndarray and labels.dtype == np.int64 and labels.shape == (B,)):
                labels = as_labels(labels, B).astype(np.int64)
            targets = self._no_targets
        else:
            targets = as_f32_2d("targets", targets)
            if targets.shape != (B, mlp.sizes[-1]):
                raise ValueError(f"targets: expected shape {(B, mlp.sizes[-1])}, got {targets.shape}")
            labels = _NO_LABELS
        if stage not in _STAGES:
            raise ValueError(f"stage: expected FORWARD (0), BACKWARD (1) or UPDATE (2), got {stage!r}")
        clip = self._check_clip(clip)
        acts = self._batch_rows(B)
        if stage == UPDATE:
            if opt is None:
                raise ValueError("stage: UPDATE needs the optimizer given to FusedStep")
            lr = opt.lr if lr is None else lr
            kernel_opt, sc = self._opt, opt.fused_scalars(lr)
        else:
            kernel_opt, sc = _NO_OPT, _NO_SCALARS
        stash = self._check_stash(stash)
        loss, norm, self.stash_sumsq = train_step(x, labels, targets, stage, self._net, tuple(acts), kernel_opt, sc,
                                                  stash, clip)
        self._after(x, acts.hs)
        if stage == UPDATE and math.isfinite(loss) and (stash is _NO_STATE or math.isfinite(self.stash_sumsq)):
            opt.fused_done(lr, norm)
        return loss
