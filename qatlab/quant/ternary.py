"""The ternary (absmean) quantizer: BitNet b1.58 trits in {-1, 0, +1} and one scale alpha."""
from __future__ import annotations

import math

import numpy as np
import param

from ..diverged import NonFiniteError
from ..kernels import fakequant as K
from ..runtime import parallel
from .checks import SteParameter, as_float32, is_f32, out_buffer
from .noise import noise_stats, sqnr_db
from .ste import SteKind

_ZERO, _ONE, _MINUS_ONE = np.float32(0.0), np.float32(1.0), np.float32(-1.0)


def ternary_quantize(w):
    """BitNet b1.58 absmean: ``alpha = mean|W|``, ``T = clamp(rint(W/alpha), -1, 1)``.

    ``w`` any shape -> (trits int8 of the same shape, alpha float). ``W/alpha`` is
    computed as ``W * float32(1/alpha)`` like every quantizer here; ``alpha`` is
    floored at float32 eps, so an all-zero W gives all-zero trits.
    """
    w = as_float32(w, "w")
    if w.size == 0:
        raise ValueError("w: cannot ternarize an empty array")
    alpha = _absmean(w)
    trits = np.empty(w.shape, dtype=np.int8)
    K.ternary_trits(w.reshape(-1), np.float32(1.0) / np.float32(alpha), trits.reshape(-1))
    return trits, alpha


def ternary_dequantize(trits, alpha: float) -> np.ndarray:
    """``alpha * T`` as float32, same shape as ``trits``."""
    return trits.astype(np.float32) * np.float32(alpha)


def _ternary_alpha(wv: np.ndarray) -> np.float32:
    """max(float32(mean|w|), eps) of w float32 (n,), n > 0 (NaN if w holds NaN/inf); the float64
    sum is taken in slices on the cores when w is large (:func:`qatlab.runtime.parallel.sum_slices`), the
    same way in training (TernaryQuantizer.forward) and in finalize (ternary_quantize)."""
    if wv.shape[0] < parallel.MIN_ELEMENTS:
        return K.ternary_alpha(wv)
    return K.alpha_of_abs_sum(parallel.sum_slices(K.abs_sum, wv), wv.shape[0])


def _absmean(w: np.ndarray) -> float:
    alpha = float(_ternary_alpha(w.reshape(-1)))
    if not math.isfinite(alpha):
        raise NonFiniteError("w: contains NaN or inf; cannot compute the absmean scale")
    return alpha


class TernaryQuantizer(param.Parameterized):
    """Ternary weight quantizer (absmean): fake quantization on the range [-1, 1] with ``s = alpha``.

    ``forward(w)`` recomputes ``alpha = mean|w|`` and returns ``alpha * T``;
    ``backward(g, w)`` applies the chosen STE with ``s = alpha`` and ``qmax = 1``
    (so ``u = w / alpha``), using the alpha of the last forward or quantize.
    """

    ste = SteParameter(SteKind.IDENTITY, doc="Straight-through estimator of the ternary projection.")

    def __init__(self, **params):
        super().__init__(**params)
        self.alpha = 1.0
        self._code = self.ste.code

    @param.depends("ste", watch=True)
    def _cache_ste(self):
        self._code = self.ste.code  # the hot path reads this plain attribute, not the Param

    @property
    def ste_code(self) -> int:
        """The STE's kernel code (:attr:`SteKind.code`), read without a Param lookup."""
        return self._code

    def _args(self):
        f32 = np.float32
        return f32(1.0) / f32(self.alpha), f32(self.alpha)

    def quantize(self, w):
        """(trits int8 same shape as w, alpha float); also stores alpha."""
        trits, self.alpha = ternary_quantize(w)
        return trits, self.alpha

    def forward(self, w, out=None) -> np.ndarray:
        """``alpha * clamp(rint(w/alpha), -1, 1)`` with alpha = mean|w|; float32, shape of w."""
        if not is_f32(w):
            w = as_float32(w, "w")
        if out is None or not is_f32(out) or out.shape != w.shape:
            out = out_buffer(out, w.shape, "out")
        if w.size == 0:
            raise ValueError("w: cannot ternarize an empty array")
        wv, outv = w.reshape(-1), out.reshape(-1)
        if w.size < parallel.MIN_ELEMENTS:
            alpha = K.ternary_forward(wv, outv)
        else:  # the scale from slice sums, the projection in slices
            alpha = _ternary_alpha(wv)
            if math.isfinite(alpha):
                f32 = np.float32
                scalars = (f32(1.0) / alpha, alpha, f32(0.0), f32(-1.0), f32(1.0))
                parallel.elementwise(K.fq_forward, (wv,), scalars, outv)
        if not math.isfinite(alpha):
            raise NonFiniteError("w: contains NaN or inf; cannot compute the absmean scale")
        self.alpha = alpha
        return out

    __call__ = forward

    def backward(self, grad_output, w, out=None) -> np.ndarray:
        """STE gradient w.r.t. the latent ``w`` (same shape as ``grad_output``), float32."""
        if not is_f32(w):
            w = as_float32(w, "w")
        g = grad_output if is_f32(grad_output) else as_float32(grad_output, "grad_output")
        if g.shape != w.shape:
            raise ValueError(f"grad_output: shape {g.shape} does not match w shape {w.shape}")
        if out is None or not is_f32(out) or out.shape != w.shape:
            out = out_buffer(out, w.shape, "out")
        if self._code == 0:  # identity: dx = g
            if out is not g:
                np.copyto(out, g)
            return out
        K.ternary_backward(w.reshape(-1), g.reshape(-1), self._code, self.alpha, out.reshape(-1))
        return out

    def fractions(self, w) -> tuple[float, float, float]:
        """Shares of -1, 0, +1 trits of ``w`` at the current alpha."""
        w = as_float32(w, "w")
        trits = np.empty(w.size, dtype=np.int8)
        K.ternary_trits(w.reshape(-1), self._args()[0], trits)
        counts = np.bincount(trits.astype(np.int64) + 1, minlength=3) / max(w.size, 1)
        return float(counts[0]), float(counts[1]), float(counts[2])

    def _stats(self, w):
        w = as_float32(w, "w")
        if w.size == 0:
            return 0.0, 0, 0.0, 0
        inv, s = self._args()
        noise, sat, signal = K.fq_noise_saturation(w.reshape(-1), inv, s, _ZERO, _MINUS_ONE, _ONE)
        return noise, sat, signal, w.size

    def quantization_noise(self, w) -> float:
        """mean((w - forward(w))^2) at the current alpha, float64; 0.0 for empty w."""
        noise, _, _, n = self._stats(w)
        return noise / n if n else 0.0

    def sqnr_db(self, w) -> float:
        """SQNR of the ternary projection at the current alpha, in dB (see FakeQuantize.sqnr_db)."""
        noise, _, signal, _ = self._stats(w)
        return sqnr_db(signal, noise)

    def saturation_fraction(self, w) -> float:
        """Share of latents with |w/alpha| rounding beyond 1 (clamped to +-1)."""
        _, sat, _, n = self._stats(w)
        return sat / n if n else 0.0

    def noise_stats(self, w) -> tuple[float, float, float]:
        """``(quantization_noise(w), sqnr_db(w), saturation_fraction(w))`` from one pass over w."""
        return noise_stats(*self._stats(w))
