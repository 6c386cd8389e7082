r"""Gradient predictors of phase training, their learned correction, and the parameter layout.

Every tensor of a model is one segment of a flat float32 vector of length ``n``
(:class:`ParamLayout`); predictors work on that flat vector.

A predictor keeps the last real gradients ``g_i`` (flat (n,)) with the steps ``t_i`` they
were computed at, and predicts the gradient at step ``t`` as a linear combination of
them plus a learned correction ``c`` (flat (n,)) that decays with its age::

    g_hat(t) = sum_i a_i(t) g_i + decay^(t - t_c) c          decay = history_decay

``momentum`` (last two real gradients g1 at t1, g2 at t2 < t1, k = t - t1)::

    g_hat(t) = g1 + m (k / (t1 - t2)) (g1 - g2)         m = momentum

  i.e. the trend (g1 - g2) per step, extrapolated k steps with gain m. One step after two
  consecutive real gradients (k = t1 - t2 = 1) this is exactly g1 + m (g1 - g2). With a single
  real gradient the prediction is g1.

``least_squares`` (the last ``history_size`` real gradients, x_i = t_i - t_newest <= 0)::

    per element, (a, b) = argmin sum_i w_i (g_i - a - b x_i)^2,  w_i = decay^(-x_i)
    g_hat(t) = a + b (t - t_newest)

  in closed form a_i(t) = w_i / W + w_i (x_i - xbar)(k - xbar) / Sxx with W = sum w,
  xbar = sum w x / W, Sxx = sum w (x - xbar)^2, k = t - t_newest.

Both extrapolate, so the prediction moves with the step count (for m > 0 and g1 != g2).
Extrapolating noisy minibatch gradients amplifies their noise by about ``m k``; the
clipping of :class:`~qatlab.train.phase.PhaseTrainer` bounds the result.

Correction (on CORRECT steps, :meth:`GradientPredictor.fold`), with ``p = g_hat(t)`` the
prediction above (decayed correction included) and ``a`` the real gradient::

    e = a - p,   relative error r = |e| / |a|,   cosine = a.p / (|a| |p|)
    r >  residual_threshold:  c = 0            (the learned residual is reset)
    r <= residual_threshold:  c = decay^(t - t_c) c + w e,   t_c = t     (w = correction_weight)

so c is an exponential average of the residual (a - sum_i a_i g_i) with weight w, and
every later prediction adds it, decayed by history_decay per step.
"""
from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np

from ..config import PredictionConfig
from ..kernels.phase_kernels import all_finite, combine_history, compare_vectors, fold_correction

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
                raise ValueError(f"{what}[{name!r}]: contains NaN or inf")
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
            raise ValueError(f"{what}{bad}: contains NaN or inf")
        return flat

    @property
    def shapes_by_name(self) -> dict[str, tuple]:
        """name -> shape."""
        return dict(zip(self.names, self.shapes))

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


