"""Steppers: how the training loop makes its next steps, one at a time or a run of them in one call.

A stepper's ``advance(order, pos, step, limit)`` makes the next steps of the epoch from row ``pos`` of
its shuffled ``order`` and returns what they did (:class:`Steps`). ``limit`` is how many full
batches a run may take (up to the next metrics row); 0 asks for one step, whose batch may be the
epoch's short last one.

- :class:`ReferenceStepper`: one step in plain Python over the model's and optimizer's kernels
  (forward, loss, backward, update, LSQ scales). Every model and option runs here.
- :class:`FusedStepper`: the same steps through :class:`~qatlab.train.fused_step.FusedStep`, a run
  of full batches per Numba call; bit-identical to the reference (tested), for the models it covers.
- Phase training's :class:`~qatlab.train.phase_loop.PhaseStepper` (reference or fused inside).
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from functools import cached_property
from typing import NamedTuple

import numpy as np

from ..kernels.dense import count_correct


class Steps(NamedTuple):
    """What one ``advance`` made."""

    losses: list            # per step made: its batch loss (None: a PREDICT step that measured none)
    lr: float               # the learning rate a metrics row after these steps shows
    batch_rows: int         # rows each measured loss averages over
    correct: int            # rows predicted right, of `counted` (the train accuracy's share)
    counted: int
    used: int               # rows of the epoch's order the steps consumed
    rows: list | None = None   # None: the loop logs rows; else the rows the steps logged (RowRecords)


class RowRecord(NamedTuple):
    """A metrics row a run of steps logged itself (phase training's predict blocks)."""

    offset: int             # the step's index in the run
    loss: float
    seconds: float          # since the run began
    lr: float
    sums: np.ndarray        # each layer's layer_sums, float64 (LAYER_SUMS * layers,)
    columns: dict           # the phase columns at that step


@dataclass
class Parts:
    """What every stepper works on: the model with its buffers, the optimizer, the loss, the batches."""

    mlp: object
    scratch: object
    grads: object
    opt: object
    loss_fn: object
    X: np.ndarray           # the training split
    y: np.ndarray
    batch_size: int
    every: int              # metrics_every: a row after every `every` steps (and after the first)
    lsq: object = None      # LsqScales, or None

    def __post_init__(self):
        self.xbuf = np.empty((self.batch_size, self.X.shape[1]), np.float32)
        self.ybuf = np.empty((self.batch_size, *self.y.shape[1:]), self.y.dtype)

    @cached_property
    def fused_targets(self) -> dict:
        """The labels / targets / onehot arguments of :meth:`FusedStep.steps` on the training split."""
        return self.loss_fn.fused_block(self.y)

    def logs_row(self, step: int) -> bool:
        """Whether step ``step`` (0-based) is followed by a metrics row: every ``every``-th, and the first."""
        return (step + 1) % self.every == 0 or step == 0

    def batch(self, order, pos) -> tuple[np.ndarray, np.ndarray]:
        """Rows ``order[pos:pos + batch_size]`` of the training split, gathered into the batch buffers."""
        idx = order[pos: pos + self.batch_size]
        xb = self.X.take(idx, axis=0, out=self.xbuf[: len(idx)])   # the method: np.take's wrapper costs more
        yb = self.y.take(idx, axis=0, out=self.ybuf[: len(idx)])
        return xb, yb

    def update(self, flat_grads, real_gradient: bool, grad_scale: float = 1.0, lr_scale: float = 1.0) -> None:
        """The optimizer step from ``flat_grads``, then (after a real backward pass) the LSQ scales' step."""
        opt = self.opt
        opt.step(flat_grads, lr=opt.lr * lr_scale if lr_scale != 1.0 else None, grad_scale=grad_scale)
        if self.lsq is not None and real_gradient:
            self.lsq.step()

    def one_step(self, loss, lr: float, yb) -> Steps:
        """:class:`Steps` of one step on the batch with labels ``yb``, its output still in the scratch."""
        correct = counted = 0
        if loss is not None and math.isfinite(loss) and self.loss_fn.classify:
            out = self.scratch.output()    # gradient accumulation leaves the last micro-batch's rows
            correct, counted = count_correct(out, yb[len(yb) - len(out):]), len(out)
        return Steps([loss], lr, len(yb), correct, counted, len(yb))

    def fused_run(self, fused, t_before: int) -> Steps:
        """:class:`Steps` of the run of full batches a FusedStep has just made, from optimizer step ``t_before``."""
        losses = fused.losses.tolist()
        rows = len(losses) * self.batch_size
        return Steps(losses, self.opt.schedule(t_before + len(losses) - 1), self.batch_size,
                     int(fused.correct.sum()), rows, rows)


class ReferenceStepper:
    """One step at a time: forward, loss, backward, optimizer (and LSQ) update, in Python over the kernels."""

    def __init__(self, parts: Parts):
        self.parts = parts

    def advance(self, order, pos: int, step: int, limit: int) -> Steps:
        p = self.parts
        xb, yb = p.batch(order, pos)
        lr = p.opt.lr
        loss = p.loss_fn(p.mlp.forward(xb, p.scratch), yb, p.grads.d_output_mut())
        if math.isfinite(loss):
            p.mlp.backward(xb, p.scratch, p.grads, need_input_grad=False)
            p.update(p.grads.flat(), True)
        return p.one_step(loss, lr, yb)

    def diverged_at(self, step: int) -> int:
        """The step a NonFiniteError raised by ``advance`` from ``step`` was seen at."""
        return step + 1

    def row_columns(self) -> dict | None:
        """Columns this stepper adds to a metrics row (phase training's), or None."""
        return None

    def final(self) -> dict:
        """Numbers this stepper adds to the run's final metrics."""
        return {}

    def stats(self) -> dict | None:
        """This stepper's statistics for the log's meta (phase training's), or None."""
        return None


class FusedStepper(ReferenceStepper):
    """Runs of full batches in one :meth:`FusedStep.steps` call each; a single step (the epoch's short
    last batch) as one fused call."""

    def __init__(self, parts: Parts, fused):
        super().__init__(parts)
        self.fused = fused

    def advance(self, order, pos: int, step: int, limit: int) -> Steps:
        p = self.parts
        if limit:
            t_before = p.opt.t
            self.fused.steps(p.X, order[pos: pos + limit * p.batch_size], limit, **p.fused_targets)
            return p.fused_run(self.fused, t_before)
        xb, yb = p.batch(order, pos)
        lr = p.opt.lr
        return p.one_step(self.fused(xb, **p.loss_fn.fused(yb), lr=lr), lr, yb)
