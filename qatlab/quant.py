"""Stateful quantizers: FakeQuantize, min/max observers, the ternary (absmean) quantizer.

The arithmetic lives in :mod:`qatlab.kernels.fakequant`; this module checks
input, keeps scale and zero-point, and picks the kernel.

Integer ranges (``b`` = bits)::

    symmetric          [-2^(b-1), 2^(b-1) - 1]
    symmetric narrow   [-(2^(b-1) - 1), 2^(b-1) - 1]
    affine             [0, 2^b - 1]

``bits=1``: symmetric gives the two-level range ``[-1, 0]`` (levels ``-s`` and
0, as PyTorch's quant_min/quant_max would); symmetric *narrow* would leave one
level ``[0, 0]`` and is rejected; affine gives ``[0, 1]``.

STE normalisation. TANH and HARD_TANH shape the gradient by where ``x`` sits
inside the representable range, ``u = (x - c) / h``:

* symmetric: ``c = -zp*s`` (0 for the usual zp = 0) and ``h = qmax*s``, so
  ``u = x / (qmax*s)``; for the 1-bit range ``[-1, 0]`` (qmax = 0) ``h = s``.
* affine: ``c`` and ``h`` are the centre and half-width of ``float_range()``.

For the ternary range (2-bit narrow, qmax = 1) this is ``u = x/s``, the
literal formula of the STE reference. The general case divides by the range
rather than by ``s`` because ``x/s`` grows with the number of levels: at 8
bits ``x/s`` is ~127 at the edge of the range, so ``1 - tanh(x/s)^2`` would be
0 for every input but the few nearest zero and training would stall. Measured
in units of the range, the surrogate has the same shape at every bit width.
"""
from __future__ import annotations

import math

import numpy as np
import param

from . import parallel
from .diverged import NonFiniteError
from .kernels import fakequant as K
from .ste import SteKind

FLOAT32_EPS = float(np.finfo(np.float32).eps)


# ----------------------------------------------------------------------------- input checks

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


def _check_scale(scale) -> np.ndarray:
    raw = np.asarray(scale)  # strings, None, objects: rejected below with a message naming the field
    arr = raw.astype(np.float64) if raw.dtype.kind in "fiu" else np.full(raw.shape, np.nan)
    if arr.ndim > 1 or arr.size == 0 or not np.all((arr >= SCALE_MIN) & (arr <= SCALE_MAX)):
        raise ValueError(f"scale: must be a finite number > 0 that float32 holds, in [{SCALE_MIN:.4g}, "
                         f"{SCALE_MAX:.4g}] (or a 1-D array of them), got {scale!r}")
    return arr


def _check_zero_point(zero_point, qmin: int, qmax: int) -> np.ndarray:
    arr = np.asarray(zero_point)
    integral = arr.dtype.kind in "iub" or (
        arr.dtype.kind == "f" and np.all(np.isfinite(arr)) and np.all(arr == np.round(arr)))
    if arr.ndim > 1 or arr.size == 0 or not integral:
        raise ValueError(f"zero_point: must be an integer (or a 1-D array of them), got {zero_point!r}")
    if np.any(arr < qmin) or np.any(arr > qmax):
        raise ValueError(f"zero_point: must lie in the integer range [{qmin}, {qmax}], got {zero_point!r}")
    return arr.astype(np.int64)


class _SteParameter(param.Selector):
    """A Selector over SteKind that also accepts the string names."""

    def __init__(self, default=SteKind.IDENTITY, **kw):
        super().__init__(default=SteKind(default), objects=list(SteKind), **kw)

    def __set__(self, obj, val):
        super().__set__(obj, SteKind(val))


class _ScaleParameter(param.Number):
    """Scale: a finite number > 0 (per-tensor, rendered as a number widget) or a 1-D array (per-channel)."""

    def _validate(self, val):
        _check_scale(val)


class _ZeroPointParameter(param.Integer):
    """Zero-point: an integer (per-tensor) or a 1-D integer array (per-channel); range checked by the owner."""

    def _validate(self, val):
        _check_zero_point(val, -(2**16), 2**16)


# ----------------------------------------------------------------------------- observers