class GradientPredictor:
    """Base predictor over flat float32 gradients of length ``size`` (see module doc).

    Holds ``capacity`` real gradients (ring buffer, float32 (capacity, size)) and the
    correction (float32 (size,)).
    """

    kind = "base"

    def __init__(self, size: int, config: PredictionConfig, capacity: int):
        self.config = config   # read here, once: the floats below are what the steps use
        self._momentum, self._decay = float(config.momentum), float(config.history_decay)
        self._weight, self._threshold = float(config.correction_weight), float(config.residual_threshold)
        self.size = int(size)
        self.history = np.zeros((capacity, self.size), dtype=F32)
        self.steps = np.full(capacity, -1, dtype=np.int64)
        self.correction = np.zeros(self.size, dtype=F32)
        self._scores = np.zeros(4, dtype=np.float64)
        self.reset()

    def reset(self) -> None:
        """Forget every real gradient and the correction."""
        self.count = 0          # real gradients held (<= capacity)
        self.head = 0           # next slot to write
        self.correction_step = -1   # step the correction was learned at; -1: none
        self.steps[:] = -1
        self.correction[:] = 0.0

    @property
    def nbytes(self) -> int:
        """Bytes of the arrays held (history, steps, correction)."""
        return self.history.nbytes + self.steps.nbytes + self.correction.nbytes

    @property
    def newest_step(self) -> int:
        """Step of the newest real gradient (-1 if none)."""
        return int(self.steps[(self.head - 1) % len(self.steps)]) if self.count else -1

    def _slots_newest_first(self) -> list[int]:
        cap = len(self.steps)
        return [(self.head - 1 - i) % cap for i in range(self.count)]

    def push(self, grad: np.ndarray, step: int) -> None:
        """Store the real gradient ``grad`` (float32 (size,)) computed at ``step`` (increasing)."""
        if self.count and step <= self.newest_step:
            raise ValueError(f"step: must increase, got {step} after {self.newest_step}")
        self.history[self.head] = grad
        self.steps[self.head] = step
        self.head = (self.head + 1) % len(self.steps)
        self.count = min(self.count + 1, len(self.steps))

    def coefficients(self, step: int) -> np.ndarray:
        """a_i(step) per ring slot, float64 (capacity,), 0 for empty slots."""
        raise NotImplementedError

    def correction_scale(self, step: int) -> float:
        """history_decay^(step - t_c), or 0.0 if no correction has been learned."""
        if self.correction_step < 0:
            return 0.0
        return self._decay ** (step - self.correction_step)

    def predict(self, step: int, out: np.ndarray) -> np.ndarray:
        """out (float32 (size,)) = g_hat(step), decayed correction included; returns out."""
        if self.count == 0:
            raise RuntimeError("predict: no real gradient recorded yet")
        combine_history(self.history, self.coefficients(step), self.correction,
                        self.correction_scale(step), out)
        return out

    def fold(self, actual: np.ndarray, predicted: np.ndarray, step: int) -> CorrectionResult:
        """Measure actual - predicted at ``step`` and fold it into the correction (module doc).

        actual, predicted float32 (size,); ``predicted`` must be :meth:`predict` (step).
        """
        compare_vectors(actual, predicted, self._scores)
        dot, aa, pp, ee = (float(v) for v in self._scores)
        if aa > 0:
            rel = math.sqrt(ee / aa)
        else:
            rel = 0.0 if ee == 0 else math.inf
        if aa > 0 and pp > 0:
            cos = dot / math.sqrt(aa * pp)
        else:
            cos = 1.0 if aa == pp == 0 else 0.0
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
    """g_hat(t) = g1 + m (k / (t1 - t2)) (g1 - g2); holds 2 real gradients (2 x size float32)."""

    kind = "momentum"

    def __init__(self, size: int, config: PredictionConfig):
        super().__init__(size, config, capacity=2)

    def coefficients(self, step: int) -> np.ndarray:
        c = np.zeros(len(self.steps))
        slots = self._slots_newest_first()
        if len(slots) == 1:
            c[slots[0]] = 1.0
            return c
        i1, i2 = slots
        t1, t2 = int(self.steps[i1]), int(self.steps[i2])
        gain = self._momentum * (step - t1) / (t1 - t2)
        c[i1] = 1.0 + gain
        c[i2] = -gain
        return c


class LeastSquaresPredictor(GradientPredictor):
    """Weighted per-element linear fit over the last history_size real gradients (module doc)."""

    kind = "least_squares"

    def __init__(self, size: int, config: PredictionConfig):
        super().__init__(size, config, capacity=int(config.history_size))

    def coefficients(self, step: int) -> np.ndarray:
        c = np.zeros(len(self.steps))
        slots = np.array(self._slots_newest_first())
        t_new = self.newest_step
        x = (self.steps[slots] - t_new).astype(np.float64)
        w = self._decay ** (-x)
        big_w = w.sum()
        xbar = (w * x).sum() / big_w
        sxx = (w * (x - xbar) ** 2).sum()
        coeff = w / big_w
        if sxx > 1e-300:
            coeff = coeff + w * (x - xbar) * ((step - t_new) - xbar) / sxx
        c[slots] = coeff
        return c


def make_predictor(kind: str, size: int, config: PredictionConfig) -> GradientPredictor:
    """The predictor named ``kind`` ("momentum" or "least_squares") over (size,) gradients."""
    if kind == "momentum":
        return MomentumPredictor(size, config)
    if kind == "least_squares":
        return LeastSquaresPredictor(size, config)
    raise ValueError(f"predictor: must be 'momentum' or 'least_squares', got {kind!r}")
