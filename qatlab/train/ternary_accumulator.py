r"""TernaryGradientAccumulator: gradients kept as packed trits, 2 bits per element, and weighted sums of them.

Phase training's predictor keeps its trend entries (block-mean gradients) here when
``PhaseConfig.history_storage == "ternary"``: 16x less memory than float32 rows. Each
:meth:`~TernaryGradientAccumulator.write` turns every tensor g (n_t,) of a flat gradient into a
scale s and trits q in {-1, 0, +1}, stored packed 4 per byte::

    stochastic (default):  s = max|g|;  q_i = sign(g_i) with probability |g_i| / s, else 0
                           => E[s q_i] = g_i  (unbiased, up to the 2^-24 draw resolution)
    deterministic:         q_i = sign(g_i) if |g_i| > ternary_threshold * mean|g|, else 0;
                           s = mean |g_i| over the non-zeros  (biased: small entries vanish)

:meth:`~TernaryGradientAccumulator.weighted_sum` returns sum_k c_k s_k q_k, the predictor's
trend sum_i b_i G_i (:mod:`qatlab.train.predictors`).

The random draws are counter based (:func:`qatlab.kernels.phase_kernels.draw`): the j-th
gradient written since :meth:`reset` uses key_j = draw(mix64(seed), j) and element i (global flat
index) uses draw(key_j, i). The same seed therefore gives bit-identical trits.
"""
from __future__ import annotations

import numpy as np

from ..config import TernaryConfig
from ..kernels.phase_kernels import draw, mix64, ternarize_stochastic, ternarize_threshold, weighted_trits
from .predictors import ParamLayout


class TernaryGradientAccumulator:
    """``capacity`` rows of packed trits over a model's parameters (module doc).

    Args:
        capacity: rows held (the predictor's trend entries).
        param_shapes: list of ``(name, shape)``; rows are flat float32 gradients in that order.
        config: :class:`~qatlab.config.TernaryConfig` (validated and copied).
    Storage: ``packed`` uint8 (capacity, B) with B = sum_t ceil(n_t / 4), ``scales`` float32 (capacity, T).
    """

    storage = "ternary"

    def __init__(self, capacity: int, param_shapes, config: TernaryConfig | None = None):
        config = TernaryConfig() if config is None else config
        if not isinstance(config, TernaryConfig):
            raise TypeError(f"config: must be a TernaryConfig, got {type(config).__name__}")
        if isinstance(capacity, bool) or not isinstance(capacity, (int, np.integer)) or capacity < 1:
            raise ValueError(f"capacity: must be an int >= 1, got {capacity!r}")
        config.validate()
        self.config = config.copy()
        self.layout = ParamLayout(param_shapes)
        self.byte_offsets = np.zeros(len(self.layout.sizes) + 1, dtype=np.int64)
        np.cumsum([(n + 3) // 4 for n in self.layout.sizes], out=self.byte_offsets[1:])
        self.packed = np.zeros((int(capacity), int(self.byte_offsets[-1])), dtype=np.uint8)
        self.scales = np.zeros((int(capacity), len(self.layout.sizes)), dtype=np.float32)
        self._stochastic = bool(self.config.stochastic_rounding)
        self._threshold = float(self.config.ternary_threshold)
        self._stream = np.uint64(mix64(np.uint64(self.config.seed)))
        self.reset()

    @property
    def capacity(self) -> int:
        """Rows held."""
        return self.packed.shape[0]

    @property
    def nbytes(self) -> int:
        """Bytes held: packed trits + scales."""
        return self.packed.nbytes + self.scales.nbytes

    @property
    def last_fractions(self) -> tuple[float, float, float]:
        """(negative, zero, positive) shares of the trits of the last write (NaN before one)."""
        return self._fractions

    def reset(self) -> None:
        """Restart the random stream (as if new); the rows are left to be overwritten."""
        self._draws = 0
        self._fractions = (float("nan"),) * 3

    def write(self, slot: int, flat: np.ndarray) -> None:
        """Ternarize ``flat`` (float32 (n,), every parameter in layout order) into row ``slot``."""
        flat = self.layout.check_flat(flat, "flat")
        if not 0 <= slot < self.capacity:
            raise ValueError(f"slot: must be in [0, {self.capacity}), got {slot}")
        key = np.uint64(draw(self._stream, self._draws))
        off, boff = self.layout.offsets, self.byte_offsets
        n_pos = n_neg = 0
        for t in range(len(self.layout.sizes)):
            g, packed = flat[off[t]:off[t + 1]], self.packed[slot, boff[t]:boff[t + 1]]
            if self._stochastic:
                s, p, m = ternarize_stochastic(g, key, int(off[t]), packed)
            else:
                s, p, m = ternarize_threshold(g, self._threshold, packed)
            self.scales[slot, t] = s
            n_pos, n_neg = n_pos + p, n_neg + m
        n = self.layout.size
        self._fractions = (n_neg / n, (n - n_pos - n_neg) / n, n_pos / n)
        self._draws += 1

    def weighted_sum(self, coeffs: np.ndarray, out: np.ndarray) -> np.ndarray:
        """out (float32 (n,)) = sum_k coeffs[k] * row_k (float64 sums; rows with coeffs[k] == 0
        skipped); coeffs float64 (capacity,). Returns out."""
        off = self.layout.offsets
        for t in range(len(self.layout.sizes)):
            weighted_trits(self.packed, self.scales, coeffs, int(self.byte_offsets[t]), t, out[off[t]:off[t + 1]])
        return out
