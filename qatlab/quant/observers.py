"""Min/max observers: the running range of a tensor (per-tensor or per-channel) and the scale it gives."""
from __future__ import annotations

import numpy as np

from ..diverged import NonFiniteError
from ..kernels import fakequant as K
from .checks import FLOAT32_EPS, SCALE_MAX, as_float32, channel_view


class MinMaxObserver:
    """Tracks the running min and max of what it observes (per-tensor, or per slice along ``axis``).

    ``calculate_qparams(qmin, qmax, symmetric)`` turns the range, always widened
    to include 0, into ``(scale, zero_point)`` exactly as PyTorch's observers do
    (float32 arithmetic, scale floored at float32 eps); the scale is also capped at
    :data:`~qatlab.quant.checks.SCALE_MAX`, where PyTorch's would overflow to inf (NaN output)::

        symmetric: scale = max(-min, max) / ((qmax - qmin) / 2),  zp = 0
        affine:    scale = (max - min) / (qmax - qmin),  zp = clamp(qmin - rint(min / scale), qmin, qmax)
    """

    def __init__(self, axis: int | None = None):
        if axis is not None and (isinstance(axis, bool) or not isinstance(axis, (int, np.integer))):
            raise TypeError(f"axis: must be None or an int, got {axis!r}")
        self.axis = axis
        self.reset()

    def reset(self) -> None:
        """Forget everything observed."""
        self.min_val = None
        self.max_val = None

    def _batch_range(self, x):
        x = as_float32(x)
        if x.size == 0:
            raise ValueError("x: cannot observe an empty array")
        if self.axis is None:
            lo, hi, finite = K.minmax(x.reshape(-1))
        else:
            view = channel_view(x, self.axis)
            lo, hi = np.empty(view.shape[1]), np.empty(view.shape[1])
            finite = K.minmax_pc(view, lo, hi)
        if not finite:
            raise NonFiniteError("x: observed data contains NaN or inf; the observer was left unchanged")
        return lo, hi

    def _combine(self, lo, hi):
        self.min_val = lo if self.min_val is None else np.minimum(self.min_val, lo)
        self.max_val = hi if self.max_val is None else np.maximum(self.max_val, hi)

    def observe(self, x) -> None:
        """Fold ``x`` (any shape; per-channel: slices along ``axis``) into the tracked range."""
        lo, hi = self._batch_range(x)
        if self.min_val is not None and np.shape(lo) != np.shape(self.min_val):
            raise ValueError(f"x: has {np.size(lo)} channels along axis {self.axis}, "
                             f"the observer has seen {np.size(self.min_val)}")
        self._combine(lo, hi)

    __call__ = observe

    def calculate_qparams(self, qmin: int, qmax: int, symmetric: bool):
        """``(scale, zero_point)``: floats/ints per-tensor, float32/int64 arrays (C,) per-channel."""
        if self.min_val is None:
            raise ValueError(f"{type(self).__name__}: no data observed yet; call observe(x) first")
        ints = all(isinstance(q, (int, np.integer)) and not isinstance(q, bool) for q in (qmin, qmax))
        if not ints or qmin >= qmax:
            raise ValueError(f"qmin, qmax: must be integers with qmin < qmax, got {qmin!r}, {qmax!r}")
        f32 = np.float32
        lo = np.minimum(np.asarray(self.min_val, dtype=f32), f32(0))
        hi = np.maximum(np.asarray(self.max_val, dtype=f32), f32(0))
        if symmetric:
            scale = np.clip(np.maximum(-lo, hi) / f32((qmax - qmin) / 2), f32(FLOAT32_EPS), f32(SCALE_MAX))
            zp = np.zeros(np.shape(scale), dtype=np.int64)
        else:
            with np.errstate(over="ignore"):      # hi - lo beyond float32: inf, capped to SCALE_MAX
                scale = np.clip((hi - lo) / f32(qmax - qmin), f32(FLOAT32_EPS), f32(SCALE_MAX))
            zp = np.clip(qmin - np.rint(lo / scale).astype(np.int64), qmin, qmax)
        if self.axis is None:
            return float(scale), int(zp)
        return scale.astype(f32), zp


class MovingAverageMinMaxObserver(MinMaxObserver):
    """Min/max as an exponential moving average: ``m += c * (batch_m - m)``; the first batch seeds it.

    The averages are kept in float64 (an accumulated statistic; ``c = 1`` keeps exactly the last
    batch's range), where PyTorch's observer keeps float32: after a few updates the scale can differ
    from PyTorch's by an ulp."""

    def __init__(self, averaging_constant: float = 0.01, axis: int | None = None):
        if isinstance(averaging_constant, bool) or not isinstance(averaging_constant, (int, float, np.number)):
            raise TypeError(f"averaging_constant: must be a number in (0, 1], got {averaging_constant!r}")
        if not (0.0 < float(averaging_constant) <= 1.0):
            raise ValueError(f"averaging_constant: must be in (0, 1], got {averaging_constant!r}")
        self.averaging_constant = float(averaging_constant)
        super().__init__(axis)

    def _combine(self, lo, hi):
        if self.min_val is None:
            self.min_val, self.max_val = lo, hi
        else:
            c = self.averaging_constant
            self.min_val = self.min_val + c * (lo - self.min_val)
            self.max_val = self.max_val + c * (hi - self.max_val)