class MinMaxObserver:
    """Tracks the running min and max of what it observes (per-tensor, or per slice along ``axis``).

    ``calculate_qparams(qmin, qmax, symmetric)`` turns the range, always widened
    to include 0, into ``(scale, zero_point)`` exactly as PyTorch's observers do
    (float32 arithmetic, scale floored at float32 eps)::

        symmetric: scale = max(-min, max) / ((qmax - qmin) / 2),  zp = 0
        affine:    scale = (max - min) / (qmax - qmin),  zp = clamp(qmin - rint(min / scale), qmin, qmax)
    """

    def __init__(self, axis: int | None = None):
        if axis is not None and not isinstance(axis, (int, np.integer)):
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
            view = _channel_view(x, self.axis)
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
        f32 = np.float32
        lo = np.minimum(np.asarray(self.min_val, dtype=f32), f32(0))
        hi = np.maximum(np.asarray(self.max_val, dtype=f32), f32(0))
        if symmetric:
            scale = np.maximum(-lo, hi) / f32((qmax - qmin) / 2)
            scale = np.maximum(scale, f32(FLOAT32_EPS))
            zp = np.zeros(np.shape(scale), dtype=np.int64)
        else:
            scale = np.maximum((hi - lo) / f32(qmax - qmin), f32(FLOAT32_EPS))
            zp = np.clip(qmin - np.rint(lo / scale).astype(np.int64), qmin, qmax)
        if self.axis is None:
            return float(scale), int(zp)
        return scale.astype(f32), zp


class MovingAverageMinMaxObserver(MinMaxObserver):
    """Min/max as an exponential moving average: ``m += c * (batch_m - m)``; the first batch seeds it."""

    def __init__(self, averaging_constant: float = 0.01, axis: int | None = None):
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


def _channel_view(x: np.ndarray, axis: int) -> np.ndarray:
    """View of C-contiguous ``x`` as (outer, C, inner) for quantization along ``axis``."""
    if not -x.ndim <= axis < x.ndim:
        raise ValueError(f"axis: {axis} is out of range for an array of shape {x.shape}")
    axis %= x.ndim
    outer = math.prod(x.shape[:axis])       # math.prod: np.prod costs ~10 us per call on the hot path
    inner = math.prod(x.shape[axis + 1:])
    return x.reshape(outer, x.shape[axis], inner)


# ----------------------------------------------------------------------------- FakeQuantize

_RANGE_FIELDS = ("bits", "symmetric", "narrow_range", "zero_point")


