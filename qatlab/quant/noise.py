"""Quantization-noise figures: mean squared noise, SQNR in dB, saturated fraction."""
from __future__ import annotations

import math


def sqnr_db(signal: float, noise: float) -> float:
    """10 log10(signal / noise): NaN for no signal, inf for no noise."""
    if signal == 0.0:
        return math.nan
    if noise == 0.0:
        return math.inf
    return 10.0 * math.log10(signal / noise)


def noise_stats(noise: float, saturated: int, signal: float, n: int) -> tuple[float, float, float]:
    """(mean squared error, SQNR dB, saturated share) from the sums of one noise/saturation pass."""
    return (noise / n if n else 0.0), sqnr_db(signal, noise), (saturated / n if n else 0.0)
