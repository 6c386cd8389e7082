"""Phase training inside the generic loop: one PhaseTrainer drives an Mlp's steps.

On WARMUP / FULL / CORRECT steps the batch is split into ``gradient_accumulation``
micro-batches, each gets a real backward pass and is recorded; the mean (clipped)
is what the optimizer sees. On PREDICT steps the backward pass is skipped and the
predicted gradient is used instead; the forward pass only measures the loss, so it runs
only when the caller needs that loss (a metrics row is due): otherwise the step is the
prediction and the optimizer update alone, and its loss is None. The gradients travel as
the model's one flat gradient buffer (``Gradients.flat()``), so the optimizer call is the
same in both modes.

Runs (a FusedStep covers the model, gradient_accumulation = 1): consecutive WARMUP/FULL steps
go through one :meth:`FusedStep.steps` call (:meth:`PhaseStepper.backward_run`, booked by
:meth:`PhaseTrainer.backward_run`), and the steps of a predict block up to its end (or the
epoch's) through one :meth:`FusedStep.predict_block` call (:meth:`PhaseStepper.block_run`, booked
by :meth:`PhaseTrainer.predict_block_run`): PREDICT steps, CORRECT steps (each folded into the
predictor inside the kernel), and on the steps that log a metrics row a forward pass for a
PREDICT step's loss and the row's numbers, which the loop turns into rows after the call. Each
gives the numbers of one :meth:`PhaseStepper.step` per step (tested bit-identical).
PREDICT steps read no batch, so a block run may end on an epoch's last, partial batch. A PREDICT
step made alone (:meth:`PhaseStepper.step` with a FusedStep) is a one-step
:meth:`PhaseTrainer.predicted_steps` call, its forward pass (if the loss is needed) as its
``measure``.

What a skipped forward changes: the epoch's train loss and the adaptive-phase rule average
the measured steps (every FULL and CORRECT step, and PREDICT steps that log a row); a
quantizer with an observer (``scale_mode="observer"``) sees only the batches that ran forward.
"""
from __future__ import annotations

import math

import numpy as np

from ..config import PhaseConfig
from ..kernels.fused import R_RIGHT, ROW_COLUMNS
from ..metrics import PHASE_COLUMNS
from .fused_step import BACKWARD, FORWARD
from .phase import PhaseTrainer
from .steppers import Parts, RowRecord, Steps

# PhaseTrainer.step_metrics() keys, in the order of their columns (qatlab.metrics.PHASE_COLUMNS).
_COLUMNS = dict(zip(("phase", "backward_passes", "step_speedup", "wallclock_speedup", "prediction_error",
                     "prediction_cosine", "prediction_gain", "full_length", "predict_length"), PHASE_COLUMNS))


