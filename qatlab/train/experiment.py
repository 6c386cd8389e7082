"""The generic QAT training loop behind ``run_experiment`` and ``LocalRun``.

One step: gather a batch (seeded shuffle), forward through the quantized model,
loss writes dL/dy, backward (STE to latent weights), optional clipping, optimizer
step (and the LSQ scale step). Every ``metrics_every`` steps one row goes to the
MetricsLog. After every epoch a row with the test loss/accuracy (the model after the epoch, on
the test split) and the epoch's train loss and train accuracy: the means over the epoch's
batches of their loss and of their predictions' accuracy, each taken in the batch's forward pass
before its update, as Keras reports them (with phase training, over the steps that ran a
forward pass; with gradient accumulation, the accuracy of each step's last micro-batch). Taken
in passing they cost nothing, where evaluating the whole train split after every epoch took a
quarter of a digits run. A non-finite loss (each step), LSQ scale (each step), gradient norm or
parameter (each metrics row, and after each block run) ends the run with status ``diverged``
and a message naming it and the step it was seen at; the memory the run needs is checked against
a budget (:func:`qatlab.resources.check_memory`) once the data is loaded, before the model exists.

A model that :class:`~qatlab.train.fused_step.FusedStep` covers (small, ternary or float weights, no LSQ
scales) makes its full batches in runs that end at the next metrics row: each run is one
:meth:`~qatlab.train.fused_step.FusedStep.steps` call that gathers the batches too, the same numbers as one
call per step. With phase training, runs of WARMUP/FULL steps go the same way, and a predict
block's steps go in one call to the block's end or the epoch's (:mod:`qatlab.train.phase_loop`):
that kernel logs the block's metrics rows itself -- the row step's loss, time and each layer's
sums (:func:`~qatlab.kernels.fused.layer_sums`, the kernel the rows after other steps use too) --
and the loop appends them after the call, the same rows as one call per step. The Python around
each step (batch gather, loss and accuracy bookkeeping, the ``report`` call) was 15% of a default
digits step; it also held the GIL, which the dashboard's event loop and the other runs wait for.
"""
from __future__ import annotations

import functools
import math
import time

import numpy as np

from ..config import ExperimentConfig
from ..data import Dataset, load_dataset
from ..diverged import NonFiniteError
from ..runtime.fpmode import subnormals_flushed
from .fused_step import FusedStep
from ..kernels.dense import count_correct, sum_squares, two_sign_counts
from ..kernels.fused import LAYER_SUMS, layer_sums
from ..kernels.phase_kernels import all_finite
from ..metrics import LAYER_METRICS, MetricsLog
from ..nn import Mlp, cross_entropy_loss, mse_loss
from ..optim import make_optimizer
from ..resources import check_memory
from ..quant import FLOAT32_EPS, SCALE_MAX, FakeQuantize, TernaryQuantizer, noise_stats
from .build import build_model, check_cnn, set_observing
from .result import RunResult

EVAL_CHUNK = 1024
SNAPSHOT_SECONDS = 0.5


class _Loss:
    """Loss of the configured kind with preallocated targets; ``__call__(y, rows, d_out) -> float``."""

    def __init__(self, kind: str, data: Dataset, batch_size: int):
        self.classify = data.task == "classification"
        self.kind = kind if self.classify else "mse"
        self.onehot = np.zeros((max(batch_size, EVAL_CHUNK), data.n_outputs), np.float32)

    def __call__(self, y, targets, d_out=None) -> float:
        if self.kind == "cross_entropy":
            return cross_entropy_loss(y, targets, d_out)
        return mse_loss(y, self._mse_targets(targets), d_out)

    def _mse_targets(self, targets):
        if not self.classify:
            return targets
        t = self.onehot[: len(targets)]
        t.fill(0.0)
        t[np.arange(len(targets)), targets] = 1.0
        return t

    def fused_block(self, y_train) -> dict:
        """The keyword arguments of :meth:`~qatlab.train.fused_step.FusedStep.steps` on the training split."""
        if not self.classify:
            return {"targets": np.ascontiguousarray(y_train, dtype=np.float32)}
        return {"labels": y_train, "onehot": self.kind != "cross_entropy"}

    def fused(self, targets) -> dict:
        """The keyword arguments of a :class:`~qatlab.train.fused_step.FusedStep` call for this batch's targets."""
        if self.kind == "cross_entropy":
            return {"labels": targets}
        return {"targets": self._mse_targets(targets)}


