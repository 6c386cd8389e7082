r"""Gradient predictors of phase training, their learned correction, and the parameter layout.

Every tensor of a model is one segment of a flat float32 vector of length ``n``
(:class:`ParamLayout`); predictors work on that flat vector.

What a predictor holds (all flat float32 (n,))::

    g1 at t1            the anchor: the newest real gradient (every real gradient replaces it)
    G_i at T_i          trend entries: the mean of the real gradients of one *block*, at the
                        block's mean step T_i = mean of its steps (T_1 newest, increasing in time),
                        kept in a history store: float32 rows (:class:`FloatHistory`, exact), packed
                        trits or VSA hypervectors (``PhaseConfig.history_storage``, :mod:`qatlab.train.history`)
    c at t_c            the learned correction

A block is a run of real gradients the caller groups together (:meth:`GradientPredictor.push`
with ``block=True``, closed by :meth:`GradientPredictor.close_block` or by the next prediction).
:class:`~qatlab.train.phase.PhaseTrainer` makes every WARMUP run and every FULL run one block;
a CORRECT step's gradient replaces the anchor and feeds the correction but opens no block. Why:
two consecutive minibatch gradients differ mostly by minibatch noise, so extrapolating their
difference k steps amplifies noise by ~m k; the difference of two block means is the trend of the
gradient between blocks with the noise averaged out, while the anchor keeps the prediction as
fresh as the newest real gradient.

Every prediction has the form (k = t - t1 steps since the anchor, decay = history_decay)::

    g_hat(t) = g1 + k S + decay^(t - t_c) c,      S = sum_i b_i G_i   (the trend per step)

S is computed when a block closes (float64 sums, stored as float32), so a prediction reads
three vectors whatever the predictor.

``momentum`` (the two newest trend entries G1 at T1 > G2 at T2; m = momentum)::

    g_hat(t) = g1 + m (k / (T1 - T2)) (G1 - G2)

  i.e. the per-step trend between the two newest block means, extrapolated k steps from the
  anchor with gain m. When blocks are single gradients at consecutive steps (G1 = g1, G2 = g2,
  T1 - T2 = 1), one step ahead (k = 1) this is exactly g1 + m (g1 - g2). With fewer than two
  trend entries the prediction is g1 (plus the correction).

``least_squares`` (the last ``history_size`` trend entries, x_i = T_i - T_newest <= 0)::

    per element, (a, b) = argmin sum_i w_i (G_i - a - b x_i)^2,  w_i = decay^(-x_i)
    g_hat(t) = g1 + b k

  the slope in closed form b = sum_i b_i G_i, b_i = w_i (x_i - xbar) / Sxx, with W = sum w,
  xbar = sum w x / W, Sxx = sum w (x - xbar)^2 (no trend while Sxx = 0, e.g. one entry).

Both move with the step count k (for a non-zero trend).

Correction (on CORRECT steps, :meth:`GradientPredictor.fold`), with ``p = g_hat(t)`` the
prediction above (decayed correction included) and ``a`` the real gradient::

    e = a - p,   relative error r = |e| / |a|,   cosine = a.p / (|a| |p|)
    r >  residual_threshold:  c = 0            (the learned residual is reset)
    r <= residual_threshold:  c = decay^(t - t_c) c + w e,   t_c = t     (w = correction_weight)

so c is an exponential average of the residual with weight w, and every later prediction
adds it, decayed by history_decay per step.

Gain (``learned_gain``, on by default): every correction also adds ``a.p`` and ``p.p`` to
running sums over all corrections since the last reset, and the gradient handed out is
``gain * g_hat(t)`` with::

    gain = clamp(sum a.p / sum p.p, 0, 1)         (1 before the first correction)

the least-squares scale of the predictions against the real gradients measured so far: 1 when
they point where the real gradients go, 0 when they do not (or point away). ``predict`` still
returns g_hat(t) unscaled (what ``fold`` measures); :class:`~qatlab.train.phase.PhaseTrainer`
applies the gain, and the predicted step is made at learning rate ``gain * lr``
(:attr:`~qatlab.train.phase.PhaseTrainer.lr_scale`): Adam divides by the root mean square of past
gradients, so a gain on the gradient alone hardly shrinks its step and it keeps moving along its
momentum. At gain 0 a predicted step makes no update at all. Without the gain the predictions
point away from the real gradients on average and cost test accuracy (``python -m qatlab.bench
phase``, the ``learned_gain off`` row).
"""
from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np

from ..config import PredictionConfig
from ..diverged import NonFiniteError
from ..kernels.phase_kernels import (all_finite, anchor_trend, clamp01, compare_vectors, fold_correction,
                                     relative_error_cosine, weighted_rows)

