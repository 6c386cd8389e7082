r"""PhaseTrainer: full backward passes alternate with predicted gradients.

Schedule (``PhaseConfig``; F, P = the current FULL and predict-block lengths; a cycle = a FULL run + its block)::

    WARMUP x warmup_steps (once) -> [ FULL x F -> predict block x P ] -> [ FULL x F -> ... ] ...

A predict block's steps are PREDICT (predicted gradient, no backward pass) but for the CORRECT ones, ``s`` steps
apart (real gradient; the prediction's error is folded into a correction and a gain: :mod:`qatlab.train.predictors`).
``s`` starts at min(first_correct_every, correct_every), grows by 1 per CORRECT step up to correct_every and carries
over between blocks (early in training the real gradient turns within a few steps). With the defaults a block's
CORRECT steps are at positions 2, 5, 9, 14, 20, 27, 35 (first block), 9, 19, 29, 39 (second), then 10, 20, 30, 40.
``speedup_ratio`` = total steps / backward steps; ``wallclock_speedup`` = mean backward-step seconds * total steps /
total seconds (timed from begin_step to end_step).

``max_grad_norm`` > 0 scales every gradient handed out by max_grad_norm / (norm + 1e-6) when norm > max_grad_norm
(as torch's clip_grad_norm_; the predictor gets the real gradient, mean of the k micro-batches, unclipped, and
:attr:`~PhaseTrainer.clip_scale` lets a loop apply the clipping itself). Per step (``k`` = gradient_accumulation;
backward_run, predicted_steps and predict_block_run make runs of steps in one call, booked the same way)::

    info = pt.begin_step()
    if info.needs_backward:                          # WARMUP, FULL, CORRECT
        for mb in range(k): pt.record_full_gradients(grads_of(mb))
        g = pt.gradients_for_update()                # clipped real gradient
    else:                                            # PREDICT
        g = pt.get_predicted_gradients()             # gain * (prediction + correction), clipped
    if pt.lr_scale > 0:                              # the gain on PREDICT steps (no update at 0), else 1
        optimizer.step(g, lr=scheduled_lr * pt.lr_scale)
    pt.end_step(loss)

``adaptive_phases``: at the end of a cycle with a predict block, with L_F / L_P the mean loss of its FULL steps /
block (steps ended with ``end_step(None)`` left out) and F0, P0 the configured lengths, F kept in
[max(1, F0 // 2), 2 F0] and P in [max(1, P0 // 2), 2 P0]; a block begun on the ramp moves nothing (r biased low)::

    r = (L_P - L_F) / max(|L_F|, 1e-12)
    r > loss_threshold          -> F += max(1, F0 // 4), P -= max(1, P0 // 4)   (predictions hurt)
    r < 0 in 2 cycles in a row  -> F -= max(1, F0 // 4), P += max(1, P0 // 4)   (loss keeps falling)
"""
from __future__ import annotations

import enum
import math
import time
from dataclasses import asdict, dataclass, field
from typing import NamedTuple

import numpy as np

from ..config import PhaseConfig
from ..diverged import NonFiniteError
from ..kernels import clock
from ..kernels.dense import sum_squares
from ..kernels.fused import BLOCK_RESULT, CORRECTION_COLUMNS, PREDICTOR_STATE, ROW_COLUMNS, predicted_steps
from ..kernels.state import BlockPlan, Opt, Predictor
from ..kernels.phase_kernels import copy_sum_squares
from .history import make_history
from .predictors import CorrectionResult, ParamLayout, make_predictor

_clock = time.perf_counter   # replaced by tests
_FALLING_CYCLES = 2
_NAN = float("nan")


def _added(total: float, values) -> float:
    """total + values[0] + values[1] + ..., added one at a time (as a step-by-step loop adds them)."""
    for v in values:
        total += v
    return total


class TrainingPhase(enum.IntEnum):
    """Phase of one step; the int code is what metrics columns store."""

    WARMUP = 0
    FULL = 1
    PREDICT = 2
    CORRECT = 3

    @property
    def label(self) -> str:
        """Lower-case name, e.g. ``"predict"``."""
        return self.name.lower()

    @property
    def needs_backward(self) -> bool:
        """True for WARMUP, FULL and CORRECT."""
        return self is not TrainingPhase.PREDICT


# int codes for the per-step counters (list indices; cheaper than comparing enum members)
_FULL, _PREDICT, _CORRECT = int(TrainingPhase.FULL), int(TrainingPhase.PREDICT), int(TrainingPhase.CORRECT)


class StepInfo(NamedTuple):
    """What :meth:`PhaseTrainer.begin_step` decided for one step (immutable; a named tuple, as one
    is built every step and a frozen dataclass is slower to build).

    phase_step: 0-based position in the current run (warmup, FULL run, or predict block:
    PREDICT and CORRECT share the block's count). total_step: 0-based step index. cycle:
    cycles completed before this step. phase_changed: phase differs from the previous step's.
    """

    phase: TrainingPhase
    phase_step: int
    total_step: int
    cycle: int
    phase_changed: bool
    needs_backward: bool


class PredictBlock(NamedTuple):
    """What :meth:`PhaseTrainer.predict_block_run` hands its ``make_steps``: the arguments of
    :func:`qatlab.kernels.fused.predict_block` that describe the run (see there): the predictor's
    arrays and state (in/out), the plan of the ``count`` steps (from step ``first`` at block position
    ``pos``, CORRECT steps where the ramp puts them, the fold's constants, the clipping, the steps
    that log a metrics row) and the ``result`` / ``corrections`` / ``row_out`` buffers;
    ``last_read``: the index of the last step that reads its batch (-1: none)."""

    predictor: Predictor
    plan: BlockPlan
    result: np.ndarray
    corrections: np.ndarray
    row_out: np.ndarray
    count: int
    last_read: int


