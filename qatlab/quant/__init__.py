"""Stateful quantizers: FakeQuantize, min/max observers, the ternary (absmean) quantizer, SteKind.

The arithmetic lives in :mod:`qatlab.kernels.fakequant`; these modules check input, keep scale and
zero-point, and pick the kernel.
"""
from .checks import FLOAT32_EPS, SCALE_MAX, SCALE_MIN, as_float32, integer_range
from .fake_quantize import FakeQuantize
from .noise import noise_stats
from .observers import MinMaxObserver, MovingAverageMinMaxObserver
from .ste import STE_NAMES, SteKind
from .ternary import TernaryQuantizer, ternary_dequantize, ternary_quantize

__all__ = ["FLOAT32_EPS", "SCALE_MAX", "SCALE_MIN", "STE_NAMES", "FakeQuantize", "MinMaxObserver",
           "MovingAverageMinMaxObserver", "SteKind", "TernaryQuantizer", "as_float32", "integer_range",
           "noise_stats", "ternary_dequantize", "ternary_quantize"]
