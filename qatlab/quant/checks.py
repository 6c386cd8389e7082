"""Input checks and buffers shared by the quantizers: float32 arrays, integer ranges, scales, zero-points."""
from __future__ import annotations

import math

import numpy as np
import param

from .ste import SteKind

FLOAT32_EPS = float(np.finfo(np.float32).eps)


def as_float32(x, name: str = "x") -> np.ndarray:
    """``x`` as a C-contiguous float32 array (converted from ints/floats; other dtypes rejected)."""
    arr = np.asarray(x)
    if arr.dtype == np.float32 and arr.flags.c_contiguous:
        return arr
    if arr.dtype.kind not in "fiub":
        raise TypeError(f"{name}: expected a real numeric array, got dtype {arr.dtype}")
    return np.ascontiguousarray(arr, dtype=np.float32)


def integer_range(bits: int, symmetric: bool, narrow_range: bool) -> tuple[int, int]:
    """(qmin, qmax) for the given settings; raises ``ValueError`` for a range with one level."""
    if not 1 <= bits <= 16:
        raise ValueError(f"bits: must be an integer in 1..16, got {bits!r}")
    if symmetric:
        qmax = 2 ** (bits - 1) - 1
        qmin = -qmax if narrow_range else -(2 ** (bits - 1))
    else:
        qmin, qmax = (1 if narrow_range else 0), 2**bits - 1
    if qmax <= qmin:
        raise ValueError(f"bits: {bits}-bit {'narrow ' if narrow_range else ''}"
                         f"{'symmetric' if symmetric else 'affine'} range [{qmin}, {qmax}] has one level; "
                         "use narrow_range=False or more bits")
    return qmin, qmax


#: The scales float32 holds with a finite inverse and finite levels: at least the smallest normal
#: float32 (a subnormal s loses bits and 1/s overflows), at most FLT_MAX / 2^16 (every level
#: (q - zp) s of a 16-bit range stays finite).
SCALE_MIN = float(np.finfo(np.float32).tiny)
SCALE_MAX = float(np.finfo(np.float32).max) / 2.0**16


def check_scale(scale) -> np.ndarray:
    raw = np.asarray(scale)  # strings, None, objects: rejected below with a message naming the field
    arr = raw.astype(np.float64) if raw.dtype.kind in "fiu" else np.full(raw.shape, np.nan)
    if arr.ndim > 1 or arr.size == 0 or not np.all((arr >= SCALE_MIN) & (arr <= SCALE_MAX)):
        raise ValueError(f"scale: must be a finite number > 0 that float32 holds, in [{SCALE_MIN:.4g}, "
                         f"{SCALE_MAX:.4g}] (or a 1-D array of them), got {scale!r}")
    return arr


def check_zero_point(zero_point, qmin: int, qmax: int) -> np.ndarray:
    arr = np.asarray(zero_point)
    integral = arr.dtype.kind in "iu" or (
        arr.dtype.kind == "f" and np.all(np.isfinite(arr)) and np.all(arr == np.round(arr)))
    if arr.ndim > 1 or arr.size == 0 or not integral:
        raise ValueError(f"zero_point: must be an integer (or a 1-D array of them), got {zero_point!r}")
    if np.any(arr < qmin) or np.any(arr > qmax):
        raise ValueError(f"zero_point: must lie in the integer range [{qmin}, {qmax}], got {zero_point!r}")
    return arr.astype(np.int64)


class SteParameter(param.Selector):
    """A Selector over SteKind that also accepts the string names."""

    def __init__(self, default=SteKind.IDENTITY, **kw):
        super().__init__(default=SteKind(default), objects=list(SteKind), **kw)

    def __set__(self, obj, val):
        super().__set__(obj, SteKind(val))


class ScaleParameter(param.Number):
    """Scale: a finite number > 0 (per-tensor, rendered as a number widget) or a 1-D array (per-channel)."""

    def _validate(self, val):
        check_scale(val)


class ZeroPointParameter(param.Integer):
    """Zero-point: an integer (per-tensor) or a 1-D integer array (per-channel); range checked by the owner."""

    def _validate(self, val):
        check_zero_point(val, -(2**16), 2**16)


def is_f32(a) -> bool:
    """True for a C-contiguous float32 ndarray (the fast path needs no conversion)."""
    return type(a) is np.ndarray and a.dtype == np.float32 and a.flags.c_contiguous


def out_buffer(out, shape, name):
    if out is None:
        return np.empty(shape, dtype=np.float32)
    if not isinstance(out, np.ndarray) or out.dtype != np.float32 or out.shape != shape \
            or not out.flags.c_contiguous:
        raise ValueError(f"{name}: must be a C-contiguous float32 array of shape {shape}")
    return out


def channel_view(x: np.ndarray, axis: int) -> np.ndarray:
    """View of C-contiguous ``x`` as (outer, C, inner) for quantization along ``axis``."""
    if not -x.ndim <= axis < x.ndim:
        raise ValueError(f"axis: {axis} is out of range for an array of shape {x.shape}")
    axis %= x.ndim
    outer = math.prod(x.shape[:axis])       # math.prod: np.prod costs ~10 us per call on the hot path
    inner = math.prod(x.shape[axis + 1:])
    return x.reshape(outer, x.shape[axis], inner)