def evaluate(mlp: Mlp, X: np.ndarray, y: np.ndarray, loss: _Loss, scratch=None) -> tuple[float, float]:
    """(mean loss, accuracy) of ``mlp`` on X (n, in) / y (n,) or (n, k); accuracy nan for regression."""
    scratch = scratch or mlp.scratch(min(EVAL_CHUNK, len(X)))
    total, correct = 0.0, 0.0
    set_observing(mlp, False)
    try:
        for start in range(0, len(X), scratch.batch_size):
            xb, yb = X[start: start + scratch.batch_size], y[start: start + scratch.batch_size]
            out = mlp.forward(xb, scratch)
            total += loss(out, yb) * len(xb)
            if loss.classify:
                correct += count_correct(out, yb)
    finally:
        set_observing(mlp, True)
    return total / len(X), (correct / len(X) if loss.classify else math.nan)


def _lsq_quantizers(mlp: Mlp) -> list[FakeQuantize]:
    return [q for q in mlp.weight_quantizers if isinstance(q, FakeQuantize) and q.learn_scale]


class _LsqScales:
    """The LSQ scales of every quantizer, learned in log space by their own optimizer.

    The optimizer sees ``log s`` and the gradient ``dL/d(log s) = s dL/ds``, so a step changes a
    scale by a relative amount (~lr) whatever its size; stepping ``s`` itself with Adam moves an
    8-bit scale of ~0.02 by ~lr = 0.01 per step and collapses it.
    """

    def __init__(self, quantizers, cfg, steps_per_epoch, layers=None):
        self.quantizers = quantizers
        self.layers = list(range(len(quantizers))) if layers is None else list(layers)   # for messages
        self.sizes = [np.size(q.scale) for q in quantizers]
        scales = np.concatenate([np.atleast_1d(q.scale).astype(np.float32) for q in quantizers])
        self.log_scales = np.log(scales)
        self.grads = np.zeros_like(self.log_scales)
        self.opt = make_optimizer(cfg.optim, self.log_scales, steps_per_epoch)

    def step(self) -> None:
        i = 0
        for q, n in zip(self.quantizers, self.sizes):
            self.grads[i: i + n] = q.scale_grad * np.atleast_1d(q.scale)
            i += n
        self.opt.step(self.grads)
        with np.errstate(over="ignore", invalid="ignore"):
            scales = np.maximum(np.exp(self.log_scales), FLOAT32_EPS)
        if not np.all(scales <= SCALE_MAX):     # NaN or past what float32 holds: the run diverged
            self._blew_up(scales)
        i = 0
        for q, n in zip(self.quantizers, self.sizes):
            s = scales[i: i + n]
            q.update_params(s.copy() if np.ndim(q.scale) else float(s[0]), q.zero_point)
            i += n

    def _blew_up(self, scales: np.ndarray) -> None:
        """Raise NonFiniteError naming the first layer whose scale left float32 (nothing updated)."""
        i = 0
        for layer, n in zip(self.layers, self.sizes):
            bad = scales[i: i + n][~(scales[i: i + n] <= SCALE_MAX)]
            if bad.size:
                value = float(bad[0])
                raise NonFiniteError(f"scale: LSQ scale of layer {layer} became {value}",
                                     f"LSQ scale of layer {layer}", value)
            i += n


def layer_row(mlp: Mlp, grads, scratch, i: int) -> dict:
    """Per-layer metrics of layer i: grad norm, quantization noise/SQNR/scale/saturation, sign fractions."""
    return _layer_row(mlp, grads, scratch, i)[0]