class FakeQuantize(param.Parameterized):
    """Fake quantizer: ``y = (clamp(rint(x/s) + zp, qmin, qmax) - zp) * s`` with a selectable STE.

    Per-tensor when ``axis`` is None; per-channel (one scale and zero-point per
    slice along ``axis``) otherwise, with ``scale``/``zero_point`` 1-D arrays.
    ``forward`` matches ``torch.fake_quantize_per_tensor_affine`` /
    ``..._per_channel_affine`` bit for bit on finite input; NaN input gives NaN
    output (PyTorch clamps it to qmin), +-inf saturate.
    """

    bits = param.Integer(default=8, bounds=(1, 16), doc="Bit width (1..16).")
    symmetric = param.Boolean(default=True, doc="Signed range around 0, or affine [0, 2^b-1] with a zero-point.")
    narrow_range = param.Boolean(default=False, doc="Drop the most negative level (symmetric) / level 0 (affine).")
    scale = _ScaleParameter(default=1.0, doc="Step size s (finite, > 0); a 1-D array when per-channel.")
    zero_point = _ZeroPointParameter(default=0, doc="Integer that represents 0.0; a 1-D array when per-channel.")
    ste = _SteParameter(SteKind.CLIPPED_IDENTITY, doc="Straight-through estimator used by backward().")
    axis = param.Integer(default=None, allow_None=True, doc="None: per-tensor; int: per-channel along this axis.")
    enabled = param.Boolean(default=True, doc="When off, forward is y = x and backward dx = g.")
    observer_enabled = param.Boolean(default=False, doc="forward() first observes x and takes scale/zp from the observer.")
    learn_scale = param.Boolean(default=False, doc="LSQ: backward also stores d loss / d scale in `scale_grad`.")

    def __init__(self, observer: MinMaxObserver | None = None, **params):
        self._ready = False
        super().__init__(**params)
        self._validate_range(**{k: getattr(self, k) for k in _RANGE_FIELDS})
        self._validate_shape_pair(self.scale, self.zero_point)
        self._own_observer = observer is None
        self.observer = observer if observer is not None else MinMaxObserver(axis=self.axis)
        self.scale_grad = None
        self._cache: dict = {}      # "flags" and per-channel-count kernel params; cleared on any change
        self.param.watch(lambda *_: self._cache.clear(), [p for p in self.param if p != "name"])
        self._ready = True

    def __setattr__(self, name, value):
        if name in _RANGE_FIELDS and getattr(self, "_ready", False):
            candidate = {k: getattr(self, k) for k in _RANGE_FIELDS}
            candidate[name] = value
            self._validate_range(**candidate)
        super().__setattr__(name, value)

    @staticmethod
    def _validate_range(bits, symmetric, narrow_range, zero_point):
        qmin, qmax = integer_range(int(bits), bool(symmetric), bool(narrow_range))
        _check_zero_point(zero_point, qmin, qmax)

    @staticmethod
    def _validate_shape_pair(scale, zero_point):
        if np.ndim(zero_point) and np.ndim(scale) and np.shape(scale) != np.shape(zero_point):
            raise ValueError(f"zero_point: shape {np.shape(zero_point)} does not match scale shape {np.shape(scale)}")

    @classmethod
    def with_defaults(cls, bits: int, symmetric: bool) -> "FakeQuantize":
        """Per-tensor quantizer with scale 1 and zero-point 0 (affine ranges start at 0, so zp 0 is valid)."""
        return cls(bits=bits, symmetric=symmetric, scale=1.0, zero_point=0)

    # ------------------------------------------------------------------ parameters

    def quant_range(self) -> tuple[int, int]:
        """(qmin, qmax), the integer range."""
        return integer_range(self.bits, self.symmetric, self.narrow_range)

    def float_range(self):
        """((qmin - zp) * s, (qmax - zp) * s): floats, or float32 arrays (C,) per-channel."""
        qmin, qmax = self.quant_range()
        s, zp = np.float32(self.scale) if np.ndim(self.scale) == 0 else np.asarray(self.scale, np.float32), \
            np.asarray(self.zero_point, np.float32)
        lo, hi = (np.float32(qmin) - zp) * s, (np.float32(qmax) - zp) * s
        return (float(lo), float(hi)) if np.ndim(lo) == 0 else (lo, hi)

    def update_params(self, scale, zero_point) -> None:
        """Set scale and zero-point together (validated first; nothing changes on error)."""
        _check_scale(scale)
        qmin, qmax = self.quant_range()
        _check_zero_point(zero_point, qmin, qmax)
        self._validate_shape_pair(scale, zero_point)
        if np.ndim(scale):
            scale = np.asarray(scale, dtype=np.float32).copy()
        if np.ndim(zero_point):
            zero_point = np.asarray(zero_point, dtype=np.int64).copy()
        else:
            zero_point = int(zero_point)
        self._ready = False  # validated above as a pair; skip the one-field check in __setattr__
        try:
            self.param.update(scale=scale if np.ndim(scale) else float(scale), zero_point=zero_point)
        finally:
            self._ready = True

    def calibrate(self, x):
        """Observe ``x`` with the observer, then take scale/zero-point from it; returns (scale, zp).

        The observer must track the quantizer's current ``axis``: the default observer is
        rebuilt (empty) when ``axis`` changed; a mismatched user observer raises ``ValueError``.
        """
        _, _, axis, _, _, qmin, qmax, symmetric = self._flags()
        if self.observer.axis != axis:
            if not self._own_observer:
                raise ValueError(f"axis: the observer tracks axis {self.observer.axis} but the quantizer's "
                                 f"axis is {axis}; give it an observer for axis {axis}")
            self.observer = MinMaxObserver(axis=axis)
        self.observer.observe(x)
        scale, zp = self.observer.calculate_qparams(qmin, qmax, symmetric)
        self._store_observed(scale, zp)
        return scale, zp

    def _store_observed(self, scale, zero_point) -> None:
        """Store observer output (valid by construction) without Param's event machinery.

        ``update_params`` costs ~0.3 ms through Param; observing every training step would
        spend more time there than in the kernels. Watchers (e.g. widgets) are not notified of
        these per-step values; call ``update_params`` or ``param.trigger`` to publish them.
        """
        values = getattr(getattr(self, "_param__private", None), "values", None)
        if values is None:  # not the Param internals we know: take the slow, public path
            self.update_params(scale, zero_point)
            return
        values["scale"] = scale.copy() if np.ndim(scale) else float(scale)
        values["zero_point"] = zero_point.copy() if np.ndim(zero_point) else int(zero_point)
        flags = self._cache.get("flags")
        self._cache.clear()
        if flags is not None:  # the range and switches did not change
            self._cache["flags"] = flags

    def _flags(self):
        """(enabled, observer_enabled, axis, learn_scale, ste code, qmin, qmax, symmetric), cached:
        each Param read costs ~1 us, and the hot path needs all of them."""
        flags = self._cache.get("flags")
        if flags is None:
            qmin, qmax = self.quant_range()
            flags = self._cache["flags"] = (self.enabled, self.observer_enabled, self.axis, self.learn_scale,
                                            self.ste.code, qmin, qmax, self.symmetric)
        return flags

    def _kernel_params(self, n_channels: int | None):
        """Cached :meth:`_compute_kernel_params` (cleared whenever any field changes).

        Per-tensor only: per-channel ``scale``/``zero_point`` are arrays that can be written
        in place (or through the caller's reference) without a Param event, so they are
        recomputed on every call rather than served stale.
        """
        if n_channels is not None:
            return self._compute_kernel_params(n_channels)
        params = self._cache.get(n_channels)
        if params is None:
            params = self._cache[n_channels] = self._compute_kernel_params(n_channels)
        return params

    def _compute_kernel_params(self, n_channels: int | None):
        """float32 (inv_s, s, zp, c, inv_h) as scalars or (C,) arrays, plus float32 qmin, qmax."""
        _, _, axis, _, _, qmin, qmax, symmetric = self._flags()
        return _kernel_params(self.scale, self.zero_point, qmin, qmax, symmetric, n_channels, axis)

    # ------------------------------------------------------------------ forward / backward

    def _views(self, x):
        """(flat or (outer, C, inner) view, channel count or None)."""
        axis = self._flags()[2]
        if axis is None:
            return x.reshape(-1), None
        view = _channel_view(x, axis)
        return view, view.shape[1]

    def forward(self, x, out=None) -> np.ndarray:
        """Fake-quantize ``x`` (any shape, float32 or convertible) -> float32, same shape.

        ``out`` (float32, same shape, C-contiguous) receives the result if given. With
        ``observer_enabled`` the observer sees ``x`` first and scale/zero-point are updated.
        """
        x = as_float32(x)
        out = _out_buffer(out, x.shape, "out")
        enabled, observe = self._flags()[:2]
        if not enabled:
            np.copyto(out, x)
            return out
        if observe:
            self.calibrate(x)
        xv, channels = self._views(x)
        inv_s, s, zp, _, _, qmin, qmax = self._kernel_params(channels)
        if channels is None:
            parallel.elementwise(K.fq_forward, (xv,), (inv_s, s, zp, qmin, qmax), out.reshape(-1))
        else:
            K.fq_forward_pc(xv, inv_s, s, zp, qmin, qmax, out.reshape(xv.shape))
        return out

    __call__ = forward

    def backward(self, grad_output, x, out=None, return_scale_grad: bool = False):
        """STE gradient w.r.t. ``x``: ``grad_output`` and ``x`` have the same shape -> float32 ``dx``.

        Uses the current scale/zero-point (never observes), which are those of the
        last forward unless they were changed in between. With ``return_scale_grad``
        (or ``learn_scale``) also computes the LSQ gradient w.r.t. the scale::

            d_scale = sum(g * dy/ds) / sqrt(N * max(qmax, 1))
            dy/ds   = rint(x/s) - x/s inside the range, qmin - zp / qmax - zp at the clipped ends

        with ``N`` the elements per scale; returned as ``(dx, d_scale)`` when asked for,
        and stored in ``self.scale_grad`` when ``learn_scale`` is on.
        """
        x = as_float32(x, "x")
        g = as_float32(grad_output, "grad_output")
        if g.shape != x.shape:
            raise ValueError(f"grad_output: shape {g.shape} does not match x shape {x.shape}")
        out = _out_buffer(out, x.shape, "out")
        enabled, _, _, learn_scale, code = self._flags()[:5]
        want_scale = return_scale_grad or learn_scale
        if not enabled:
            np.copyto(out, g)
            return (out, 0.0) if return_scale_grad else out
        xv, channels = self._views(x)
        gv = g.reshape(xv.shape)
        inv_s, s, zp, c, inv_h, qmin, qmax = self._kernel_params(channels)
        d_scale = None
        if want_scale:  # before the kernel: out may alias grad_output
            d_scale = self._lsq_scale_grad(xv, gv, inv_s, zp, qmin, qmax, channels)
        if channels is None:
            parallel.elementwise(K.fq_backward, (xv, gv), (code, inv_s, zp, qmin, qmax, c, inv_h), out.reshape(-1))
        else:
            K.fq_backward_pc(xv, gv, code, inv_s, zp, qmin, qmax, c, inv_h, out.reshape(xv.shape))
        if learn_scale:
            self.scale_grad = d_scale
        return (out, d_scale) if return_scale_grad else out

    def _lsq_scale_grad(self, xv, gv, inv_s, zp, qmin, qmax, channels):
        q_pos = max(float(qmax), 1.0)
        if channels is None:
            n = xv.size
            return K.fq_lsq_scale_grad(xv, gv, inv_s, zp, qmin, qmax) / math.sqrt(max(n, 1) * q_pos)
        acc = np.empty(channels)
        K.fq_lsq_scale_grad_pc(xv, gv, inv_s, zp, qmin, qmax, acc)
        n = xv.shape[0] * xv.shape[2]
        return acc / math.sqrt(max(n, 1) * q_pos)

    # ------------------------------------------------------------------ statistics

    def _noise_saturation(self, x) -> tuple[float, int, float, int]:
        """(sum of squared error, clamped count, sum of x^2, n); error 0 when disabled."""
        x = as_float32(x)
        if x.size == 0:
            return 0.0, 0, 0.0, 0
        xv, channels = self._views(x)
        inv_s, s, zp, _, _, qmin, qmax = self._kernel_params(channels)
        kernel = K.fq_noise_saturation if channels is None else K.fq_noise_saturation_pc
        sq, sat, signal = kernel(xv, inv_s, s, zp, qmin, qmax)
        if not self._flags()[0]:
            return 0.0, 0, float(signal), x.size
        return float(sq), int(sat), float(signal), x.size

    def quantization_noise(self, x) -> float:
        """mean((x - forward(x))^2) as float64 (current params, no observing); 0.0 for empty x."""
        sq, _, _, n = self._noise_saturation(x)
        return sq / n if n else 0.0

    def saturation_fraction(self, x) -> float:
        """Share of elements of ``x`` that the clamp moves (outside the range); 0.0 for empty x."""
        _, sat, _, n = self._noise_saturation(x)
        return sat / n if n else 0.0

    def sqnr_db(self, x) -> float:
        """Signal-to-quantization-noise ratio ``10 log10(sum x^2 / sum (x - fq(x))^2)`` in dB.

        ``inf`` when the noise is 0 (and the signal is not), ``nan`` for empty or all-zero x.
        """
        sq, _, signal, _ = self._noise_saturation(x)
        return _sqnr_db(signal, sq)

    def noise_stats(self, x) -> tuple[float, float, float]:
        """``(quantization_noise(x), sqnr_db(x), saturation_fraction(x))`` from one pass over x."""
        return _noise_stats(*self._noise_saturation(x))


