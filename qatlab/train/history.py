"""Where phase training's predictor keeps its trend entries (block-mean gradients): ``PhaseConfig.history_storage``::

    float32   4 n bytes per entry (n parameters)         the entries as they were
    ternary   sum_t ceil(n_t / 4) + 4 T (T tensors)      unbiased stochastic trits (or thresholded: ``ternary``)
    vsa       4 D (D = ``vsa.dimension``, whatever n)    a decoded hypervector, cosine ~0.89 / sqrt(1 + n / D)

Every store has ``capacity``, ``nbytes``, ``reset()``, ``write(slot, flat)`` and ``weighted_sum(coeffs, out)``.
"""
from __future__ import annotations

from ..config import PhaseConfig
from .predictors import FloatHistory, ParamLayout, trend_capacity
from .ternary_accumulator import TernaryGradientAccumulator
from .vsa import VSAGradientCompressor, VSAHistory

STORAGES = ("float32", "ternary", "vsa")
F32 = 4


def history_nbytes(config: PhaseConfig, tensor_sizes) -> int:
    """Bytes :func:`make_history` will hold for tensors of these element counts (the table above, plus
    VSA's combined bundle and coding scratch): what memory estimates use before anything is allocated."""
    capacity = trend_capacity(config.predictor, config.prediction)
    sizes = [int(n) for n in tensor_sizes]
    if config.history_storage == "ternary":
        return capacity * (sum((n + 3) // 4 for n in sizes) + F32 * len(sizes))
    if config.history_storage == "vsa":
        d = int(config.vsa.dimension)
        return capacity * F32 * d + F32 * d + VSAGradientCompressor.scratch_nbytes(d)
    return _float32_bytes(capacity, sizes)


def _float32_bytes(capacity: int, sizes) -> int:
    return capacity * F32 * sum(int(n) for n in sizes)


def history_summary(config: PhaseConfig, tensor_sizes) -> dict:
    """What the Phases tab shows: ``storage``, its ``bytes`` and the ``float32_bytes`` the same entries take as rows."""
    return {"storage": config.history_storage, "bytes": history_nbytes(config, tensor_sizes),
            "float32_bytes": _float32_bytes(trend_capacity(config.predictor, config.prediction), tensor_sizes)}


def make_history(config: PhaseConfig, layout: ParamLayout):
    """The trend-entry store ``config.history_storage`` names, sized for ``config.predictor`` and ``layout``."""
    capacity = trend_capacity(config.predictor, config.prediction)
    param_shapes = list(zip(layout.names, layout.shapes))
    storage = config.history_storage
    if storage == "ternary":
        return TernaryGradientAccumulator(capacity, param_shapes, config.ternary)
    if storage == "vsa":
        return VSAHistory(capacity, param_shapes, config.vsa)
    if storage == "float32":
        return FloatHistory(capacity, layout.size)
    raise ValueError(f"history_storage: must be one of {list(STORAGES)}, got {storage!r}")