@functools.cache
def _layer_keys(i: int) -> dict[str, str]:
    return {m: f"{m}_{i}" for m in LAYER_METRICS}


def _layer_row(mlp: Mlp, grads, scratch, i: int) -> tuple[dict, int]:
    """(:func:`layer_row`, count of non-zero (and not NaN) weight gradients of layer i)."""
    k = _layer_keys(i)
    w, dw, used = mlp.weights(i), grads.d_weights(i).reshape(-1), scratch.weights_used(i)
    q = mlp.weight_quantizers[i]
    if q is None or isinstance(q, TernaryQuantizer):    # one kernel, as phase training's block runs log rows
        sums = np.empty(LAYER_SUMS)
        layer_sums(w.reshape(-1), dw, used.reshape(-1), q is not None, np.float32(q.alpha if q else 0.0), sums)
        return _layer_row_of_sums(mlp, i, sums)
    g_neg, g_pos, neg, pos = two_sign_counts(dw, used.reshape(-1))
    row = {k["grad_norm"]: math.sqrt(sum_squares(dw))}
    row[k["noise_mse"]], row[k["sqnr_db"]], row[k["saturation"]] = q.noise_stats(w)
    row[k["scale"]] = float(np.mean(q.scale))
    n = used.size
    row[k["frac_neg"]], row[k["frac_zero"]], row[k["frac_pos"]] = neg / n, (n - neg - pos) / n, pos / n
    return row, g_neg + g_pos


def _layer_row_of_sums(mlp: Mlp, i: int, sums: np.ndarray) -> tuple[dict, int]:
    """:func:`_layer_row` of a layer with a ternary quantizer or none, from its
    :func:`~qatlab.kernels.fused.layer_sums` ``sums``."""
    k = _layer_keys(i)
    sumsq, g_nonzero, neg, pos, noise, saturated, signal, alpha = sums.tolist()
    row = {k["grad_norm"]: math.sqrt(sumsq)}
    n = mlp.weights(i).size
    if mlp.weight_quantizers[i] is not None:
        row[k["noise_mse"]], row[k["sqnr_db"]], row[k["saturation"]] = noise_stats(noise, saturated, signal, n)
        row[k["scale"]] = alpha
    row[k["frac_neg"]], row[k["frac_zero"]], row[k["frac_pos"]] = neg / n, (n - neg - pos) / n, pos / n
    return row, int(g_nonzero)


def _merged(layer_rows) -> tuple[dict, int]:
    """The columns of all layers' :func:`_layer_row` pairs and their non-zero weight gradients."""
    layers, nonzero = {}, 0
    for layer, nz in layer_rows:
        layers.update(layer)
        nonzero += nz
    return layers, nonzero


def _metrics_row(step: int, epoch: float, elapsed: float, loss, lr: float, layers: dict, nonzero: int,
                 n_weights: int, phase_columns: dict | None) -> dict:
    """A per-step metrics row (see :func:`train_experiment`)."""
    row = {"step": step, "epoch": epoch, "time": elapsed, "loss": loss, "lr": lr,
           "steps_per_second": step / elapsed if elapsed > 0 else math.nan,
           "active_grad_fraction": nonzero / n_weights, **layers}   # weights with a non-zero gradient
    if phase_columns is not None:
        row.update(phase_columns)
    return row


def train_experiment(cfg: ExperimentConfig, log: MetricsLog | None = None, report=None,
                     publish_weights=None):
    """Train ``cfg`` to completion (or until ``report`` returns False) and return a RunResult.

    report(steps_done, total_steps) -> bool is called before every step, or before each run of
    steps made in one call (module doc: at most ``metrics_every``), and once at the end;
    publish_weights(dict) receives ``{"layer<i>": (latent W copy, quantized W copy)}`` about twice a second.
    Runs with subnormal floats flushed to zero in the calling thread (:mod:`qatlab.runtime.fpmode`),
    restored afterwards.
    """
    with subnormals_flushed():
        return _train(cfg, log, report, publish_weights)