class PhaseStepper:
    """Runs one training step of ``mlp`` in phase mode; see the module doc."""

    def __init__(self, cfg: PhaseConfig, parts: Parts, fused=None):
        self.trainer = PhaseTrainer(parts.mlp.param_shapes(), cfg)
        self.k = cfg.gradient_accumulation
        self.parts = parts
        self.mlp, self.scratch, self.grads, self.loss_fn = parts.mlp, parts.scratch, parts.grads, parts.loss_fn
        self.fused = fused   # a FusedStep of mlp and its optimizer (or None); see step()
        self.max_grad_norm = float(cfg.max_grad_norm)
        self._last_correction_step = -1

    def advance(self, order, pos: int, step: int, limit: int) -> Steps:
        """The next steps (:mod:`qatlab.train.steppers`): with a FusedStep, a run of WARMUP/FULL steps
        or a predict block in one call; else one :meth:`step`."""
        p = self.parts
        if limit and (run := self.backward_run_length(limit)):
            t_before = p.opt.t
            self.backward_run(p.X, order[pos: pos + run * p.batch_size], run, **p.fused_targets)
            return p.fused_run(self.fused, t_before)
        if run := self.block_run_length(-(-(len(order) - pos) // p.batch_size)):
            return self._block(order, pos, step, run)
        xb, yb = p.batch(order, pos)
        lr = p.opt.lr
        # a PREDICT step measures its loss only for a row
        return p.one_step(self.step(xb, yb, p.update, need_loss=p.logs_row(step)), lr, yb)

    def _block(self, order, pos: int, step: int, run: int) -> Steps:
        """A :meth:`block_run` of ``run`` steps as :class:`Steps`, with the metrics rows it logged."""
        p, bs = self.parts, self.parts.batch_size
        t_before, left = p.opt.t, len(order) - pos
        rows = [j for j in range(run) if p.logs_row(step + j)]
        losses, correct, n_rows, records = self.block_run(p.X, order[pos: pos + run * bs], run, bs, rows=rows,
                                                          **p.fused_targets)
        logged = [RowRecord(j, loss, seconds, p.opt.schedule(t_before + updates), sums, columns)
                  for j, loss, seconds, updates, sums, columns in records]
        counted = n_rows * sum(v is not None for v in losses)
        return Steps(losses, p.opt.schedule(t_before), n_rows, correct, counted, min(len(losses) * bs, left), logged)

    def diverged_at(self, step: int) -> int:
        """The step a NonFiniteError raised by :meth:`advance` was seen at."""
        return self.trainer.total_step + 1

    def step(self, xb: np.ndarray, yb: np.ndarray, update, need_loss: bool = True) -> float | None:
        """One step on the batch, then ``update(flat_grads, real_gradient, grad_scale, lr_scale)``
        (grad_scale: the factor still to apply to flat_grads; lr_scale: to the learning rate,
        :attr:`PhaseTrainer.lr_scale`; no call for a PREDICT step while the learned gain is 0, see
        :meth:`PhaseTrainer.get_predicted_gradients`); see the module doc. With a FusedStep, a
        PREDICT step is :meth:`PhaseTrainer.predicted_steps` of one step (its forward pass as
        ``measure``), and with gradient_accumulation = 1 too a backward step is one fused call;
        both update through the FusedStep's optimizer (``update`` is not called).

        Returns the batch loss, or None for a PREDICT step when ``need_loss`` is False (no
        forward pass). A non-finite loss returns at once without updating: the run ends as
        diverged (call ``trainer.reset()`` to reuse the trainer).
        """
        if self.fused is not None and self.trainer.predict_run_length():     # a PREDICT step in one call
            measure = (lambda: self._loss(xb, yb, backward=False)) if need_loss else None
            return self.trainer.predicted_steps(1, self.fused.opt, self.mlp.flat_params(), self.grads.flat(),
                                                measure)
        info = self.trainer.begin_step()
        if info.needs_backward and self.fused is not None and self.k == 1:
            return self._fused_backward_step(xb, yb)
        flat = self.grads.flat()
        if info.needs_backward:
            total = 0.0
            parts = ((xb, yb),) if self.k == 1 else zip(np.array_split(xb, self.k), np.array_split(yb, self.k))
            for xm, ym in parts:
                loss = self._loss(xm, ym, backward=True)
                if not math.isfinite(loss):
                    return loss
                self.trainer.record_full_gradients(flat)
                total += loss * len(xm)
            loss = total / len(xb)
            scale = self.trainer.clip_scale     # flat still holds the real gradient (k = 1) ...
            if self.k > 1:                      # ... or the last micro-batch: take the clipped mean
                self.trainer.gradients_for_update(out=flat)
                scale = 1.0
        else:
            loss = self._loss(xb, yb, backward=False) if need_loss else None
            if loss is not None and not math.isfinite(loss):
                return loss
            self.trainer.get_predicted_gradients(out=flat, clip=False)
            scale = self.trainer.clip_scale     # 0 when the gain is 0: no update (PhaseTrainer doc)
        if scale != 0.0:
            update(flat, info.needs_backward, scale, self.trainer.lr_scale)
        self.trainer.end_step(loss)
        return loss

    def backward_run_length(self, limit: int) -> int:
        """How many of the next steps (at most ``limit``) :meth:`backward_run` can make in one call:
        the WARMUP/FULL steps in a row ahead, when a FusedStep covers the model; else 0."""
        return max(0, min(limit, self.trainer.backward_run_length())) if self.fused is not None else 0

    def backward_run(self, X, idx, count: int, **targets) -> int:
        """``count`` (<= :meth:`backward_run_length`) WARMUP/FULL steps on the batches
        ``X[idx[j*B:(j+1)*B]]`` in one :meth:`FusedStep.steps` call (``targets``: its labels /
        targets / onehot arguments), booked by :meth:`PhaseTrainer.backward_run`. Returns the
        steps made; their losses and correct counts are the FusedStep's ``losses``, ``correct``."""
        fused = self.fused

        def make_steps(stash, accumulate, fresh):
            fused.steps(X, idx, count, stash=stash, clip=self.max_grad_norm, accumulate=accumulate,
                        accumulate_fresh=fresh, **targets)
            return fused.losses, fused.stash_sumsqs

        self.trainer.backward_run(count, make_steps)
        return len(fused.losses)

    def block_run_length(self, limit: int) -> int:
        """How many of the next steps (at most ``limit``) :meth:`block_run` can make in one call: the
        PREDICT steps in a row ahead and the CORRECT step after them
        (:meth:`PhaseTrainer.predict_block_length`), when a FusedStep covers the model; else 0."""
        return max(0, min(limit, self.trainer.predict_block_length())) if self.fused is not None else 0

    def block_run(self, X, idx, count: int, batch_size: int, rows=(), **targets) -> tuple[list, int, int, list]:
        """``count`` (<= :meth:`block_run_length`) steps of the predict block in one call
        (:meth:`PhaseTrainer.predict_block_run` through :meth:`FusedStep.predict_block`), step j on
        the batch ``X[idx[j*B:(j+1)*B]]``, B = ``batch_size``; idx int64 may end with a shorter batch
        (an epoch's last rows): if that step reads it, it is left for a call of its own, unless it is
        the only one. Only CORRECT steps and the steps in ``rows`` (increasing indices into the run:
        they log a metrics row) read their batch and measure a loss. ``targets``: the labels /
        targets / onehot arguments.

        Returns (the losses of the steps made, None where not measured, and if the run stopped at a
        non-finite loss that loss last; rows whose argmax is the label over the measured batches;
        the rows of each measured batch; per row step made: (its index, loss, seconds since the call
        began, optimizer updates made before it, :attr:`FusedStep.row_sums` row (float64, a copy),
        its phase columns as :meth:`row_columns` gives them))."""
        trainer, B = self.trainer, batch_size
        full = len(idx) // B
        rows = list(rows)
        if full < count:                                        # the last batch is short
            if count == 1:
                B, full = len(idx), 1
            elif trainer.block_step_is_correct(count - 1) or rows[-1:] == [count - 1]:
                count, rows = count - 1, [j for j in rows if j < count - 1]
        losses, metrics = trainer.predict_block_run(
            count, lambda run: self.fused.predict_block(X, idx[:full * B], B, run, **targets), rows)
        sums = self.fused.row_sums[:len(metrics)].copy()
        outs = [dict(zip(ROW_COLUMNS, out)) for out in trainer.row_out.tolist()]
        records = [(j, out["loss"], out["ns"] * 1e-9, int(out["updates"]), row_sums,
                    self._columns(raw, raw["corrections"])) for j, out, row_sums, raw in zip(rows, outs, sums, metrics)]
        return losses, int(trainer.block_result[R_RIGHT]), B, records

    def _loss(self, x, y, backward: bool) -> float:
        """The batch loss; with ``backward`` also its gradient in ``grads`` (unless not finite)."""
        if self.fused is not None:
            return self.fused(x, **self.loss_fn.fused(y), stage=BACKWARD if backward else FORWARD)
        mlp, scratch, grads = self.mlp, self.scratch, self.grads
        if not backward:
            return self.loss_fn(mlp.forward(x, scratch), y)
        loss = self.loss_fn(mlp.forward(x, scratch), y, grads.d_output_mut())
        if math.isfinite(loss):
            mlp.backward(x, scratch, grads, need_input_grad=False)
        return loss

    def _fused_backward_step(self, xb, yb) -> float:
        """A backward step in one FusedStep call: the gradient, its copy into the trainer with its
        norm, and the update clipped to max_grad_norm."""
        loss = self.fused(xb, **self.loss_fn.fused(yb), stash=self.trainer.real_gradient_buffer(),
                          clip=self.max_grad_norm)
        if math.isfinite(loss):
            self.trainer.record_written(self.fused.stash_sumsq)
            self.trainer.end_step(loss)
        return loss

    def row_columns(self) -> dict:
        """Phase columns for the metrics row; prediction error/cosine only right after a correction."""
        return self._columns(self.trainer.step_metrics(), self.trainer.correction_count)

    def _columns(self, raw: dict, corrections: int) -> dict:
        """:meth:`row_columns` of the trainer's step_metrics() ``raw`` and correction count, taken at the
        row's step."""
        row = {_COLUMNS[k]: v for k, v in raw.items() if k in _COLUMNS}
        if corrections == self._last_correction_step:
            row.pop("pred_error"), row.pop("pred_cosine")
        self._last_correction_step = corrections
        return row

    def final(self) -> dict:
        """Summary numbers for RunResult.final."""
        s = self.trainer.get_stats()
        return {"backward_passes": s.backward_passes, "speedup_steps": s.speedup_ratio,
                "speedup_wall": s.wallclock_speedup, "mean_prediction_cosine": s.mean_prediction_cosine,
                "prediction_gain": s.prediction_gain, "history_bytes": s.history_bytes}

    def stats(self) -> dict:
        """The full TrainerStats as a plain dict."""
        return self.trainer.get_stats().to_dict()
