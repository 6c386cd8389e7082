r"""TernaryGradientAccumulator: accumulate gradients as packed trits, 2 bits per element.

Each :meth:`~TernaryGradientAccumulator.add` turns every tensor g (n_t,) into a scale s and
trits q in {-1, 0, +1} and stores the trits packed 4 per byte (16x less than float32)::

    stochastic (default):  s = max|g|;  q_i = sign(g_i) with probability |g_i| / s, else 0
                           => E[s q_i] = g_i  (unbiased, up to the 2^-24 draw resolution)
    deterministic:         q_i = sign(g_i) if |g_i| > ternary_threshold * mean|g|, else 0;
                           s = mean |g_i| over the non-zeros  (biased: small entries vanish)

After K = ``accumulation_steps`` adds, :meth:`ready_for_update` is True and
:meth:`get_accumulated` returns the estimate of the mean gradient::

    g_bar = sum_k s_k q_k / count

The random draws are counter based (:func:`qatlab.kernels.phase_kernels.draw`): the j-th
gradient added since :meth:`reset` uses key_j = draw(mix64(seed), j) and element i (global flat
index) uses draw(key_j, i). The same seed therefore gives bit-identical trits.
"""
from __future__ import annotations

import numpy as np

from ..config import TernaryConfig
from ..kernels.phase_kernels import accumulate_trits, draw, mix64, ternarize_stochastic, ternarize_threshold
from .predictors import ParamLayout


class TernaryGradientAccumulator:
    """Packed-trit gradient accumulator over a model's parameters (module doc).

    Args:
        param_shapes: list of ``(name, shape)``; gradients are dicts name -> float32 array.
        config: :class:`~qatlab.config.TernaryConfig` (validated and copied).
    Storage: ``packed`` uint8 (K, B) with B = sum_t ceil(n_t / 4), ``scales`` float32 (K, T).
    """

    def __init__(self, param_shapes, config: TernaryConfig | None = None):
        config = TernaryConfig() if config is None else config
        if not isinstance(config, TernaryConfig):
            raise TypeError(f"config: must be a TernaryConfig, got {type(config).__name__}")
        config.validate()
        self.config = config.copy()
        self.layout = ParamLayout(param_shapes)
        n_bytes = [(n + 3) // 4 for n in self.layout.sizes]
        self.byte_offsets = np.zeros(len(n_bytes) + 1, dtype=np.int64)
        np.cumsum(n_bytes, out=self.byte_offsets[1:])
        k = int(self.config.accumulation_steps)
        self.packed = np.zeros((k, int(self.byte_offsets[-1])), dtype=np.uint8)
        self.scales = np.zeros((k, len(n_bytes)), dtype=np.float32)
        self._out = None
        self._stream = np.uint64(mix64(np.uint64(self.config.seed)))
        self.reset()

    @property
    def capacity(self) -> int:
        """K = accumulation_steps."""
        return self.packed.shape[0]

    @property
    def count(self) -> int:
        """Gradients held (0..K)."""
        return self._count

    @property
    def nbytes(self) -> int:
        """Bytes really held: packed trits + scales (+ the float32 output buffer once used)."""
        out = 0 if self._out is None else self._out.nbytes
        return self.packed.nbytes + self.scales.nbytes + out

    @property
    def last_fractions(self) -> tuple[float, float, float]:
        """(negative, zero, positive) shares of the trits of the last add (NaN before one)."""
        return self._fractions

    def reset(self) -> None:
        """Drop the held gradients and restart the random stream (as if new)."""
        self._draws = 0
        self.clear()
        self._fractions = (float("nan"),) * 3

    def clear(self) -> None:
        """Drop the held gradients; the random stream continues (fresh draws next time)."""
        self._count = 0

    def ready_for_update(self) -> bool:
        """True once K gradients are held."""
        return self._count >= self.capacity

    def add(self, grads: dict) -> None:
        """Ternarize ``grads`` (dict name -> float32 array) into the next slot.

        Raises ``ValueError`` on bad gradients and ``RuntimeError`` if K are already held
        (call :meth:`get_accumulated`, then :meth:`clear`); nothing is stored on error.
        """
        flats = self.layout.check(grads)
        if self.ready_for_update():
            raise RuntimeError(f"add: already holds accumulation_steps={self.capacity} gradients; call clear()")
        row, key = self._count, np.uint64(draw(self._stream, self._draws))
        off, boff = self.layout.offsets, self.byte_offsets
        n_pos = n_neg = 0
        for t, g in enumerate(flats):
            packed = self.packed[row, boff[t]:boff[t + 1]]
            if self.config.stochastic_rounding:
                s, p, m = ternarize_stochastic(g, key, int(off[t]), packed)
            else:
                s, p, m = ternarize_threshold(g, float(self.config.ternary_threshold), packed)
            self.scales[row, t] = s
            n_pos, n_neg = n_pos + p, n_neg + m
        n = self.layout.size
        self._fractions = (n_neg / n, (n - n_pos - n_neg) / n, n_pos / n)
        self._count += 1
        self._draws += 1

    def get_accumulated(self, out: dict | None = None) -> dict[str, np.ndarray]:
        """sum_k s_k q_k / count per parameter: dict name -> float32 array of its shape.

        Without ``out`` the arrays are views of one internal buffer, overwritten by the next
        call; with ``out`` (dict name -> writable array) the values are copied there.
        """
        if self._count == 0:
            raise RuntimeError("get_accumulated: no gradient added since the last clear()")
        if self._out is None:
            self._out = np.zeros(self.layout.size, dtype=np.float32)
        off = self.layout.offsets
        for t in range(len(self.layout.names)):
            accumulate_trits(self.packed, self.scales, self._count, int(self.byte_offsets[t]), t,
                             self._out[off[t]:off[t + 1]])
        if out is not None:
            return self.layout.copy_out(self._out, out)
        return self.layout.views(self._out)