F32 = np.float32


class ParamLayout:
    """Names, shapes and flat offsets of a model's parameters (one float32 segment each).

    Args:
        param_shapes: list of ``(name, shape)``; names unique non-empty strings, shapes
            tuples of ints >= 1 (``()`` is a scalar).
    Attributes: ``names``, ``shapes``, ``sizes``, ``offsets`` (int64 (T+1,)), ``size`` (n).
    """

    def __init__(self, param_shapes):
        try:
            items = [(name, tuple(shape)) for name, shape in param_shapes]
        except (TypeError, ValueError):
            raise ValueError(f"param_shapes: must be a list of (name, shape), got {param_shapes!r}") from None
        if not items:
            raise ValueError("param_shapes: must name at least one parameter")
        for name, shape in items:
            if not isinstance(name, str) or not name:
                raise ValueError(f"param_shapes: names must be non-empty strings, got {name!r}")
            if not all(isinstance(d, (int, np.integer)) and not isinstance(d, bool) and d >= 1 for d in shape):
                raise ValueError(f"param_shapes[{name!r}]: dimensions must be ints >= 1, got {shape}")
        names = [name for name, _ in items]
        if len(set(names)) != len(names):
            raise ValueError(f"param_shapes: duplicate names in {names}")
        self.names = names
        self._known = frozenset(names)
        self.shapes = [tuple(int(d) for d in shape) for _, shape in items]
        self.sizes = [math.prod(shape) for shape in self.shapes]
        self.offsets = np.zeros(len(items) + 1, dtype=np.int64)
        np.cumsum(self.sizes, out=self.offsets[1:])
        self.size = int(self.offsets[-1])

    def check(self, grads, what: str = "grads") -> list[np.ndarray]:
        """Validate a dict name -> float32 array of the declared shape, all finite.

        Returns the flat (n_t,) views in layout order; raises ``ValueError`` naming the
        parameter (missing/unknown names, dtype, both shapes, non-finite values).
        """
        if not isinstance(grads, dict):
            raise ValueError(f"{what}: must be a dict name -> ndarray, got {type(grads).__name__}")
        missing = [n for n in self.names if n not in grads]
        unknown = [n for n in grads if n not in self._known]
        if missing or unknown:
            raise ValueError(f"{what}: missing {missing}, unknown {unknown}; expected {self.names}")
        flats = []
        for name, shape in zip(self.names, self.shapes):
            g = grads[name]
            if not isinstance(g, np.ndarray) or g.dtype != F32:
                kind = g.dtype if isinstance(g, np.ndarray) else type(g).__name__
                raise ValueError(f"{what}[{name!r}]: must be a float32 ndarray, got {kind}")
            if g.shape != shape:
                raise ValueError(f"{what}[{name!r}]: expected shape {shape}, got {g.shape}")
            flat = g.reshape(-1)
            if not all_finite(flat):
                raise NonFiniteError(f"{what}[{name!r}]: contains NaN or inf", f"gradient of {name}")
            flats.append(flat)
        return flats

    def check_flat(self, flat, what: str = "grads", finite: bool = True) -> np.ndarray:
        """Validate one flat float32 (n,) array holding every parameter in layout order (and,
        with ``finite``, that every value is finite); returns it."""
        if not isinstance(flat, np.ndarray) or flat.dtype != F32 or flat.shape != (self.size,):
            got = f"{flat.dtype} {flat.shape}" if isinstance(flat, np.ndarray) else type(flat).__name__
            raise ValueError(f"{what}: a flat array must be float32 of shape ({self.size},), got {got}")
        if finite and not all_finite(flat):
            bad = [n for n, v in self.views(flat).items() if not all_finite(v.reshape(-1))]
            raise NonFiniteError(f"{what}{bad}: contains NaN or inf", f"gradient of {', '.join(bad)}")
        return flat

    def views(self, flat: np.ndarray) -> dict[str, np.ndarray]:
        """name -> view of ``flat`` (n,) with the parameter's shape (shares memory)."""
        o = self.offsets
        return {name: flat[o[t]:o[t + 1]].reshape(shape)
                for t, (name, shape) in enumerate(zip(self.names, self.shapes))}

    def copy_out(self, flat: np.ndarray, out) -> dict[str, np.ndarray]:
        """Copy ``flat`` (n,) into the caller's arrays ``out`` (dict name -> writable array of
        the declared shape, any float dtype); returns ``out``."""
        if not isinstance(out, dict) or set(out) != set(self.names):
            raise ValueError(f"out: must be a dict with exactly the names {self.names}")
        for name, view in self.views(flat).items():
            if not isinstance(out[name], np.ndarray) or out[name].shape != view.shape:
                got = getattr(out[name], "shape", type(out[name]).__name__)
                raise ValueError(f"out[{name!r}]: expected shape {view.shape}, got {got}")
        for name, view in self.views(flat).items():
            out[name][...] = view
        return out


