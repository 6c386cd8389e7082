"""Trainer: the training loop of an ExperimentConfig, read top to bottom.

Per epoch: shuffle the training rows (``optim.seed``), let the stepper make steps until the epoch's
rows are used, append a metrics row every ``metrics_every`` steps (and after the first), then
evaluate on the test split and append the epoch's row. What a step is (reference or fused, plain or
phase training) is the stepper's business (:mod:`qatlab.train.steppers`).

The epoch row's train loss and accuracy are the means over the epoch's batches, each taken in
the batch's forward pass before its update, as Keras reports them (phase training: over the steps
that ran a forward pass; gradient accumulation: each step's last micro-batch), so they cost no extra
pass over the training split. Runs of steps made in one call end at the next metrics row, so the
rows are the same whichever stepper made them. A non-finite loss, LSQ scale, gradient norm or parameter ends the run
as ``diverged`` with the quantity and step named; the memory the run needs is checked
(:func:`qatlab.resources.check_memory`) once the data is loaded, before the model exists.
"""
from __future__ import annotations

import math
import time

import numpy as np

from ..config import ExperimentConfig
from ..data import load_dataset
from ..diverged import NonFiniteError
from ..metrics import EPOCH_COLUMNS, MetricsLog
from ..nn import Mlp
from ..optim import make_optimizer
from ..resources import check_memory
from ..runtime.fpmode import subnormals_flushed
from .build import build_model, check_cnn
from .history import history_summary
from .fused_step import FusedStep
from .loss import EVAL_CHUNK, BatchLoss, evaluate
from .lsq import LsqScales
from .result import RunResult
from .rows import blown_up, layer_columns, layer_columns_of_sums, metrics_row, non_finite_parameter
from .steppers import FusedStepper, Parts, ReferenceStepper, Steps

SNAPSHOT_SECONDS = 0.5   # weight snapshots for the live views, at most this often