@dataclass
class TrainerStats:
    """Counters and measurements of a :class:`PhaseTrainer` run (see module doc).

    Step counts are of completed steps; ``backward_passes`` = warmup + full + correct steps;
    ``micro_batches`` = real gradients recorded. ``mean_loss`` maps phase labels to the mean
    loss over those steps whose loss was measured (NaN if none). Prediction error / cosine are means
    over corrections (of the predictions before the gain); ``prediction_gain`` is the gain that
    scales the predictions handed out now (1.0 without ``learned_gain``). ``predictor_bytes``: every
    array the predictor holds, ``history_bytes`` of them its trend entries (``history_storage``).
    """

    total_steps: int = 0
    warmup_steps: int = 0
    full_steps: int = 0
    predict_steps: int = 0
    correct_steps: int = 0
    backward_passes: int = 0
    micro_batches: int = 0
    cycles: int = 0
    speedup_ratio: float = _NAN
    backward_seconds: float = 0.0
    predict_seconds: float = 0.0
    wallclock_speedup: float = _NAN
    full_length: int = 0
    predict_length: int = 0
    mean_loss: dict = field(default_factory=dict)
    corrections: int = 0
    correction_resets: int = 0
    mean_prediction_error: float = _NAN
    mean_prediction_cosine: float = _NAN
    prediction_gain: float = 1.0
    clipped_steps: int = 0
    predictor_bytes: int = 0
    history_storage: str = "float32"
    history_bytes: int = 0

    def to_dict(self) -> dict:
        """Plain dict (JSON-ready)."""
        return asdict(self)


def make_phase_trainer(param_shapes, config: PhaseConfig):
    """A :class:`PhaseTrainer` if ``config.enabled``, else None (plain full backprop)."""
    if not isinstance(config, PhaseConfig):
        raise TypeError(f"config: must be a PhaseConfig, got {type(config).__name__}")
    return PhaseTrainer(param_shapes, config) if config.enabled else None