@dataclass(frozen=True)
class CorrectionResult:
    """One measured prediction error: ``relative_error`` = |a - p| / |a|, ``cosine`` =
    cos(a, p) (1 if both are 0, 0 if one is), ``reset`` True if the residual was reset."""

    step: int
    relative_error: float
    cosine: float
    reset: bool


class FloatHistory:
    """Trend entries as float32 rows (capacity, size): what the other history stores are measured against."""

    storage = "float32"

    def __init__(self, capacity: int, size: int):
        self.rows = np.zeros((capacity, size), dtype=F32)

    @property
    def capacity(self) -> int:
        return self.rows.shape[0]

    @property
    def nbytes(self) -> int:
        return self.rows.nbytes

    def reset(self) -> None:
        """Nothing to forget: rows are written before they are read."""

    def write(self, slot: int, flat: np.ndarray) -> None:
        """Row ``slot`` = flat (float32 (size,))."""
        self.rows[slot] = flat

    def weighted_sum(self, coeffs: np.ndarray, out: np.ndarray) -> np.ndarray:
        """out = sum_i coeffs[i] rows[i] (float64 sums, stored float32); returns out."""
        weighted_rows(self.rows, coeffs, out)
        return out


def trend_capacity(kind: str, config: PredictionConfig) -> int:
    """Trend entries the predictor ``kind`` holds: 2 (momentum) or ``history_size`` (least_squares)."""
    return 2 if kind == "momentum" else int(config.history_size)