def _train(cfg: ExperimentConfig, log: MetricsLog | None, report, publish_weights):

    cfg.validate()
    log = log if log is not None else MetricsLog()
    data = load_dataset(cfg.data)
    if data.n_train == 0 or data.n_test == 0:
        raise ValueError("data: the train and test splits must both be non-empty")
    image_shape = getattr(data, "image_shape", None)
    if cfg.model.architecture == "cnn":
        check_cnn(cfg, data.n_features, image_shape)   # a clear message before the memory estimate
    check_memory(cfg, data.n_train, data.n_test, data.n_features, data.n_outputs,
                 image_shape=image_shape)   # before the model exists
    mlp = build_model(cfg, data.n_features, data.n_outputs, image_shape)
    bs = min(cfg.optim.batch_size, data.n_train)
    steps_per_epoch = math.ceil(data.n_train / bs)
    total = steps_per_epoch * cfg.optim.epochs
    opt = make_optimizer(cfg.optim, mlp.flat_params(), steps_per_epoch)
    lsq = _lsq_quantizers(mlp)
    lsq = _LsqScales(lsq, cfg, steps_per_epoch, [mlp.weight_quantizers.index(q) for q in lsq]) if lsq else None
    loss_fn = _Loss(cfg.optim.loss, data, bs)
    scratch, grads = mlp.scratch(bs), mlp.gradients(bs)
    n_eval = min(EVAL_CHUNK, data.n_test)   # a Cnn's evaluation scratch runs its convs in smaller chunks
    eval_scratch = mlp.scratch(n_eval) if isinstance(mlp, Mlp) else mlp.scratch(n_eval, backward=False)
    # one Numba call per step for small models without LSQ scales (qatlab.train.fused_step); the same numbers
    fused = FusedStep.build(mlp, scratch, grads, opt) if lsq is None and isinstance(mlp, Mlp) else None   # MLP only
    # FusedStep.steps() arguments: runs of full batches go in one call (module doc)
    block = loss_fn.fused_block(data.y_train) if fused is not None else None
    xbuf = np.empty((bs, data.n_features), np.float32)
    ybuf = np.empty((bs, *data.y_train.shape[1:]), data.y_train.dtype)
    phase = None
    if cfg.phase.enabled:
        from .phase_loop import PhaseStepper
        if bs < cfg.phase.gradient_accumulation:
            raise ValueError(f"phase.gradient_accumulation: {cfg.phase.gradient_accumulation} micro-batches "
                             f"need batch_size >= that, got {bs}")
        phase = PhaseStepper(cfg.phase, mlp, scratch, grads, loss_fn, fused)
    rng = np.random.default_rng(cfg.optim.seed)

    def update(flat_grads, real_gradient: bool, grad_scale: float = 1.0, lr_scale: float = 1.0):
        opt.step(flat_grads, lr=opt.lr * lr_scale if lr_scale != 1.0 else None, grad_scale=grad_scale)
        if lsq and real_gradient:  # LSQ scale gradients exist only after a real backward pass
            lsq.step()

    log.meta.update(n_layers=mlp.num_layers, sizes=list(mlp.sizes), total_steps=total)
    n_weights = sum(mlp.weights(i).size for i in range(mlp.num_layers))
    every = cfg.metrics_every   # a metrics row every `every` steps (and after the first)

    status, message = "finished", ""
    step, t0, last_snap = 0, time.perf_counter(), -math.inf
    epoch_losses: list[float] = []
    test_loss = test_acc = math.nan
    eval_seconds = 0.0
    for epoch in range(cfg.optim.epochs):
        order = rng.permutation(data.n_train)
        epoch_loss, epoch_rows = 0.0, 0
        acc_correct, acc_rows = 0, 0   # train accuracy: predictions of the step's (last) forward pass
        pos = 0                        # rows of `order` used so far this epoch
        while pos < data.n_train:
            if report is not None and not report(step, total):
                status, message = "stopped", f"stopped by request at step {step}"
                break
            # runs of full batches in one call, up to the next metrics row (module doc)
            left, logged = data.n_train - pos, -1
            to_row = _run_limit(step, every, left // bs)
            try:   # a loss, gradient, scale or parameter that left float32 ends the run as diverged
                run = 0
                if block is not None and to_row:
                    run = to_row if phase is None else phase.backward_run_length(to_row)
                if run:
                    t_before, idx = opt.t, order[pos: pos + run * bs]
                    if phase is None:
                        fused.steps(data.X_train, idx, run, **block)
                    else:
                        phase.backward_run(data.X_train, idx, run, **block)
                    losses, lr, n_rows = fused.losses.tolist(), opt.schedule(t_before + len(fused.losses) - 1), bs
                    correct, counted, used = int(fused.correct.sum()), len(losses) * bs, len(losses) * bs
                # a predict block, to its end or the epoch's: its PREDICT steps read no batch (the run may end on
                # the epoch's partial batch) but the ones that log a metrics row, which the kernel measures
                elif phase is not None and (run := phase.block_run_length(-(-left // bs))):
                    t_before, before = opt.t, time.perf_counter() - t0
                    rows = [j for j in range(run) if (step + j + 1) % every == 0 or step + j == 0]
                    losses, correct, n_rows, records = phase.block_run(data.X_train, order[pos: pos + run * bs], run,
                                                                       bs, rows=rows, **block)
                    counted, used = n_rows * sum(v is not None for v in losses), min(len(losses) * bs, left)
                    for j, row_loss, seconds, updates, sums, columns in records:
                        layers, nonzero = _merged(_layer_row_of_sums(mlp, i, sums[LAYER_SUMS * i:LAYER_SUMS * (i + 1)])
                                                  for i in range(mlp.num_layers))
                        log.append(_metrics_row(step + j + 1, epoch + min(pos + (j + 1) * bs, data.n_train) / data.n_train,
                                                before + seconds, row_loss, opt.schedule(t_before + updates), layers,
                                                nonzero, n_weights, columns))
                    lr, logged = opt.schedule(t_before), step + len(losses)
                else:
                    idx = order[pos: pos + bs]
                    xb = data.X_train.take(idx, axis=0, out=xbuf[: len(idx)])   # the method: np.take's
                    yb = data.y_train.take(idx, axis=0, out=ybuf[: len(idx)])   # wrapper costs 0.6 us more
                    lr, n_rows = opt.lr, len(idx)
                    if phase is None and fused is not None:
                        loss = fused(xb, **loss_fn.fused(yb), lr=lr)
                    elif phase is None:
                        loss = loss_fn(mlp.forward(xb, scratch), yb, grads.d_output_mut())
                        if math.isfinite(loss):
                            mlp.backward(xb, scratch, grads, need_input_grad=False)
                            update(grads.flat(), True)
                    else:   # a PREDICT step measures its loss only for a metrics row (None otherwise)
                        loss = phase.step(xb, yb, update, need_loss=(step + 1) % every == 0 or step == 0)
                    losses, correct, counted, used = [loss], 0, 0, n_rows
                    if loss is not None and math.isfinite(loss) and loss_fn.classify:
                        out = scratch.output()    # gradient accumulation leaves the last micro-batch's rows
                        correct, counted = count_correct(out, yb[len(yb) - len(out):]), len(out)
            except NonFiniteError as exc:
                status = "diverged"
                seen = phase.trainer.total_step + 1 if phase is not None else step + 1
                message = _diverged_message(exc.describe(seen), mlp, seen, epoch, exc.quantity is None)
                break
            step += len(losses)
            pos += used
            loss = losses[-1]
            if loss is not None and not math.isfinite(loss):
                status = "diverged"
                message = (f"loss became {loss} at step {step} (epoch {epoch + 1}); "
                           "try a lower learning rate or gradient clipping")
                break
            measured = [value for value in losses if value is not None]   # (a PREDICT step may measure none)
            for value in measured:
                epoch_loss += value * n_rows
            epoch_rows += len(measured) * n_rows
            acc_correct += correct
            acc_rows += counted
            elapsed = time.perf_counter() - t0
            layers = {}
            if (step % every == 0 or step == 1) and step != logged:       # (a block run logs its own rows)
                layers, nonzero = _merged(_layer_row(mlp, grads, scratch, i) for i in range(mlp.num_layers))
                log.append(_metrics_row(step, epoch + pos / data.n_train, elapsed, loss, lr, layers, nonzero, n_weights,
                                        None if phase is None else phase.metrics()))
            if (step % every == 0 or step == 1 or step == logged) and (blown := _blown_up(mlp, layers)):
                status, message = "diverged", _diverged_message(f"{blown} at step {step}", mlp, step, epoch, False)
                break
            if publish_weights is not None and elapsed - last_snap >= SNAPSHOT_SECONDS:
                last_snap = elapsed
                publish_weights({f"layer{i}": (mlp.weights(i).copy(), scratch.weights_used(i).copy())
                                 for i in range(mlp.num_layers)})
        if status != "finished":
            break
        epoch_losses.append(epoch_loss / epoch_rows if epoch_rows else math.nan)
        t_eval = time.perf_counter()
        test_loss, test_acc = evaluate(mlp, data.X_test, data.y_test, loss_fn, eval_scratch)
        train_acc = acc_correct / acc_rows if acc_rows else math.nan
        elapsed = time.perf_counter() - t0
        eval_seconds += elapsed - (t_eval - t0)
        log.append({"step": step, "epoch": epoch + 1, "time": elapsed, "test_loss": test_loss,
                    "test_accuracy": test_acc, "train_accuracy": train_acc, "train_loss": epoch_losses[-1]})
    if report is not None:
        report(step, total)
    seconds = time.perf_counter() - t0
    if phase is not None:
        log.meta["phase_stats"] = phase.stats_dict()
    final = {"train_loss": epoch_losses[-1] if epoch_losses else math.nan, "test_loss": test_loss,
             "test_accuracy": test_acc, "seconds": seconds, "steps_per_second": step / seconds if seconds else 0.0,
             "steps": step, "train_seconds": seconds - eval_seconds}
    if phase is not None:
        final.update(phase.final())
    return RunResult(history=log.columns(), final=final, model=mlp, status=status, message=message,
                     config=cfg.to_dict())


def _blown_up(mlp: Mlp, layers: dict) -> str | None:
    """What the metrics row's layer columns ``layers`` (empty: no row) or the parameters show
    non-finite ("gradient of layer 1 became inf"), or None; one pass over the parameters."""
    for i in range(mlp.num_layers):
        norm = layers.get(f"grad_norm_{i}", 0.0)
        if not math.isfinite(norm):
            return f"gradient of layer {i} became {norm}"
    if all_finite(mlp.flat_params()):
        return None
    name = next(name for name, p in mlp.parameters() if not all_finite(p.reshape(-1)))
    return f"parameter {name} became NaN or inf"


def _diverged_message(what: str, mlp: Mlp, step: int, epoch: int, name_parameter: bool) -> str:
    """The diverged run's message: ``what`` became non-finite at ``step``, or (``name_parameter``:
    ``what`` is an observer's or quantizer's complaint) the parameter that did, if one did."""
    if name_parameter and not all_finite(mlp.flat_params()):
        name = next(name for name, p in mlp.parameters() if not all_finite(p.reshape(-1)))
        what = f"parameter {name} became NaN or inf at step {step}"
    return f"{what} (epoch {epoch + 1}); try a lower learning rate or gradient clipping"


def _run_limit(step: int, every: int, full_batches: int) -> int:
    """How many steps a run from ``step`` may make: up to and including the next metrics-row step,
    and at most the full batches left in the epoch."""
    next_row = 1 if step == 0 else (step // every + 1) * every
    return min(next_row - step, full_batches)