def _kernel_params(scale, zero_point, qmin, qmax, symmetric, n_channels, axis):
    """float32 (inv_s, s, zp, c, inv_h) as scalars or (C,) arrays, plus float32 qmin, qmax.

    ``c``/``inv_h`` place the input in units of the range for TANH / HARD_TANH (module doc).
    """
    f32 = np.float32
    s = np.asarray(scale, dtype=f32)
    zp = np.asarray(zero_point, dtype=f32)
    if n_channels is None:
        if s.ndim or zp.ndim:
            raise ValueError("scale: per-channel values need axis to be set")
    else:
        s = np.broadcast_to(s, (n_channels,)) if s.ndim == 0 else s
        zp = np.broadcast_to(zp, (n_channels,)) if zp.ndim == 0 else zp
        if s.shape != (n_channels,) or zp.shape != (n_channels,):
            raise ValueError(f"scale: has {s.size} values, input has {n_channels} channels along axis {axis}")
    inv_s = f32(1.0) / s
    if symmetric:
        c = -zp * s
        h = s * f32(qmax if qmax > 0 else -qmin)
    else:
        c = (f32((qmin + qmax) / 2) - zp) * s
        h = s * f32((qmax - qmin) / 2)
    if n_channels is not None:
        inv_s, s, zp, c, h = (np.ascontiguousarray(a, dtype=f32) for a in (inv_s, s, zp, c, h))
        return inv_s, s, zp, c, f32(1.0) / h, f32(qmin), f32(qmax)
    return f32(inv_s), f32(s), f32(zp), f32(c), f32(f32(1.0) / h), f32(qmin), f32(qmax)