class GradientPredictor:
    """Base predictor over flat float32 gradients of length ``size`` (see module doc).

    Holds the anchor (float32 (size,)), ``capacity`` trend entries (ring buffer in ``history``,
    a :class:`FloatHistory` unless another store is given; their steps float64 (capacity,)), the
    open block's sum (float32 (size,)) and the correction (float32 (size,)).
    """

    kind = "base"

    def __init__(self, size: int, config: PredictionConfig, capacity: int, history=None):
        self.config = config   # read here, once: the floats below are what the steps use
        self._momentum, self._decay = float(config.momentum), float(config.history_decay)
        self._weight, self._threshold = float(config.correction_weight), float(config.residual_threshold)
        self._learn_gain = bool(config.learned_gain)
        self.size = int(size)
        self.anchor = np.zeros(self.size, dtype=F32)
        self.history = FloatHistory(capacity, self.size) if history is None else history
        if self.history.capacity != capacity:
            raise ValueError(f"history: must hold {capacity} entries, holds {self.history.capacity}")
        self.steps = np.full(capacity, -1.0, dtype=np.float64)
        self.block_sum = np.zeros(self.size, dtype=F32)
        self.trend = np.zeros(self.size, dtype=F32)
        self.correction = np.zeros(self.size, dtype=F32)
        self.scores = np.zeros(4, dtype=np.float64)   # compare_vectors' a.p, a.a, p.p, e.e of the last fold
        self.reset()

    def reset(self) -> None:
        """Forget every real gradient, block and the correction."""
        self.count = 0          # trend entries held (<= capacity)
        self.head = 0           # next ring slot to write
        self.anchor_step = -1   # t1; -1: no real gradient yet
        self.block_count = 0    # real gradients in the open block
        self.block_steps = 0.0  # sum of their steps
        self.correction_step = -1   # step the correction was learned at; -1: none
        self.steps[:] = -1.0
        self.history.reset()
        self.correction[:] = 0.0
        self.has_trend = False  # trend = sum_i b_i G_i is set (non-zero coefficients)
        self._trend_stale = False   # a block closed since the trend was computed
        self._gain_num = self._gain_den = 0.0   # sums of a.p and p.p over the corrections
        self.gain = 1.0         # the factor the trainer applies to predictions (module doc)

    @property
    def nbytes(self) -> int:
        """Bytes of the arrays held (anchor, trend entries in their store and their steps, open block, trend,
        correction)."""
        return (self.anchor.nbytes + self.history.nbytes + self.steps.nbytes + self.block_sum.nbytes
                + self.trend.nbytes + self.correction.nbytes)

    @property
    def newest_step(self) -> int:
        """Step t1 of the newest real gradient (-1 if none)."""
        return self.anchor_step

    def _slots_newest_first(self) -> list[int]:
        cap = len(self.steps)
        return [(self.head - 1 - i) % cap for i in range(self.count)]

    def push(self, grad: np.ndarray, step: int, block: bool = True) -> None:
        """Record the real gradient ``grad`` (float32 (size,)) computed at ``step`` (increasing):
        it becomes the anchor and, with ``block``, joins the open block."""
        self._check_step(step)
        self.anchor[:] = grad
        self._after_push(step, block)

    def _check_step(self, step: int) -> None:
        if self.anchor_step >= 0 and step <= self.anchor_step:
            raise ValueError(f"step: must increase, got {step} after {self.anchor_step}")

    def fold_constants(self) -> tuple[float, float, float, bool]:
        """(history_decay, correction_weight, residual_threshold, learned_gain) as :meth:`fold` uses
        them: with :meth:`export_state`, what a kernel that predicts and folds needs
        (:func:`qatlab.kernels.fused.predict_block`)."""
        return self._decay, self._weight, self._threshold, self._learn_gain

    def export_state(self, out: np.ndarray) -> None:
        """out[:5] (float64) = (anchor_step, correction_step, gain, sum a.p, sum p.p)."""
        out[:5] = (self.anchor_step, self.correction_step, self.gain, self._gain_num, self._gain_den)

    def import_state(self, state: np.ndarray, anchor: np.ndarray) -> None:
        """The state a kernel left (:meth:`export_state`'s layout), with ``anchor`` its anchor array."""
        anchor_step, correction_step, self.gain, self._gain_num, self._gain_den = state[:5].tolist()
        self.anchor_step, self.correction_step, self.anchor = int(anchor_step), int(correction_step), anchor

    def adopt(self, grad: np.ndarray, step: int, block: bool) -> np.ndarray:
        """Like :meth:`push` but takes ``grad`` itself as the new anchor (no copy) and returns
        the previous anchor array for the caller to reuse."""
        self._check_step(step)
        old, self.anchor = self.anchor, grad
        self._after_push(step, block)
        return old

    def adopt_run(self, grad: np.ndarray, first_step: int, count: int) -> np.ndarray:
        """:meth:`adopt` of ``count`` real gradients at steps first_step, first_step + 1, ... of the
        open block, whose sum the caller already accumulated into :attr:`block_sum` (copying the
        first one when :attr:`block_count` was 0); ``grad`` is the last one. Returns the previous
        anchor array, as :meth:`adopt`."""
        self._check_step(first_step)
        old, self.anchor = self.anchor, grad
        self.anchor_step = int(first_step + count - 1)
        self.block_count += count
        self.block_steps += count * first_step + count * (count - 1) // 2   # the sum of their steps
        return old

    def _after_push(self, step: int, block: bool) -> None:
        self.anchor_step = int(step)
        if block:
            if self.block_count == 0:
                self.block_sum[:] = self.anchor
            else:
                np.add(self.block_sum, self.anchor, out=self.block_sum)
            self.block_count += 1
            self.block_steps += step

    def close_block(self) -> None:
        """Turn the open block (if any) into a trend entry: G = mean, T = mean step."""
        n = self.block_count
        if n == 0:
            return
        np.multiply(self.block_sum, np.float32(1.0 / n), out=self.block_sum)   # the sum restarts with the next block
        self.history.write(self.head, self.block_sum)
        self.steps[self.head] = self.block_steps / n
        self.head = (self.head + 1) % len(self.steps)
        self.count = min(self.count + 1, len(self.steps))
        self.block_count, self.block_steps = 0, 0.0
        self._trend_stale = True

    def _update_trend(self) -> None:
        coeffs = self.trend_coefficients()
        self.has_trend = any(c != 0.0 for c in coeffs.tolist())
        if self.has_trend:
            self.history.weighted_sum(coeffs, self.trend)
        self._trend_stale = False

    def trend_coefficients(self) -> np.ndarray:
        """b_i per ring slot (float64 (capacity,), 0 for empty slots): the trend per step is
        sum_i b_i G_i, computed (float64 sums, stored float32 in ``trend``) when a block closes."""
        raise NotImplementedError

    def correction_scale(self, step: int) -> float:
        """history_decay^(step - t_c), or 0.0 if no correction has been learned."""
        if self.correction_step < 0:
            return 0.0
        return self._decay ** (step - self.correction_step)

    def correction_scale_run(self, first: int, count: int) -> np.ndarray:
        """float64 (count,): :meth:`correction_scale` of steps first, first + 1, ... (the same floats)."""
        if self.correction_step < 0:
            return np.zeros(count)
        decay, age = self._decay, first - self.correction_step
        return np.array([decay ** (age + j) for j in range(count)])

    def predict(self, step: int, out: np.ndarray) -> np.ndarray:
        """out (float32 (size,)) = g_hat(step), decayed correction included; returns out.
        Closes the open block first."""
        self.predict_sumsq(step, out)
        return out

    def predict_sumsq(self, step: int, out: np.ndarray) -> float:
        """:meth:`predict` into ``out``; returns sum(out^2) (float64)."""
        if self.anchor_step < 0:
            raise RuntimeError("predict: no real gradient recorded yet")
        self.prepare()
        return anchor_trend(self.anchor, self.trend, self.steps_since_anchor(step), self.correction,
                            self.correction_scale(step), out)

    def prepare(self) -> None:
        """Close the open block and bring the trend up to date: then a prediction at step t is
        ``anchor_trend(anchor, trend, steps_since_anchor(t), correction, correction_scale(t))``."""
        self.close_block()
        if self._trend_stale:
            self._update_trend()

    def steps_since_anchor(self, step: int) -> float:
        """k of the prediction at ``step``: step - t1, or 0.0 while there is no trend (after :meth:`prepare`)."""
        return float(step - self.anchor_step) if self.has_trend else 0.0

    def steps_since_anchor_run(self, first: int, count: int) -> np.ndarray:
        """float64 (count,): :meth:`steps_since_anchor` of steps first, first + 1, ..."""
        if not self.has_trend:
            return np.zeros(count)
        return np.arange(first - self.anchor_step, first - self.anchor_step + count, dtype=np.float64)

    def fold(self, actual: np.ndarray, predicted: np.ndarray, step: int) -> CorrectionResult:
        """Measure actual - predicted at ``step``, fold it into the correction and (with
        ``learned_gain``) update :attr:`gain` (module doc; :func:`qatlab.kernels.fused.predict_block`
        folds its CORRECT steps the same way).

        actual, predicted float32 (size,); ``predicted`` must be :meth:`predict` (step).
        """
        compare_vectors(actual, predicted, self.scores)
        rel, cos = relative_error_cosine(self.scores)
        if self._learn_gain:
            self._gain_num += float(self.scores[0])
            self._gain_den += float(self.scores[2])
            if self._gain_den > 0:
                self.gain = clamp01(self._gain_num / self._gain_den)
        reset = rel > self._threshold
        if reset:
            self.correction[:] = 0.0
            self.correction_step = -1
        else:
            fold_correction(self.correction, self.correction_scale(step), actual, predicted,
                            self._weight)
            self.correction_step = step
        return CorrectionResult(step=step, relative_error=rel, cosine=cos, reset=reset)


