"""
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

from ..kernels import fakequant as K
from ..runtime import parallel
from .checks import (ScaleParameter, SteParameter, ZeroPointParameter, as_float32, channel_view, check_scale,
                     check_zero_point, integer_range, out_buffer)
from .noise import noise_stats, sqnr_db
from .observers import MinMaxObserver
from .ste import SteKind


_CHECKED_FIELDS = ("bits", "symmetric", "narrow_range", "scale", "zero_point", "axis")


class FakeQuantize(param.Parameterized):
    """Fake quantizer: ``y = (clamp(rint(x/s) + zp, qmin, qmax) - zp) * s`` with a selectable STE.

    Per-tensor when ``axis`` is None; per-channel (one scale and zero-point per
    slice along ``axis``) otherwise, with ``scale``/``zero_point`` 1-D arrays.
    ``forward`` matches ``torch.fake_quantize_per_tensor_affine`` /
    ``..._per_channel_affine`` bit for bit on finite input; NaN input gives NaN
    output (PyTorch clamps it to qmin), +-inf saturate.

    Each field is checked against the others as it is set, so a refused value changes nothing.
    Param's ``param.update(a=..., b=...)`` sets fields one by one: an error in ``b`` leaves ``a``
    set. ``update_params`` sets scale and zero point as one change.
    """

    bits = param.Integer(default=8, bounds=(1, 16), doc="Bit width (1..16).")
    symmetric = param.Boolean(default=True, doc="Signed range around 0, or affine [0, 2^b-1] with a zero-point.")
    narrow_range = param.Boolean(default=False, doc="Drop the most negative level (symmetric) / level 0 (affine).")
    scale = ScaleParameter(default=1.0, doc="Step size s (finite, > 0); a 1-D array when per-channel.")
    zero_point = ZeroPointParameter(default=0, doc="Integer that represents 0.0; a 1-D array when per-channel.")
    ste = SteParameter(SteKind.CLIPPED_IDENTITY, doc="Straight-through estimator used by backward().")
    axis = param.Integer(default=None, allow_None=True, doc="None: per-tensor; int: per-channel along this axis.")
    enabled = param.Boolean(default=True, doc="When off, forward is y = x and backward dx = g.")
    observer_enabled = param.Boolean(default=False, doc="forward() first observes x and takes scale/zp from the observer.")
    learn_scale = param.Boolean(default=False, doc="LSQ: backward also stores d loss / d scale in `scale_grad`.")

    def __init__(self, observer: MinMaxObserver | None = None, **params):
        self._ready = False
        super().__init__(**params)
        self._validate(**{k: getattr(self, k) for k in _CHECKED_FIELDS})
        self._own_observer = observer is None
        self.observer = observer if observer is not None else MinMaxObserver(axis=self.axis)
        self.scale_grad = None
        self._cache: dict = {}      # "flags" and per-channel-count kernel params; cleared on any change
        self.param.watch(lambda *_: self._cache.clear(), [p for p in self.param if p != "name"])
        self._ready = True

    def __setattr__(self, name, value):
        if name in _CHECKED_FIELDS and getattr(self, "_ready", False):
            candidate = {k: getattr(self, k) for k in _CHECKED_FIELDS}
            candidate[name] = value
            self._validate(**candidate)
        super().__setattr__(name, value)

    @staticmethod
    def _validate(bits, symmetric, narrow_range, scale, zero_point, axis):
        """The fields that must agree: the range holds the zero point; per-channel arrays match in
        shape and come with an ``axis``."""
        for field, value in (("bits", bits), ("axis", axis)):
            if isinstance(value, (bool, np.bool_)):
                raise TypeError(f"{field}: must be an integer, got {value!r}")
        qmin, qmax = integer_range(int(bits), bool(symmetric), bool(narrow_range))
        check_zero_point(zero_point, qmin, qmax)
        if np.ndim(zero_point) and np.ndim(scale) and np.shape(scale) != np.shape(zero_point):
            raise ValueError(f"zero_point: shape {np.shape(zero_point)} does not match scale shape {np.shape(scale)}")
        if axis is None and (np.ndim(scale) or np.ndim(zero_point)):
            raise ValueError("axis: per-channel scale/zero_point arrays need an axis; got axis=None")

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
        check_scale(scale)
        self._validate(self.bits, self.symmetric, self.narrow_range, scale, zero_point, self.axis)
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

        ``update_params`` is slow through Param; observing every training step would spend
        more time there than in the kernels. Watchers (e.g. widgets) are not notified of
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
        a Param read is slow, and the hot path needs all of them."""
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
        view = channel_view(x, axis)
        return view, view.shape[1]

    def forward(self, x, out=None) -> np.ndarray:
        """Fake-quantize ``x`` (any shape, float32 or convertible) -> float32, same shape.

        ``out`` (float32, same shape, C-contiguous) receives the result if given. With
        ``observer_enabled`` the observer sees ``x`` first and scale/zero-point are updated.
        """
        x = as_float32(x)
        out = out_buffer(out, x.shape, "out")
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
        out = out_buffer(out, x.shape, "out")
        enabled, _, _, learn_scale, code = self._flags()[:5]
        want_scale = return_scale_grad or learn_scale
        xv, channels = self._views(x)
        if not enabled:    # y = x: the scale has no effect on the loss
            np.copyto(out, g)
            d_scale = 0.0 if channels is None else np.zeros(channels)
            if learn_scale:
                self.scale_grad = d_scale
            return (out, d_scale) if return_scale_grad else out
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
        return sqnr_db(signal, sq)

    def noise_stats(self, x) -> tuple[float, float, float]:
        """``(quantization_noise(x), sqnr_db(x), saturation_fraction(x))`` from one pass over x."""
        return noise_stats(*self._noise_saturation(x))


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