def _sqnr_db(signal: float, noise: float) -> float:
    if signal == 0.0:
        return math.nan
    if noise == 0.0:
        return math.inf
    return 10.0 * math.log10(signal / noise)


def _is_f32(a) -> bool:
    """True for a C-contiguous float32 ndarray (the fast path needs no conversion)."""
    return type(a) is np.ndarray and a.dtype == np.float32 and a.flags.c_contiguous


def _out_buffer(out, shape, name):
    if out is None:
        return np.empty(shape, dtype=np.float32)
    if not isinstance(out, np.ndarray) or out.dtype != np.float32 or out.shape != shape \
            or not out.flags.c_contiguous:
        raise ValueError(f"{name}: must be a C-contiguous float32 array of shape {shape}")
    return out


# ----------------------------------------------------------------------------- ternary

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
    sum is taken in slices on the cores when w is large (:func:`qatlab.parallel.sum_slices`), the
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

    ste = _SteParameter(SteKind.IDENTITY, doc="Straight-through estimator of the ternary projection.")

    def __init__(self, **params):
        super().__init__(**params)
        self.alpha = 1.0
        self._code = self.ste.code

    @param.depends("ste", watch=True)
    def _cache_ste(self):
        self._code = self.ste.code  # the hot path reads this plain attribute, not the Param

    def _args(self):
        f32 = np.float32
        return f32(1.0) / f32(self.alpha), f32(self.alpha)

    def quantize(self, w):
        """(trits int8 same shape as w, alpha float); also stores alpha."""
        trits, self.alpha = ternary_quantize(w)
        return trits, self.alpha

    def forward(self, w, out=None) -> np.ndarray:
        """``alpha * clamp(rint(w/alpha), -1, 1)`` with alpha = mean|w|; float32, shape of w."""
        if not _is_f32(w):
            w = as_float32(w, "w")
        if out is None or not _is_f32(out) or out.shape != w.shape:
            out = _out_buffer(out, w.shape, "out")
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
        if not _is_f32(w):
            w = as_float32(w, "w")
        g = grad_output if _is_f32(grad_output) else as_float32(grad_output, "grad_output")
        if g.shape != w.shape:
            raise ValueError(f"grad_output: shape {g.shape} does not match w shape {w.shape}")
        if out is None or not _is_f32(out) or out.shape != w.shape:
            out = _out_buffer(out, w.shape, "out")
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
        return _sqnr_db(signal, noise)

    def saturation_fraction(self, w) -> float:
        """Share of latents with |w/alpha| rounding beyond 1 (clamped to +-1)."""
        _, sat, _, n = self._stats(w)
        return sat / n if n else 0.0

    def noise_stats(self, w) -> tuple[float, float, float]:
        """``(quantization_noise(w), sqnr_db(w), saturation_fraction(w))`` from one pass over w."""
        return _noise_stats(*self._stats(w))


def _noise_stats(noise: float, saturated: int, signal: float, n: int) -> tuple[float, float, float]:
    """(mean squared error, SQNR dB, saturated share) from the sums of one noise/saturation pass."""
    return (noise / n if n else 0.0), _sqnr_db(signal, noise), (saturated / n if n else 0.0)


_ZERO, _ONE, _MINUS_ONE = np.float32(0.0), np.float32(1.0), np.float32(-1.0)