class PhaseTrainer:
    """Decides per step whether to run a backward pass, and supplies the gradient to apply.

    Args:
        param_shapes: list of ``(name, shape)``; gradients are dicts name -> float32 array of
            that shape (validated: ``ValueError`` naming the parameter; NaN/inf rejected with
            nothing applied).
        config: :class:`~qatlab.config.PhaseConfig`, validated and copied (``enabled`` is not
            consulted here: see :func:`make_phase_trainer`).
    Returned gradient dicts are views of internal float32 buffers, overwritten by the next
    step; pass ``out=`` (a dict of arrays, or one flat float32 (n,) array in ``layout`` order)
    to have them copied instead.
    """

    def __init__(self, param_shapes, config: PhaseConfig | None = None):
        config = PhaseConfig() if config is None else config
        if not isinstance(config, PhaseConfig):
            raise TypeError(f"config: must be a PhaseConfig, got {type(config).__name__}")
        config.validate()
        self._config = config.copy()
        c = self._config   # plain copies of what every step reads (a Param attribute read is slow)
        self._warmup_steps, self._correct_every = int(c.warmup_steps), int(c.correct_every)
        self._first_spacing = min(int(c.first_correct_every), self._correct_every)
        self._accumulation, self._max_grad_norm = int(c.gradient_accumulation), float(c.max_grad_norm)
        self._layout = ParamLayout(param_shapes)
        n = self._layout.size
        self._real = np.zeros(n, dtype=np.float32)   # staging: step's real gradient (mean of micro-batches)
        self._pred = np.zeros(n, dtype=np.float32)   # prediction on CORRECT steps / apply_correction
        self._out = np.zeros(n, dtype=np.float32)    # clipped gradient handed out as dict views
        self._out_views = self._layout.views(self._out)
        self._predictor = make_predictor(c.predictor, n, c.prediction, make_history(c, self._layout))
        self._checked_run_args = (None, None, None)   # predicted_steps' (opt, params, out) once checked
        # predict_block_run's kernel buffers (named slots and columns: qatlab.kernels.fused)
        self._block_result, self._block_state = np.zeros(len(BLOCK_RESULT)), np.zeros(len(PREDICTOR_STATE))
        self._corrections = np.zeros((0, len(CORRECTION_COLUMNS)))
        self._row_out = np.zeros((0, len(ROW_COLUMNS)))
        self.reset()

    # ------------------------------------------------------------------ state
    def reset(self) -> None:
        """Back to the state of a new trainer: configured lengths, empty history, zero counters."""
        c = self._config
        self._full_len, self._predict_len = int(c.full_steps), int(c.predict_steps)
        self._segment = TrainingPhase.WARMUP if c.warmup_steps > 0 else TrainingPhase.FULL
        self._pos = 0
        self._spacing = self._first_spacing   # CORRECT spacing now (the ramp; module doc)
        self._next_correct = self._spacing    # block position of the next CORRECT step
        self._ramp_block = False              # the predict block in progress began on the ramp
        self._prev_phase = None
        self._in_step = False
        self._info = None
        self._micro = 0
        self._grad_ready = self._pred_ready = False
        self._t0 = 0.0
        self._falling = 0
        self._cycle_loss = [[0.0, 0], [0.0, 0]]   # FULL, predict block: loss sum, count
        self._counts = [0, 0, 0, 0]          # indexed by TrainingPhase code
        self._total = 0
        self._loss_sums = [0.0, 0.0, 0.0, 0.0]
        self._loss_counts = [0, 0, 0, 0]
        self._src = self._real                # array holding the step's gradient before clipping
        self._scale = 1.0                     # clipping factor applied when it is handed out
        self._seconds = [0.0, 0.0]       # backward steps, predict steps
        self._timed = [0, 0]
        self._micro_batches = self._cycles = self._clipped = 0
        self._corr_n = self._corr_resets = 0
        self._corr_err = self._corr_cos = 0.0
        self._last_correction = None
        self._last_norm = _NAN
        self._predictor.reset()

    @property
    def config(self) -> PhaseConfig:
        """A copy of the configuration in use."""
        return self._config.copy()

    @property
    def layout(self) -> ParamLayout:
        """Names, shapes and flat offsets of the parameters."""
        return self._layout

    @property
    def current_phase(self) -> TrainingPhase:
        """Phase of the step in progress, or of the next step between steps."""
        return self._info.phase if self._in_step else self._scheduled_phase()

    @property
    def total_step(self) -> int:
        """Completed steps."""
        return self._total

    @property
    def cycle_count(self) -> int:
        """Completed cycles (FULL run + predict block)."""
        return self._cycles

    @property
    def phase_lengths(self) -> tuple[int, int]:
        """Current (FULL length, predict-block length), changed by adaptation."""
        return self._full_len, self._predict_len

    @property
    def clip_scale(self) -> float:
        """The ``max_grad_norm`` factor of the step's gradient not applied yet: after the last
        ``record_full_gradients`` of a backward step (what :meth:`gradients_for_update` would
        multiply by) or after ``get_predicted_gradients(flat, clip=False)``; 1.0 otherwise."""
        return self._scale

    @property
    def lr_scale(self) -> float:
        """The factor for the optimizer's learning rate in the step in progress: the learned gain
        on a PREDICT step (see :meth:`get_predicted_gradients`), else 1.0."""
        if self._in_step and not self._info.needs_backward:
            return self._predictor.gain
        return 1.0

    @property
    def speedup_ratio(self) -> float:
        """total steps / backward steps (NaN before the first backward step)."""
        bwd = self._backward_steps()
        return self.total_step / bwd if bwd else _NAN

    @property
    def correction_count(self) -> int:
        """Corrections measured so far (CORRECT steps and :meth:`apply_correction` calls)."""
        return self._corr_n

    @property
    def last_correction(self) -> CorrectionResult | None:
        """The most recent correction measurement (None before the first)."""
        return self._last_correction

    def should_compute_full(self) -> bool:
        """Whether the step in progress (or the next step) runs a backward pass."""
        return self.current_phase.needs_backward

    # ------------------------------------------------------------------ schedule
    def _backward_steps(self) -> int:
        return self._total - self._counts[_PREDICT]

    def _segment_length(self, segment: TrainingPhase) -> float:
        if segment is TrainingPhase.WARMUP:
            return self._warmup_steps
        if segment is TrainingPhase.FULL:
            return self._full_len if self._full_len + self._predict_len > 0 else math.inf
        return self._predict_len

    def _scheduled_phase(self) -> TrainingPhase:
        if self._segment is TrainingPhase.PREDICT:      # the predict block
            return TrainingPhase.CORRECT if self._pos + 1 == self._next_correct else TrainingPhase.PREDICT
        return self._segment

    def _correct_indices(self, count: int) -> list[int]:
        """Indices (0-based, in order) of the CORRECT steps among the next ``count`` steps of the
        predict block in progress, as the ramp places them (module doc)."""
        found, at, spacing = [], self._next_correct, self._spacing
        while at <= self._pos + count:
            found.append(at - self._pos - 1)
            spacing = min(spacing + 1, self._correct_every)
            at += spacing
        return found

    def _advance(self) -> None:
        self._pos += 1
        if self._pos < self._segment_length(self._segment):
            return
        self._pos = 0
        if self._segment is not TrainingPhase.PREDICT:
            self._predictor.close_block()      # a WARMUP or FULL run is one block
        if self._segment is TrainingPhase.FULL and self._predict_len > 0:
            self._segment = TrainingPhase.PREDICT
            self._next_correct = self._spacing
            self._ramp_block = self._spacing < self._correct_every
            return
        if self._segment is not TrainingPhase.WARMUP:
            self._end_cycle()
        self._segment = TrainingPhase.FULL

    def _end_cycle(self) -> None:
        self._cycles += 1
        (sum_f, n_f), (sum_p, n_p) = self._cycle_loss
        self._cycle_loss = [[0.0, 0], [0.0, 0]]
        if not self._config.adaptive_phases or n_f == 0 or n_p == 0 or self._ramp_block:
            return
        loss_f, loss_p = sum_f / n_f, sum_p / n_p
        r = (loss_p - loss_f) / max(abs(loss_f), 1e-12)
        if r > self._config.loss_threshold:
            self._falling = 0
            self._resize(+1)
        elif r < 0:
            self._falling += 1
            if self._falling >= _FALLING_CYCLES:
                self._falling = 0
                self._resize(-1)
        else:
            self._falling = 0

    def _resize(self, direction: int) -> None:
        f0, p0 = self._config.full_steps, self._config.predict_steps
        f = self._full_len + direction * max(1, f0 // 4)
        p = self._predict_len - direction * max(1, p0 // 4)
        self._full_len = min(max(f, max(1, f0 // 2)), 2 * f0)
        self._predict_len = min(max(p, max(1, p0 // 2)), 2 * p0)

    # ------------------------------------------------------------------ per step
    def begin_step(self) -> StepInfo:
        """Start the next step and say what it is (see :class:`StepInfo`); starts its timer."""
        if self._in_step:
            raise RuntimeError("begin_step: the previous step was not ended (call end_step(loss))")
        phase = self._scheduled_phase()
        self._info = StepInfo(phase, self._pos, self._total, self._cycles, phase is not self._prev_phase,
                              phase is not TrainingPhase.PREDICT)
        self._in_step = True
        self._micro = 0
        self._grad_ready = self._pred_ready = False
        self._t0 = _clock()
        return self._info

    def _require_step(self, what: str, backward: bool) -> None:
        if not self._in_step:
            raise RuntimeError(f"{what}: call begin_step() first")
        if self._info.needs_backward != backward:
            kind = "a backward" if backward else "a PREDICT"
            raise RuntimeError(f"{what}: only on {kind} step; step {self._info.total_step} is "
                               f"{self._info.phase.name}")

    def record_full_gradients(self, grads: dict | np.ndarray) -> None:
        """Record one micro-batch's real gradients: a dict name -> float32 array, or one flat
        float32 (n,) array with every parameter in ``layout`` order (e.g. ``Gradients.flat()``).

        Call exactly ``gradient_accumulation`` times per backward step; the k-th call forms
        the step's gradient (mean of the k, summed in float32 and scaled by 1/k), measures and
        folds the prediction error on CORRECT steps, hands it to the predictor (anchor; block on
        WARMUP/FULL steps) and clips it for :meth:`gradients_for_update`. Bad gradients raise
        ``ValueError``, nothing recorded.
        """
        self._require_step("record_full_gradients", backward=True)
        k = self._accumulation
        if self._micro >= k:
            raise RuntimeError(f"record_full_gradients: already called gradient_accumulation={k} times this step")
        sumsq = None
        if isinstance(grads, np.ndarray) and k == 1:   # the fast path: one pass copies, checks, norms
            self._layout.check_flat(grads, finite=False)
            sumsq = copy_sum_squares(grads, self._real)
            if not math.isfinite(sumsq):
                self._layout.check_flat(grads)          # raises, naming the parameter
        else:
            if isinstance(grads, np.ndarray):
                flats, off = [self._layout.check_flat(grads)], (0, self._layout.size)
            else:
                flats, off = self._layout.check(grads), self._layout.offsets
            for t, g in enumerate(flats):
                seg = self._real[off[t]:off[t + 1]]
                if self._micro == 0:
                    seg[:] = g
                else:
                    np.add(seg, g, out=seg)
        self._micro += 1
        self._micro_batches += 1
        if self._micro == k:
            if k > 1:
                np.multiply(self._real, np.float32(1.0 / k), out=self._real)
            if sumsq is None:
                sumsq = sum_squares(self._real)
            self._finish_real_gradient(sumsq)

    def real_gradient_buffer(self) -> np.ndarray:
        """The flat float32 (n,) array (``layout`` order) the step's real gradient is recorded
        into. A caller that writes the gradient there itself (a fused kernel that copies and
        measures it while it updates: :class:`qatlab.train.fused_step.FusedStep` with ``stash=``) then calls
        :meth:`record_written`. A different array from one step to the next: ask every step."""
        return self._real

    def record_written(self, sumsq: float) -> None:
        """:meth:`record_full_gradients` for a gradient already written into
        :meth:`real_gradient_buffer`, with its float64 sum of squares ``sumsq`` (only with
        gradient_accumulation = 1). A non-finite ``sumsq`` raises ValueError, nothing recorded."""
        self._require_step("record_written", backward=True)
        if self._accumulation != 1:
            raise RuntimeError("record_written: only with gradient_accumulation = 1")
        if self._micro:
            raise RuntimeError("record_written: the step's gradient is already recorded")
        if not math.isfinite(sumsq):
            self._layout.check_flat(self._real)          # raises, naming the parameter
            raise NonFiniteError(f"sumsq: must be finite, got {sumsq}", "gradient norm", sumsq)
        self._micro = 1
        self._micro_batches += 1
        self._finish_real_gradient(sumsq)

    def _finish_real_gradient(self, sumsq: float) -> None:
        """The step's real gradient is in the staging buffer: on a CORRECT step measure and fold the
        prediction error, then make it the anchor and decide its clipping."""
        step, correct = self._info.total_step, self._info.phase is TrainingPhase.CORRECT
        if correct:
            self._predictor.predict(step, self._pred)
            self._note_correction(self._predictor.fold(self._real, self._pred, step))
        real = self._real     # becomes the anchor without a copy; the old anchor is the next staging buffer
        self._real = self._predictor.adopt(real, step, block=not correct)
        self._set_clip(real, sumsq)
        self._grad_ready = True

    def _note_correction(self, result: CorrectionResult) -> None:
        self._last_correction = result
        self._corr_n += 1
        self._corr_resets += int(result.reset)
        self._corr_err += result.relative_error
        self._corr_cos += result.cosine

    def _set_clip(self, src: np.ndarray, sumsq: float) -> None:
        """The step's gradient is ``src`` (global norm sqrt(sumsq)); decide its clipping factor."""
        norm = math.sqrt(sumsq)
        self._last_norm = norm
        self._src = src
        limit = self._max_grad_norm
        if limit > 0 and norm > limit:
            self._scale = limit / (norm + 1e-6)
            self._clipped += 1
        else:
            self._scale = 1.0

    def gradients_for_update(self, out: dict | np.ndarray | None = None) -> dict[str, np.ndarray] | np.ndarray:
        """The step's real gradient, clipped: dict name -> float32 array (views; see class doc).

        Only on backward steps, after ``gradient_accumulation`` calls of
        :meth:`record_full_gradients`.
        """
        self._require_step("gradients_for_update", backward=True)
        if not self._grad_ready:
            raise RuntimeError(f"gradients_for_update: record_full_gradients called {self._micro} of "
                               f"gradient_accumulation={self._config.gradient_accumulation} times")
        return self._hand_out(out)

    def _write(self, dst: np.ndarray) -> None:
        """dst = the step's gradient times its clipping factor (no-op if dst already holds it)."""
        if self._scale != 1.0:
            np.multiply(self._src, np.float32(self._scale), out=dst)
        elif dst is not self._src:
            np.copyto(dst, self._src)

    def _hand_out(self, out):
        if out is None:
            self._write(self._out)
            return dict(self._out_views)
        if isinstance(out, np.ndarray):
            self._write(self._layout.check_flat(out, "out", finite=False))
            return out
        self._write(self._out)
        return self._layout.copy_out(self._out, out)

    def get_predicted_gradients(self, out: dict | np.ndarray | None = None,
                                clip: bool = True) -> dict[str, np.ndarray] | np.ndarray:
        """The predicted gradient for this PREDICT step (correction included) times the
        predictor's learned gain (:mod:`qatlab.train.predictors`), clipped.

        Make the step at the learning rate times :attr:`lr_scale` (the gain): Adam's step hardly
        shrinks with its gradient (it divides by the root mean square of past gradients), so a
        gain applied to the gradient alone would leave Adam, and momentum SGD, coasting on their
        momentum. A gain of 0 (the predictions so far carry no signal) hands out zeros, which a
        caller should not give to its optimizer at all: ``run_experiment`` and
        :meth:`predicted_steps` make no update then, as an optimizer skips a parameter without a
        gradient.

        With ``out`` a flat float32 (n,) array the prediction is written straight into it (and
        clipped there, unless ``clip`` is False: then multiply by :attr:`clip_scale` yourself);
        each call recomputes it (deterministic), the clipping counts once a step.
        """
        self._require_step("get_predicted_gradients", backward=False)
        if isinstance(out, np.ndarray):    # predict straight into the caller's flat array
            dst = self._layout.check_flat(out, "out", finite=False)
        else:
            dst = self._out
        clipped = self._clipped
        gain = self._predictor.gain        # handed out: gain * prediction, then clipped
        self._set_clip(dst, self._predictor.predict_sumsq(self._info.total_step, dst) * gain * gain)
        self._scale *= gain
        if self._pred_ready:
            self._clipped = clipped        # a repeated call: the step was counted once already
        self._pred_ready = True
        if isinstance(out, np.ndarray) and not clip:
            return out
        if self._scale != 1.0:             # clip in place: dst now holds what is handed out
            np.multiply(dst, np.float32(self._scale), out=dst)
            self._scale = 1.0
        if isinstance(out, np.ndarray):
            return out
        return dict(self._out_views) if out is None else self._layout.copy_out(self._out, out)

    def backward_run_length(self) -> int:
        """How many of the next steps are WARMUP or FULL steps in a row (0 if the next one is
        PREDICT or CORRECT, a step is in progress, or gradient_accumulation > 1);
        :meth:`backward_run` can make them in one call."""
        if self._in_step or self._segment is TrainingPhase.PREDICT or self._accumulation != 1:
            return 0
        return int(min(self._segment_length(self._segment) - self._pos, 2 ** 31))

    def backward_run(self, count: int, make_steps) -> int:
        """Make up to ``count`` (<= :meth:`backward_run_length`) WARMUP/FULL steps through one call
        of ``make_steps(stash, accumulate, accumulate_fresh) -> (losses, sumsqs)``, and book them as
        begin_step / record_written(sumsqs[j]) / end_step(losses[j]) would each.

        ``make_steps`` makes the steps in order, each writing its real gradient into ``stash``
        (float32 (n), the last one stays) and adding it to ``accumulate`` (copying the first one
        when ``accumulate_fresh``), updating with it clipped to max_grad_norm, and returns their
        losses and gradients' float64 sums of squares: all ``count``, or up to the first step
        whose loss or gradient is not finite (it updated nothing). E.g.
        ``FusedStep.steps(X, idx, count, labels=y, stash=stash, clip=max_grad_norm,
        accumulate=accumulate, accumulate_fresh=accumulate_fresh)``.

        Returns the steps booked: the ones before the first non-finite loss (that step is left
        unbooked: the run diverged). A step with a finite loss and a non-finite gradient raises
        ValueError naming the parameter, as :meth:`record_written`.
        """
        if isinstance(count, bool) or not isinstance(count, int) or not 1 <= count <= self.backward_run_length():
            raise ValueError(f"count: expected 1 <= count <= backward_run_length() = {self.backward_run_length()}, "
                             f"got {count!r}")
        pred = self._predictor
        t0 = _clock()
        losses, sumsqs = make_steps(self._real, pred.block_sum, pred.block_count == 0)
        seconds = _clock() - t0
        losses, sumsqs = np.asarray(losses, np.float64).tolist(), np.asarray(sumsqs, np.float64).tolist()
        done = len(losses)
        while done and not (math.isfinite(losses[done - 1]) and math.isfinite(sumsqs[done - 1])):
            done -= 1
        real = self._real
        if done < len(losses) and math.isfinite(losses[done]):     # the gradient is not finite
            self._layout.check_flat(real)                           # raises, naming the parameter
            raise NonFiniteError(f"sumsq: must be finite, got {sumsqs[done]}", "gradient norm", sumsqs[done])
        if done:
            first = self._total
            self._real = pred.adopt_run(real, first, done)
            self._micro_batches += done
            limit = self._max_grad_norm          # the clipped steps before the last; _set_clip: the last
            self._clipped += sum(math.sqrt(v) > limit for v in sumsqs[:done - 1]) if limit > 0 else 0
            self._set_clip(real, sumsqs[done - 1])
            self._book_run(self._segment, done, losses[:done])
            self._seconds[0] += seconds
            self._timed[0] += done
        return done

    def predict_run_length(self) -> int:
        """How many of the next steps are PREDICT steps in a row (0 if the next one is not, or a
        step is in progress); :meth:`predicted_steps` can make them in one call."""
        if self._in_step or self._segment is not TrainingPhase.PREDICT:
            return 0
        j = self._pos + 1
        return min(self._next_correct, self._predict_len + 1) - j

    def predicted_steps(self, count: int, opt, params: np.ndarray, out: np.ndarray,
                        measure=None) -> float | None:
        """Make the next ``count`` (<= :meth:`predict_run_length`) PREDICT steps in one Numba call,
        each updating ``opt`` -- a :class:`qatlab.optim.Optimizer` over ``params``, one flat
        float32 (n,) array holding every parameter in ``layout`` order -- exactly as this would,
        losses unmeasured::

            for _ in range(count):
                self.begin_step()
                self.get_predicted_gradients(out, clip=False)
                if self.clip_scale != 0:        # 0: the gain is 0, no update (get_predicted_gradients)
                    opt.step(out, lr=opt.lr * self.lr_scale, grad_scale=self.clip_scale)
                self.end_step(None)

        ``out`` float32 (n,) is left holding the last prediction (unscaled). The time of the call
        counts as predicted-step seconds.

        ``measure``: None, or a function called first (timed with the steps) that returns the first
        step's loss on its batch, e.g. a forward pass for a metrics row: it is booked as that
        step's loss, as ``end_step(loss)`` would. If it is not finite, nothing is made or booked.
        Returns that loss (None without ``measure``).
        """
        if isinstance(count, bool) or not isinstance(count, int) or not 1 <= count <= self.predict_run_length():
            raise ValueError(f"count: expected 1 <= count <= predict_run_length() = {self.predict_run_length()}, "
                             f"got {count!r}")
        checked = self._checked_run_args      # the same three objects as last time: checked then
        if not (checked[0] is opt and checked[1] is params and checked[2] is out):
            self._layout.check_flat(out, "out", finite=False)
            if not (hasattr(opt, "is_over") and opt.is_over(self._layout.check_flat(params, "params", finite=False))):
                raise ValueError("opt: expected an Optimizer over exactly the flat array params")
            self._checked_run_args = (opt, params, out)
        pred = self._predictor
        if pred.anchor_step < 0:
            raise RuntimeError("predict: no real gradient recorded yet")
        t0 = _clock()
        loss = None if measure is None else float(measure())
        if loss is not None and not math.isfinite(loss):
            return loss
        ks, corr_scales = self._prediction_scalars(count)
        scs = np.zeros((count, 8))
        # gain 0: no update (see get_predicted_gradients), so no learning rates
        lrs = opt.fused_run_scalars(scs, lr_scale=pred.gain) if pred.gain != 0.0 else None
        clipped, norm, opt_norm = predicted_steps(pred.anchor, pred.trend, ks, pred.correction, corr_scales,
                                                  float(pred.gain), self._max_grad_norm, out,
                                                  tuple(Opt(*opt.fused_kernel())), params, scs)
        if lrs is not None:
            opt.fused_done(lrs[-1], opt_norm, count)
        self._clipped += clipped
        self._last_norm = norm
        self._seconds[1] += _clock() - t0
        self._timed[1] += count
        if loss is not None:
            self._book_run(TrainingPhase.PREDICT, 1, [loss])
            count -= 1
        if count:
            self._book_run(TrainingPhase.PREDICT, count)
        return loss

    def _prediction_scalars(self, count: int) -> tuple[np.ndarray, np.ndarray]:
        """Bring the predictor up to date; the k and correction scale of the predictions for the
        next ``count`` steps (float64 (count,) each)."""
        pred, first = self._predictor, self._total
        pred.prepare()
        return pred.steps_since_anchor_run(first, count), pred.correction_scale_run(first, count)

    def predict_block_length(self) -> int:
        """How many of the next steps :meth:`predict_block_run` can make in one call: the rest of the
        predict block, its CORRECT steps included, if gradient_accumulation is 1 (a run's CORRECT
        step is one batch) and a kernel can time the two kinds apart
        (:data:`qatlab.kernels.clock.AVAILABLE`), else its PREDICT steps in a row ahead
        (:meth:`predict_run_length`); 0 if the next step is not in a predict block, or a step is in
        progress."""
        if self._accumulation != 1 or not clock.AVAILABLE:
            return self.predict_run_length()
        if self._in_step or self._segment is not TrainingPhase.PREDICT:
            return 0
        return self._predict_len - self._pos

    def block_step_is_correct(self, j: int) -> bool:
        """Whether step j (0-based) of the next :meth:`predict_block_run` is a CORRECT step."""
        return j in self._correct_indices(j + 1)

    @property
    def row_out(self) -> np.ndarray:
        """float64 (rows, len(ROW_COLUMNS)): the last :meth:`predict_block_run`'s ``run.row_out`` (per row
        step: loss, nanoseconds since its kernel began, gain, gradient norm, optimizer updates made before it)."""
        return self._row_out

    @property
    def block_result(self) -> np.ndarray:
        """float64 (len(BLOCK_RESULT),): the kernel's results of the last :meth:`predict_block_run` (its
        ``run.result``), slot i named BLOCK_RESULT[i]."""
        return self._block_result

    def predict_block_run(self, count: int, make_steps, rows=()) -> tuple[list, list[dict]]:
        """Make the next ``count`` (<= :meth:`predict_block_length`) steps of the predict block through
        one call of ``make_steps(run: PredictBlock) -> steps made``, and book them as the per-step
        protocol would each. ``rows``: increasing step indices (0-based in the run) that log a metrics
        row; a PREDICT one measures its loss. E.g. ``make_steps = lambda run: fused.predict_block(X,
        idx, B, run, labels=y)`` (:meth:`qatlab.train.fused_step.FusedStep.predict_block`; its kernel's doc says
        what each step does).

        ``make_steps`` makes the PREDICT steps as :meth:`predicted_steps` does (into a flat float32
        (n,) array of its own) and each CORRECT step as record_written + end_step(loss) would: its
        real gradient into ``run.predictor.staging`` (this trainer's staging buffer), the update with it
        clipped to ``run.clip``, its prediction into ``run.pred`` and their comparison into
        ``run.scores``, the fold, and the staging buffer made the anchor; it writes the predictor's
        scalars into ``run.predictor.state`` and its numbers into ``run.result``, ``run.corrections`` and
        ``run.row_out`` (see the kernel). Time: the kernel's own clock splits the call; the Python
        before the kernel counts as predicted-step seconds, the booking after it as the CORRECT
        steps'.

        Returns (the losses of the steps made, None for a step that measured none -- if the run
        stopped at a step whose loss is not finite, that loss is appended: the step made nothing and
        is not booked, the run diverged; :meth:`step_metrics` as of each row step made, its
        prediction_gain and grad_norm those of that step). A CORRECT step with a finite loss and a
        non-finite gradient raises ValueError naming the parameter, as :meth:`record_written`, after
        the steps before it are booked. (Each metrics dict also holds ``corrections``: the CORRECT
        steps folded so far, :attr:`correction_count`.)
        """
        limit = self.predict_block_length()
        if isinstance(count, bool) or not isinstance(count, int) or not 1 <= count <= limit:
            raise ValueError(f"count: expected 1 <= count <= predict_block_length() = {limit}, got {count!r}")
        rows = np.asarray(rows, dtype=np.int64).reshape(-1)
        if len(rows) and not (rows[0] >= 0 and rows[-1] < count and (len(rows) == 1 or np.all(np.diff(rows) > 0))):
            raise ValueError(f"rows: expected increasing step indices in [0, {count}), got {rows.tolist()}")
        pred = self._predictor
        if pred.anchor_step < 0:
            raise RuntimeError("predict: no real gradient recorded yet")
        t0 = _clock()
        pred.prepare()
        first, pos, every = self._total, self._pos + 1, self._correct_every
        last_correct = (self._correct_indices(count) or [-1])[-1]   # its index in the run (-1: none)
        state, result = self._block_state, self._block_result
        pred.export_state(state)
        state[5], state[6] = self._spacing, self._next_correct      # the ramp, read by the kernel
        if len(self._corrections) < count:
            self._corrections = np.zeros((count, len(CORRECTION_COLUMNS)))
            self._row_out = np.zeros((count, len(ROW_COLUMNS)))
        run_anchor = pred.anchor
        predictor = Predictor(pred.anchor, self._real, pred.trend, pred.correction, self._pred, pred.scores, state)
        plan = BlockPlan(first, pos, every, pred.has_trend, *pred.fold_constants(), self._max_grad_norm,
                         self._max_grad_norm, rows)
        made = make_steps(PredictBlock(predictor, plan, result, self._corrections, self._row_out, count,
                                       max(last_correct, rows[-1] if len(rows) else -1, -1)))
        t_kernel = _clock()
        r = dict(zip(BLOCK_RESULT, result.tolist()))
        clipped, norm, loss, bad_gradient = r["clipped"], r["norm"], r["loss"], r["bad_gradient"]
        n_corr, correct_ns = int(r["corrections"]), r["correct_ns"]
        by_step = {int(c[0]): c[1:] for c in self._corrections[:n_corr].tolist()}
        row_steps = [int(j) for j in rows if j < made]
        row_at = dict(zip(row_steps, self._row_out[:len(row_steps)].tolist()))
        losses, metrics, booked = [None] * made, [], 0
        for j in sorted({*by_step, *row_at}):             # steps booked one by one: CORRECT ones and rows
            if j > booked:
                self._book_run(TrainingPhase.PREDICT, j - booked)
            if j in by_step:
                losses[j], sumsq, rel, cos, reset = by_step[j]
                self._micro_batches += 1
                self._clipped += 0 < self._max_grad_norm < math.sqrt(sumsq)
                self._note_correction(CorrectionResult(first + j, rel, cos, bool(reset)))
                self._book_run(TrainingPhase.CORRECT, 1, [losses[j]])
            else:                                         # a PREDICT step that measured its loss for a row
                losses[j] = row_at[j][0]
                self._book_run(TrainingPhase.PREDICT, 1, [losses[j]])
            booked = j + 1
            if j in row_at:
                row = dict(zip(ROW_COLUMNS, row_at[j]))
                metrics.append({**self.step_metrics(), "prediction_gain": row["gain"], "grad_norm": row["norm"],
                                "corrections": self._corr_n})
        if made > booked:
            self._book_run(TrainingPhase.PREDICT, made - booked)
        if n_corr % 2:                      # each CORRECT step made the staging buffer the anchor
            pred.import_state(state, self._real)
            self._real = run_anchor
        else:
            pred.import_state(state, run_anchor)
        self._clipped += int(clipped)
        if made:
            self._last_norm = norm
        if made < count:
            losses.append(loss)
            if bad_gradient:
                self._layout.check_flat(self._real)                 # raises, naming the parameter
                raise NonFiniteError("sumsq: must be finite, got a non-finite gradient", "gradient norm")
        correct_s = correct_ns * 1e-9
        if n_corr:
            self._seconds[0] += correct_s + (_clock() - t_kernel)
            self._timed[0] += n_corr
        if made > n_corr:
            self._seconds[1] += (t_kernel - t0) - correct_s if n_corr else _clock() - t0
            self._timed[1] += made - n_corr
        return losses, metrics

    def apply_correction(self, grads: dict) -> CorrectionResult:
        """Manual correction: fold real ``grads`` measured at the current step into the
        correction exactly as a CORRECT step does (without making them the anchor or counting a
        backward pass; an open block is closed first). Allowed on PREDICT steps and between steps."""
        if self._in_step and self._info.needs_backward:
            raise RuntimeError("apply_correction: not on a backward step (CORRECT steps correct themselves)")
        if self._predictor.count == 0:
            raise RuntimeError("apply_correction: no real gradient recorded yet")
        flats = self._layout.check(grads)
        self._predictor.close_block()
        off = self._layout.offsets
        for t, g in enumerate(flats):
            self._real[off[t]:off[t + 1]] = g
        step = self._info.total_step if self._in_step else self.total_step
        self._predictor.predict(step, self._pred)
        result = self._predictor.fold(self._real, self._pred, step)
        self._note_correction(result)
        self._pred_ready = False
        return result

    def end_step(self, loss: float | None) -> None:
        """Finish the step: record its (finite) loss and time, advance the schedule.

        ``loss=None`` means the step's loss was not measured (a PREDICT step that skipped its
        forward pass too); the loss means and the adaptive rule then use the measured steps.
        """
        if not self._in_step:
            raise RuntimeError("end_step: call begin_step() first")
        if loss is not None:
            try:
                loss = float(loss)
            except (TypeError, ValueError):
                raise ValueError(f"loss: must be a finite number or None, got {loss!r}") from None
            if not math.isfinite(loss):
                raise ValueError(f"loss: must be a finite number or None, got {loss}")
        phase, backward = self._info.phase, self._info.needs_backward
        if backward and not self._grad_ready:
            raise RuntimeError(f"end_step: step {self._info.total_step} is {phase.name}; call "
                               f"record_full_gradients gradient_accumulation times first")
        kind = 0 if backward else 1
        self._seconds[kind] += _clock() - self._t0
        self._timed[kind] += 1
        self._in_step = False
        self._book_run(phase, 1, None if loss is None else [loss])

    def _book_run(self, phase: TrainingPhase, count: int, losses: list[float] | None = None) -> None:
        """Count ``count`` finished steps of ``phase`` in a row, all in the current segment, and
        their losses (``losses``: one per step, added in order; None: not measured); advance the
        schedule past them."""
        code = phase.value
        self._counts[code] += count
        self._total += count
        if losses is not None:
            self._loss_sums[code] = _added(self._loss_sums[code], losses)
            self._loss_counts[code] += count
            if code:    # not WARMUP
                acc = self._cycle_loss[0 if code == _FULL else 1]
                acc[0] = _added(acc[0], losses)
                acc[1] += count
        self._prev_phase = phase
        if code == _CORRECT:        # the ramp: the next CORRECT step comes one step later than this one did
            self._spacing = min(self._spacing + 1, self._correct_every)
            self._next_correct = self._pos + 1 + self._spacing
        self._pos += count - 1
        self._advance()

    # ------------------------------------------------------------------ reporting
    def wallclock_speedup(self) -> float:
        """mean backward-step seconds * total steps / total seconds; NaN unless both kinds timed."""
        (s_b, s_p), (n_b, n_p) = self._seconds, self._timed
        if n_b == 0 or n_p == 0 or s_b + s_p <= 0:
            return _NAN
        return (s_b / n_b) * (n_b + n_p) / (s_b + s_p)

    def get_stats(self) -> TrainerStats:
        """A snapshot of the counters and measurements (:class:`TrainerStats`)."""
        c = self._counts
        n_corr = self._corr_n
        return TrainerStats(
            total_steps=self.total_step, warmup_steps=c[0], full_steps=c[1], predict_steps=c[2], correct_steps=c[3],
            backward_passes=self._backward_steps(), micro_batches=self._micro_batches, cycles=self._cycles,
            speedup_ratio=self.speedup_ratio, backward_seconds=self._seconds[0], predict_seconds=self._seconds[1],
            wallclock_speedup=self.wallclock_speedup(), full_length=self._full_len,
            predict_length=self._predict_len,
            mean_loss={p.label: (self._loss_sums[p] / n if (n := self._loss_counts[p]) else _NAN)
                       for p in TrainingPhase},
            corrections=n_corr, correction_resets=self._corr_resets,
            mean_prediction_error=self._corr_err / n_corr if n_corr else _NAN,
            mean_prediction_cosine=self._corr_cos / n_corr if n_corr else _NAN,
            prediction_gain=self._predictor.gain,
            clipped_steps=self._clipped, predictor_bytes=self._predictor.nbytes,
            history_storage=self._predictor.history.storage, history_bytes=self._predictor.history.nbytes)

    def step_metrics(self) -> dict[str, float]:
        """Flat row for a MetricsLog after :meth:`end_step` (all floats; NaN where unmeasured).

        phase: code of the last completed step; prediction_error / prediction_cosine: the most
        recent correction; grad_norm: global norm of the last gradient handed out, before clipping.
        """
        last = self._last_correction
        return {
            "phase": float(self._prev_phase) if self._prev_phase is not None else _NAN,
            "backward_passes": float(self._backward_steps()),
            "step_speedup": self.speedup_ratio,
            "wallclock_speedup": self.wallclock_speedup(),
            "prediction_error": last.relative_error if last else _NAN,
            "prediction_cosine": last.cosine if last else _NAN,
            "prediction_gain": self._predictor.gain,
            "grad_norm": self._last_norm,
            "full_length": float(self._full_len),
            "predict_length": float(self._predict_len),
        }