class MomentumPredictor(GradientPredictor):
    """g_hat(t) = g1 + m (k / (T1 - T2)) (G1 - G2); holds 2 trend entries (module doc)."""

    kind = "momentum"

    def __init__(self, size: int, config: PredictionConfig, history=None):
        super().__init__(size, config, trend_capacity(self.kind, config), history)

    def trend_coefficients(self) -> np.ndarray:
        c = np.zeros(len(self.steps))
        if self.count < 2 or self._momentum == 0.0:
            return c
        i1, i2 = self._slots_newest_first()[:2]
        gain = self._momentum / (self.steps[i1] - self.steps[i2])
        c[i1], c[i2] = gain, -gain
        return c


class LeastSquaresPredictor(GradientPredictor):
    """g_hat(t) = g1 + b k, b the weighted least-squares slope over the last history_size trend
    entries (module doc)."""

    kind = "least_squares"

    def __init__(self, size: int, config: PredictionConfig, history=None):
        super().__init__(size, config, trend_capacity(self.kind, config), history)

    def trend_coefficients(self) -> np.ndarray:
        c = np.zeros(len(self.steps))
        if self.count < 2:
            return c
        slots = np.array(self._slots_newest_first())
        x = self.steps[slots] - self.steps[slots[0]]
        w = self._decay ** (-x)
        xbar = (w * x).sum() / w.sum()
        sxx = (w * (x - xbar) ** 2).sum()
        if sxx > 1e-300:
            c[slots] = w * (x - xbar) / sxx
        return c


def make_predictor(kind: str, size: int, config: PredictionConfig, history=None) -> GradientPredictor:
    """The predictor named ``kind`` ("momentum" or "least_squares") over (size,) gradients, its trend
    entries in ``history`` (a store of :func:`trend_capacity` entries; None: float32 rows)."""
    if kind == "momentum":
        return MomentumPredictor(size, config, history)
    if kind == "least_squares":
        return LeastSquaresPredictor(size, config, history)
    raise ValueError(f"predictor: must be 'momentum' or 'least_squares', got {kind!r}")