class Trainer:
    """Trains one config: ``Trainer(cfg).run()`` -> :class:`RunResult`.

    ``log``: the MetricsLog rows go to (a new one by default). ``report(steps_done, total_steps) ->
    bool`` is called before each call of the stepper and once at the end; False stops the run.
    ``publish_weights(dict)`` receives ``{"layer<i>": (latent W copy, quantized W copy)}`` about twice a
    second. ``reference=True`` makes every step with the reference stepper (the fused steppers give
    the same history, time columns aside).
    """

    def __init__(self, cfg: ExperimentConfig, log: MetricsLog | None = None, report=None, publish_weights=None,
                 reference: bool = False):
        cfg.validate()
        self.cfg, self.report, self.publish_weights = cfg, report, publish_weights
        self.log = log if log is not None else MetricsLog()
        self.data = data = load_dataset(cfg.data)
        if data.n_train == 0 or data.n_test == 0:
            raise ValueError("data: the train and test splits must both be non-empty")
        image_shape = getattr(data, "image_shape", None)
        if cfg.model.architecture == "cnn":
            check_cnn(cfg, data.n_features, image_shape)   # a clear message before the memory estimate
        check_memory(cfg, data.n_train, data.n_test, data.n_features, data.n_outputs, image_shape=image_shape)
        self.mlp = mlp = build_model(cfg, data.n_features, data.n_outputs, image_shape)
        bs = min(cfg.optim.batch_size, data.n_train)
        steps_per_epoch = math.ceil(data.n_train / bs)
        self.total = steps_per_epoch * cfg.optim.epochs
        opt = make_optimizer(cfg.optim, mlp.flat_params(), steps_per_epoch)
        self.loss_fn = BatchLoss(cfg.optim.loss, data, bs)
        self.parts = Parts(mlp, mlp.scratch(bs), mlp.gradients(bs), opt, self.loss_fn, data.X_train, data.y_train,
                           bs, cfg.metrics_every, LsqScales.of(mlp, cfg, steps_per_epoch))
        n_eval = min(EVAL_CHUNK, data.n_test)   # a Cnn's evaluation scratch runs its convs in smaller chunks
        self.eval_scratch = mlp.scratch(n_eval) if isinstance(mlp, Mlp) else mlp.scratch(n_eval, backward=False)
        self.stepper = _stepper(cfg, self.parts, reference)
        self.rng = np.random.default_rng(cfg.optim.seed)
        self.n_weights = sum(mlp.weights(i).size for i in range(mlp.num_layers))
        self.step, self.epoch_losses, self.eval_seconds = 0, [], 0.0
        self.test_loss = self.test_acc = math.nan
        self.t0, self.last_snap = time.perf_counter(), -math.inf

    def run(self) -> RunResult:
        """Train to the end (or until ``report`` says stop, or a number blows up); subnormal floats are
        flushed to zero in this thread meanwhile (:mod:`qatlab.runtime.fpmode`)."""
        with subnormals_flushed():
            self.log.meta.update(n_layers=self.mlp.num_layers, sizes=list(self.mlp.sizes), total_steps=self.total)
            if self.cfg.phase.enabled:
                tensors = [a.size for _, a in self.mlp.parameters()]
                self.log.meta["phase_history"] = history_summary(self.cfg.phase, tensors)
            self.t0 = time.perf_counter()
            status, message = "finished", ""
            for epoch in range(self.cfg.optim.epochs):
                totals = _EpochTotals()
                status, message = self._epoch(epoch, totals)
                if status != "finished":
                    break
                self._end_epoch(epoch, totals)
            if self.report is not None:
                self.report(self.step, self.total)
            return self._result(status, message)

    def _epoch(self, epoch: int, totals: "_EpochTotals") -> tuple[str, str]:
        """The steps of one epoch; returns ("finished", "") or how the run ended."""
        n, bs, every = self.data.n_train, self.parts.batch_size, self.cfg.metrics_every
        order = self.rng.permutation(n)
        pos = 0                        # rows of `order` used so far
        while pos < n:
            step = self.step
            if self.report is not None and not self.report(step, self.total):
                return "stopped", f"stopped by request at step {step}"
            started = time.perf_counter() - self.t0
            try:   # a loss, gradient, scale or parameter that left float32 ends the run as diverged
                made = self.stepper.advance(order, pos, step, run_limit(step, every, (n - pos) // bs))
            except NonFiniteError as exc:
                seen = self.stepper.diverged_at(step)
                return "diverged", self._diverged(exc.describe(seen), seen, epoch, exc.quantity is None)
            if made.rows is not None:
                self._log_run_rows(made, epoch, pos, started)
            self.step += len(made.losses)
            pos += made.used
            loss = made.losses[-1]
            if loss is not None and not math.isfinite(loss):
                return "diverged", (f"loss became {loss} at step {self.step} (epoch {epoch + 1}); "
                                    "try a lower learning rate or gradient clipping")
            totals.add(made)
            if blown := self._row(made, epoch, pos):
                return "diverged", self._diverged(f"{blown} at step {self.step}", self.step, epoch, False)
            self._publish()
        return "finished", ""

    def _row(self, made: Steps, epoch: int, pos: int) -> str | None:
        """Append the metrics row due after these steps (a run that logged its own rows is only
        checked); returns what became non-finite, or None."""
        step = self.step
        own = made.rows is not None
        if not (self.parts.logs_row(step - 1) or own):
            return None
        layers = {}
        if not own:
            p = self.parts
            layers, nonzero = layer_columns(self.mlp, p.grads, p.scratch)
            self.log.append(metrics_row(step, epoch + pos / self.data.n_train, time.perf_counter() - self.t0,
                                        made.losses[-1], made.lr, layers, nonzero, self.n_weights,
                                        self.stepper.row_columns()))
        return blown_up(self.mlp, layers)

    def _log_run_rows(self, made: Steps, epoch: int, pos: int, started: float) -> None:
        """The rows a run of steps logged itself, appended in order."""
        n, bs = self.data.n_train, self.parts.batch_size
        for r in made.rows:
            layers, nonzero = layer_columns_of_sums(self.mlp, r.sums)
            self.log.append(metrics_row(self.step + r.offset + 1, epoch + min(pos + (r.offset + 1) * bs, n) / n,
                                        started + r.seconds, r.loss, r.lr, layers, nonzero, self.n_weights,
                                        r.columns))

    def _publish(self) -> None:
        """Hand the live views a weight snapshot, at most every SNAPSHOT_SECONDS."""
        if self.publish_weights is None:
            return
        elapsed = time.perf_counter() - self.t0
        if elapsed - self.last_snap >= SNAPSHOT_SECONDS:
            self.last_snap = elapsed
            scratch = self.parts.scratch
            self.publish_weights({f"layer{i}": (self.mlp.weights(i).copy(), scratch.weights_used(i).copy())
                                  for i in range(self.mlp.num_layers)})

    def _end_epoch(self, epoch: int, totals: "_EpochTotals") -> None:
        """Evaluate on the test split and append the epoch's row."""
        self.epoch_losses.append(totals.loss / totals.loss_rows if totals.loss_rows else math.nan)
        t_eval = time.perf_counter()
        data = self.data
        self.test_loss, self.test_acc = evaluate(self.mlp, data.X_test, data.y_test, self.loss_fn, self.eval_scratch)
        train_acc = totals.correct / totals.counted if totals.counted else math.nan
        elapsed = time.perf_counter() - self.t0
        self.eval_seconds += elapsed - (t_eval - self.t0)
        self.log.append(dict(zip(EPOCH_COLUMNS, (self.step, epoch + 1, elapsed, self.test_loss, self.test_acc,
                                                 train_acc, self.epoch_losses[-1]))))

    def _result(self, status: str, message: str) -> RunResult:
        seconds = time.perf_counter() - self.t0
        stats = self.stepper.stats()
        if stats is not None:
            self.log.meta["phase_stats"] = stats
        final = {"train_loss": self.epoch_losses[-1] if self.epoch_losses else math.nan,
                 "test_loss": self.test_loss, "test_accuracy": self.test_acc, "seconds": seconds,
                 "steps_per_second": self.step / seconds if seconds else 0.0, "steps": self.step,
                 "train_seconds": seconds - self.eval_seconds, **self.stepper.final()}
        return RunResult(history=self.log.columns(), final=final, model=self.mlp, status=status, message=message,
                         config=self.cfg.to_dict())

    def _diverged(self, what: str, step: int, epoch: int, name_parameter: bool) -> str:
        """The diverged run's message: ``what`` became non-finite at ``step``, or (``name_parameter``:
        ``what`` is an observer's or quantizer's complaint) the parameter that did, if one did."""
        if name_parameter and (name := non_finite_parameter(self.mlp)) is not None:
            what = f"parameter {name} became NaN or inf at step {step}"
        return f"{what} (epoch {epoch + 1}); try a lower learning rate or gradient clipping"


class _EpochTotals:
    """The epoch's train loss and accuracy, summed over its steps' batches as they ran."""

    def __init__(self):
        self.loss, self.loss_rows, self.correct, self.counted = 0.0, 0, 0, 0

    def add(self, made: Steps) -> None:
        measured = [value for value in made.losses if value is not None]   # a PREDICT step may measure none
        for value in measured:
            self.loss += value * made.batch_rows
        self.loss_rows += len(measured) * made.batch_rows
        self.correct += made.correct
        self.counted += made.counted


def _stepper(cfg: ExperimentConfig, parts: Parts, reference: bool):
    """The stepper the config allows: fused for the small MLPs FusedStep covers (no LSQ scales), else the
    reference; phase training's around either."""
    fused = None
    if not reference and parts.lsq is None and isinstance(parts.mlp, Mlp):
        fused = FusedStep.build(parts.mlp, parts.scratch, parts.grads, parts.opt)
    if cfg.phase.enabled:
        from .phase_loop import PhaseStepper
        if parts.batch_size < cfg.phase.gradient_accumulation:
            raise ValueError(f"phase.gradient_accumulation: {cfg.phase.gradient_accumulation} micro-batches "
                             f"need batch_size >= that, got {parts.batch_size}")
        return PhaseStepper(cfg.phase, parts, fused)
    return ReferenceStepper(parts) if fused is None else FusedStepper(parts, fused)


def train_experiment(cfg: ExperimentConfig, log: MetricsLog | None = None, report=None, publish_weights=None,
                     reference: bool = False) -> RunResult:
    """Train ``cfg`` in this thread and return its RunResult: ``Trainer(cfg, ...).run()`` (see :class:`Trainer`),
    built with subnormal floats flushed as it trains."""
    with subnormals_flushed():
        return Trainer(cfg, log, report, publish_weights, reference).run()


def run_limit(step: int, every: int, full_batches: int) -> int:
    """How many steps a run from ``step`` may make: up to and including the next metrics-row step,
    and at most the full batches left in the epoch."""
    next_row = 1 if step == 0 else (step // every + 1) * every
    return min(next_row - step, full_batches)
