r"""The dense MLP (:class:`Mlp`), its buffers (:class:`Scratch`, :class:`Gradients`) and the losses.

Layer ``i`` computes ``a_{i+1} = act(a_i @ Wq_i.T + b_i)`` with ``W_i`` float32 ``(out, in)``;
the last layer has no activation (the loss applies softmax). ``Wq_i`` is the weight quantizer's
output, or ``W_i`` itself without one; a hidden activation quantizer maps ``h`` to ``hq``, which
feeds the next layer. ``B`` is the batch, ``K`` the outputs.

Parameters live in ONE flat float32 buffer (:meth:`Mlp.flat_params`), in the order
``w0, b0, w1, b1, ...`` (no ``b`` entries when ``bias=False``); ``weights(i)`` and ``biases(i)``
are views into it. :class:`Gradients` mirrors the layout (:meth:`Gradients.flat`), so an
optimizer or a global-norm clip is one kernel call over one array.

One training step, with no allocation after the first call (sizes fixed)::

    y = mlp.forward(x, scratch)                               # (B, K) view into scratch
    loss = cross_entropy_loss(y, labels, grads.d_output_mut())
    mlp.backward(x, scratch, grads, need_input_grad=False)    # overwrites all parameter grads
    opt.step(grads.flat())                                     # qatlab.optim, flat in, flat out

Quantizer protocol (duck-typed; one object per layer, or None):

- weight quantizer: ``forward(w, out) -> out`` writes the quantized-dequantized copy of the
  latent ``w`` (out, in) into ``out`` (same shape; may update observers);
  ``backward(grad_q, w, out) -> out`` maps dL/dWq to dL/dW (the STE). The model calls it
  in place: ``out is grad_q``.
- activation quantizer (hidden layers only): the same protocol on ``h`` (B, N) after the
  activation function; ``backward`` receives the pre-quantization ``h`` and, again, ``out is grad_q``.

All arrays handed to quantizers are float32 and C-contiguous.
"""
from __future__ import annotations

import math
import numbers
from typing import NamedTuple

import numpy as np

from ..runtime import parallel
from ..kernels.dense import (ACT_CODES, IDENTITY, act_backward_inplace, bias_act_inplace, mse,
                            scale_inplace, softmax_cross_entropy, sum_squares)

ACTIVATIONS = tuple(ACT_CODES)
INITS = ("auto", "he", "xavier")
_F32 = np.dtype(np.float32)


def _is_f32c(a) -> bool:
    """True for a C-contiguous float32 ndarray (the zero-copy fast path)."""
    return type(a) is np.ndarray and (a.dtype is _F32 or a.dtype == _F32) and a.flags.c_contiguous


def _check_sizes(sizes) -> tuple[int, ...]:
    if isinstance(sizes, (str, bytes)) or not hasattr(sizes, "__len__"):
        raise TypeError(f"sizes: expected a list of >= 2 positive ints, got {sizes!r}")
    out = []
    for s in sizes:
        if isinstance(s, bool) or not isinstance(s, numbers.Integral):
            raise TypeError(f"sizes: every entry must be an int, got {s!r} in {list(sizes)!r}")
        out.append(int(s))
    if len(out) < 2 or min(out) < 1:
        raise ValueError(f"sizes: expected a list of >= 2 positive ints, got {out!r}")
    return tuple(out)


def check_choice(name: str, value, allowed) -> str:
    if not isinstance(value, str):
        raise TypeError(f"{name}: expected one of {', '.join(allowed)}; got {value!r}")
    if value not in allowed:
        raise ValueError(f"{name}: expected one of {', '.join(allowed)}; got {value!r}")
    return value


def _check_quantizers(name: str, qs, n: int) -> list:
    if qs is None:
        return [None] * n
    if isinstance(qs, (str, bytes)) or not hasattr(qs, "__len__"):
        raise TypeError(f"{name}: expected None or a list of {n} quantizers (or None)")
    qs = list(qs)
    if len(qs) != n:
        raise ValueError(f"{name}: expected {n} entries (one per layer), got {len(qs)}")
    for q in qs:
        if q is not None and not (callable(getattr(q, "forward", None)) and callable(getattr(q, "backward", None))):
            raise TypeError(f"{name}: {q!r} has no forward(x, out) / backward(grad, x, out) methods")
    return qs


def layer_index(i: int, n: int) -> int:
    if isinstance(i, bool) or not isinstance(i, numbers.Integral) or not -n <= i < n:
        raise ValueError(f"layer: expected an int in [0, {n}), got {i!r}")
    return int(i) % n


def _layout(sizes, bias):
    """[(name, shape, offset)] of the flat parameter buffer and its total length."""
    entries, off = [], 0
    for i, (n_in, n_out) in enumerate(zip(sizes[:-1], sizes[1:])):
        entries.append((f"w{i}", (n_out, n_in), off))
        off += n_in * n_out
        if bias:
            entries.append((f"b{i}", (n_out,), off))
            off += n_out
    return entries, off


def flat_views(flat, entries):
    return [flat[o:o + math.prod(s)].reshape(s) for _, s, o in entries]


def readonly(a: np.ndarray) -> np.ndarray:
    v = a.view()
    v.flags.writeable = False
    return v


class QuantizedLayers:
    """The quantizer lists, per-layer weight views and flat parameters shared by :class:`Mlp` and
    the Cnn (``num_layers``, ``_flat``, ``_entries`` (name, shape, offset), ``_w`` (one weight view
    per layer), ``_wq``, ``_aq`` are the model's)."""

    def set_quantizers(self, weight_quantizers=None, activation_quantizers=None) -> None:
        """Replace both quantizer lists (validated first; nothing changes on error)."""
        wq = _check_quantizers("weight_quantizers", weight_quantizers, self.num_layers)
        aq = _check_quantizers("activation_quantizers", activation_quantizers, self.num_layers - 1)
        self._wq, self._aq = wq, aq

    @property
    def weight_quantizers(self) -> tuple:
        return tuple(self._wq)

    @property
    def activation_quantizers(self) -> tuple:
        return tuple(self._aq)

    def weights(self, i: int) -> np.ndarray:
        """Latent weights of layer i: writable float32 (out, in) view of the flat parameters
        (a conv layer's is (Cout, C*kh*kw))."""
        return self._w[layer_index(i, self.num_layers)]

    def flat_params(self) -> np.ndarray:
        """All latent parameters, float32 (num_params,), layout ``w0, b0, w1, b1, ...``."""
        return self._flat

    def parameters(self) -> list[tuple[str, np.ndarray]]:
        """``[("w0", W0), ("b0", b0), ("w1", W1), ...]``: views into :meth:`flat_params`, fixed order."""
        return [(name, v) for (name, _, _), v in zip(self._entries, flat_views(self._flat, self._entries))]

    def param_shapes(self) -> list[tuple[str, tuple[int, ...]]]:
        """``[(name, shape)]`` in the order of :meth:`parameters`."""
        return [(name, shape) for name, shape, _ in self._entries]

    @property
    def num_params(self) -> int:
        return self._flat.shape[0]


class Mlp(QuantizedLayers):
    """Dense MLP ``sizes[0] -> ... -> sizes[-1]`` with float32 latent parameters.

    sizes: >= 2 positive ints, e.g. ``[64, 256, 10]``. activation: one of :data:`ACTIVATIONS`
    for the hidden layers (``sign``: sign(0) = 0 forward, identity straight-through backward;
    ``leaky_relu`` slope 0.01). init: ``he`` (normal, std sqrt(2/fan_in)), ``xavier`` (normal,
    std sqrt(2/(fan_in+fan_out))) or ``auto`` (he for relu/leaky_relu, xavier otherwise); the
    weights are drawn layer by layer from ``np.random.default_rng(seed)``; biases start at 0.
    weight_quantizers: None or one quantizer-or-None per layer; activation_quantizers: None or
    one per hidden layer (see the module doc for the protocol).
    """

    def __init__(self, sizes, activation="relu", seed=0, bias=True, init="auto",
                 weight_quantizers=None, activation_quantizers=None):
        self.sizes = _check_sizes(sizes)
        self.activation = check_choice("activation", activation, ACTIVATIONS)
        init = check_choice("init", init, INITS)
        if isinstance(seed, bool) or not isinstance(seed, numbers.Integral):
            raise TypeError(f"seed: expected a non-negative int, got {seed!r}")
        if seed < 0:
            raise ValueError(f"seed: expected a non-negative int, got {seed!r}")
        if not isinstance(bias, (bool, np.bool_)):
            raise TypeError(f"bias: expected a bool, got {bias!r}")
        self.bias = bool(bias)
        self.num_layers = len(self.sizes) - 1
        self._act = ACT_CODES[self.activation]
        self._entries, n = _layout(self.sizes, self.bias)
        self._flat = np.zeros(n, np.float32)
        views = flat_views(self._flat, self._entries)
        step = 2 if self.bias else 1
        self._w = views[::step]
        self._b = views[1::2] if self.bias else [np.zeros(s, np.float32) for s in self.sizes[1:]]
        self._wT = [w.T for w in self._w]
        if init == "auto":
            init = "he" if self.activation in ("relu", "leaky_relu") else "xavier"
        rng = np.random.default_rng(seed)
        for w in self._w:
            n_out, n_in = w.shape
            std = math.sqrt(2.0 / n_in) if init == "he" else math.sqrt(2.0 / (n_in + n_out))
            w[:] = rng.standard_normal((n_out, n_in)) * std
        self.init = init
        self.set_quantizers(weight_quantizers, activation_quantizers)
        self._last_batch = 0

    # -- parameters -------------------------------------------------------------------------
    def biases(self, i: int) -> np.ndarray | None:
        """Biases of layer i: writable float32 view (out,), or None when ``bias=False``."""
        i = layer_index(i, self.num_layers)
        return self._b[i] if self.bias else None


    # -- the fused kernels' view (qatlab.kernels.state.Net and Activations) -----------------
    def kernel_layers(self, scratch: "Scratch", grads: "Gradients") -> "KernelLayers":
        """The per-layer arrays the fused kernels read and write (:class:`KernelLayers`)."""
        wqs = tuple(scratch._wq[i] if q is not None else self._w[i] for i, q in enumerate(self._wq))
        return KernelLayers(self._act, tuple(self._b), wqs, tuple(grads._dw), tuple(grads._db))

    def kernel_rows(self, scratch: "Scratch", grads: "Gradients", B: int) -> tuple[tuple, tuple]:
        """(activations, deltas) per layer at B rows, for a kernel's Activations; grads grow to B if needed."""
        grads._grow(B)
        return tuple(scratch._rows(B)[0]), tuple(grads._rows(B)[0])

    def after_kernel_forward(self, scratch: "Scratch", grads: "Gradients", x, hs, w_used) -> None:
        """Leave scratch and grads as :meth:`forward` on x (B, in) would, after a kernel ran it: ``hs`` the
        activations it wrote, ``w_used`` the list of (out, in) weights each layer multiplied with (kept, not
        copied: the caller's list is fixed)."""
        scratch.batch, scratch._x_in, self._last_batch = x.shape[0], x, x.shape[0]
        scratch._w_used = w_used
        scratch._a_in = [x, *hs[:-1]]
        grads._input_batch = 0

    # -- buffers ----------------------------------------------------------------------------
    def scratch(self, batch_size: int) -> "Scratch":
        """Forward buffers for batches of up to ``batch_size`` rows (allocated once)."""
        return Scratch(self.sizes, batch_size)

    def gradients(self, batch_size: int | None = None) -> "Gradients":
        """Gradient buffers. Parameter gradients are allocated now; the per-sample buffers
        (d_output, d_input, hidden deltas) get ``batch_size`` rows now, or — when None — are
        sized on first use and grow (reallocate) only when a larger batch appears."""
        return Gradients(self, batch_size)

    # -- forward / backward -----------------------------------------------------------------
    def checked_input(self, x, scratch: "Scratch") -> np.ndarray:
        """x as a C-contiguous float32 (B, in) array that fits ``scratch`` (copied only when needed), or a
        clear error."""
        if not isinstance(scratch, Scratch) or scratch.sizes != self.sizes:
            raise TypeError(f"scratch: expected a Scratch from this model's scratch(batch_size), got {scratch!r}")
        if not _is_f32c(x):
            kind = np.asarray(x).dtype.kind
            if kind not in "biuf":
                raise TypeError(f"x: expected a numeric (float32) array, got dtype {np.asarray(x).dtype}")
            x = np.ascontiguousarray(x, dtype=np.float32)
        n_in = self.sizes[0]
        if x.ndim != 2 or x.shape[1] != n_in or not 1 <= x.shape[0] <= scratch.batch_size:
            raise ValueError(f"x: expected shape (batch, {n_in}) with 1 <= batch <= {scratch.batch_size} "
                             f"(the scratch's batch_size), got {x.shape}")
        return x

    def forward(self, x, scratch: "Scratch") -> np.ndarray:
        """Output (B, K) float32 for x (B, in), B <= scratch.batch_size: a view into ``scratch``,
        valid until the next forward with it. x is converted to float32 if needed (a copy).

        Per layer: ``h = a @ W.T`` (NumPy BLAS; column blocks on several cores when large, see
        :mod:`qatlab.runtime.parallel`) then one fused bias + activation kernel.
        """
        x_in = x
        x = self.checked_input(x, scratch)
        B = x.shape[0]
        h, hq = scratch._rows(B)
        last = self.num_layers - 1
        a = x
        for i in range(last + 1):
            q = self._wq[i]
            if q is None:
                scratch._w_used[i] = self._w[i]
                wT = self._wT[i]
            else:
                q.forward(self._w[i], scratch._wq[i])
                scratch._w_used[i] = scratch._wq[i]
                wT = scratch._wqT[i]
            scratch._a_in[i] = a
            parallel.dot(a, wT, out=h[i])
            if i == last:
                bias_act_inplace(h[i], self._b[i], IDENTITY)
            else:
                bias_act_inplace(h[i], self._b[i], self._act)
                aq = self._aq[i]
                if aq is None:
                    a = h[i]
                else:
                    aq.forward(h[i], hq[i])
                    a = hq[i]
        scratch.batch = B
        scratch._x_in = x_in
        self._last_batch = B
        return h[last]

    def backward(self, x, scratch: "Scratch", grads: "Gradients", need_input_grad: bool = True):
        """Backpropagate ``grads.d_output()`` (dL/dy, written by the loss) through the last
        ``forward(x, scratch)``: overwrites every parameter gradient in ``grads`` (latent, i.e.
        after the quantizers' STE) and returns dL/dx (B, in) (``grads.d_input()``), or None when
        ``need_input_grad`` is False (saves one matrix product). ``x`` must be the forward's
        input (the forward's float32 copy of it is what is used).

        Per layer, last to first: dz = d * act'(h) and db = sum_rows dz (one kernel),
        ``dWq = dz.T @ a_in``, dW = weight STE(dWq), ``d_prev = dz @ Wq``, then the activation
        quantizer's STE on d_prev.
        """
        if not isinstance(grads, Gradients) or grads._entries != self._entries:
            raise TypeError(f"grads: expected Gradients from this model's gradients(), got {grads!r}")
        if not isinstance(scratch, Scratch) or scratch.sizes != self.sizes:
            raise TypeError(f"scratch: expected a Scratch from this model's scratch(batch_size), got {scratch!r}")
        B = scratch.batch
        if B == 0:
            raise ValueError("scratch: run forward(x, scratch) before backward(x, scratch, grads)")
        if x is not scratch._x_in:
            x = self.checked_input(x, scratch)
            if x.shape[0] != B:
                raise ValueError(f"x: backward got {x.shape[0]} rows but the last forward had {B}")
        if grads._cap < B:
            raise ValueError(f"grads: d_output has {grads._cap} rows, the batch has {B}; "
                             "write dL/dy into grads.d_output_mut() after forward")
        h, _ = scratch._rows(B)
        d, dT, d_input = grads._rows(B)
        last = self.num_layers - 1
        for i in range(last, -1, -1):
            act_backward_inplace(d[i], h[i], IDENTITY if i == last else self._act, grads._db[i])
            parallel.dot(dT[i], scratch._a_in[i], out=grads._dw[i])
            q = self._wq[i]
            if q is not None:
                q.backward(grads._dw[i], self._w[i], grads._dw[i])
            if i > 0:
                parallel.dot(d[i], scratch._w_used[i], out=d[i - 1])
                aq = self._aq[i - 1]
                if aq is not None:
                    aq.backward(d[i - 1], h[i - 1], d[i - 1])
            elif need_input_grad:
                parallel.dot(d[0], scratch._w_used[0], out=d_input)
        grads._input_batch = B if need_input_grad else 0
        return grads.d_input() if need_input_grad else None

    def export(self, path) -> str:
        """Write integer weights, scales and architecture to ``path`` (.npz); see :mod:`qatlab.nn.export`."""
        from .export import export_model
        return export_model(self, path)

    def __repr__(self) -> str:
        q = sum(q is not None for q in self._wq), sum(q is not None for q in self._aq)
        return (f"Mlp({list(self.sizes)}, activation={self.activation!r}, bias={self.bias}, "
                f"init={self.init!r}, quantized weights/activations={q[0]}/{q[1]})")


class KernelLayers(NamedTuple):
    """An Mlp's per-layer arrays as the fused kernels take them (:class:`qatlab.kernels.state.Net`'s fields)."""

    act: int        # hidden activation code (qatlab.kernels.dense.ACT_CODES)
    bs: tuple       # biases (out,); zeros when the model has none
    wqs: tuple      # (out, in) quantized-weight buffers, the latent weights where a layer has no quantizer
    dws: tuple      # dL/dW views into Gradients.flat()
    dbs: tuple      # dL/db views, or sinks when the model has no biases


class Scratch:
    """Forward buffers for up to ``batch_size`` rows, from :meth:`Mlp.scratch`.

    Per layer i: activation output h_i (batch_size, sizes[i+1]) (the last is the model output);
    per hidden layer a quantized-activation buffer; per layer a quantized-weight buffer (out, in).
    ``batch`` is the row count of the last forward (0 before any).
    """

    def __init__(self, sizes, batch_size):
        if isinstance(batch_size, bool) or not isinstance(batch_size, numbers.Integral) or batch_size < 1:
            raise ValueError(f"batch_size: expected an int >= 1, got {batch_size!r}")
        self.sizes = tuple(sizes)
        self.batch_size = int(batch_size)
        self.batch = 0
        cap, L = self.batch_size, len(sizes) - 1
        self._h = [np.zeros((cap, n), np.float32) for n in sizes[1:]]
        self._hq = [np.zeros((cap, n), np.float32) for n in sizes[1:-1]]
        self._wq = [np.zeros((o, i), np.float32) for i, o in zip(sizes[:-1], sizes[1:])]
        self._wqT = [w.T for w in self._wq]
        self._w_used = [None] * L   # the (out, in) array each layer multiplied with
        self._a_in = [None] * L     # each layer's input rows (x, h or hq)
        self._x_in = None
        self._row_cache = {}

    def _rows(self, B):
        r = self._row_cache.get(B)
        if r is None:
            r = self._row_cache[B] = ([a[:B] for a in self._h], [a[:B] for a in self._hq])
        return r

    def output(self) -> np.ndarray:
        """Model output (batch, K) of the last forward."""
        return self._rows(self.batch)[0][-1]

    def activations(self, i: int) -> np.ndarray:
        """Hidden layer i after the activation function, before its quantizer: (batch, sizes[i+1])."""
        return self._rows(self.batch)[0][layer_index(i, len(self._hq))]

    def layer_input(self, i: int) -> np.ndarray:
        """What layer i multiplied with in the last forward: x, h or quantized h, (batch, sizes[i])."""
        return self._a_in[layer_index(i, len(self._h))]

    def weights_used(self, i: int) -> np.ndarray:
        """The (out, in) weights layer i used in the last forward: the quantized copy or the latent."""
        return self._w_used[layer_index(i, len(self._h))]


class Gradients:
    """Gradient buffers of an :class:`Mlp` (overwrite semantics), from :meth:`Mlp.gradients`.

    Parameter gradients: one flat float32 buffer laid out like :meth:`Mlp.flat_params`.
    Per-sample buffers have at least B rows, B = the batch of the model's latest forward:
    d_output (B, K) — the loss writes dL/dy here —, d_input (B, in), hidden deltas.
    """

    def __init__(self, model: Mlp, batch_size=None):
        self._model = model
        self._entries = model._entries
        self._flat = np.zeros(model.num_params, np.float32)
        views = flat_views(self._flat, self._entries)
        self._dw = views[::2] if model.bias else views
        self._db = views[1::2] if model.bias else [np.zeros(n, np.float32) for n in model.sizes[1:]]
        self._dw_ro = [readonly(a) for a in self._dw]
        self._db_ro = [readonly(a) for a in self._db]
        self._no_dx = np.zeros((0, model.sizes[0]), np.float32)
        self._cap = 0
        self._input_batch = 0
        self._cache = {}
        if batch_size is not None:
            if isinstance(batch_size, bool) or not isinstance(batch_size, numbers.Integral) or batch_size < 1:
                raise ValueError(f"batch_size: expected None or an int >= 1, got {batch_size!r}")
            self._grow(int(batch_size))

    def _grow(self, B):
        if B <= self._cap:
            return
        sizes = self._model.sizes
        self._delta = [np.zeros((B, n), np.float32) for n in sizes[1:]]  # last one is d_output
        self._d_input = np.zeros((B, sizes[0]), np.float32)
        self._cap = B
        self._cache = {}

    def _cached(self, key, make):
        v = self._cache.get(key)
        if v is None:
            v = self._cache[key] = make()
        return v

    def _batch(self):
        B = self._model._last_batch or self._cap
        if B == 0:
            raise ValueError("grads: batch unknown; run model.forward first or pass gradients(batch_size)")
        self._grow(B)
        return B

    def _rows(self, B):
        """(deltas, their transposes, d_input): row views (B, .) cached per B; deltas[-1] is d_output."""
        r = self._cache.get(("rows", B))
        if r is None:
            d = [a[:B] for a in self._delta]
            r = self._cache[("rows", B)] = (d, [a.T for a in d], self._d_input[:B])
        return r

    # -- per-sample buffers -----------------------------------------------------------------
    def d_output_mut(self) -> np.ndarray:
        """Writable dL/dy (B, K), B = rows of the model's latest forward; the loss writes it."""
        B = self._model._last_batch
        v = self._cache.get(B)  # int keys: d_output_mut rows; tuple keys: everything else
        if v is None:
            B = self._batch()
            v = self._cache[B] = self._rows(B)[0][-1]
        return v

    def d_output(self) -> np.ndarray:
        """Read-only dL/dy (B, K) (backward leaves it unchanged)."""
        B = self._batch()
        return self._cached(("d_output", B), lambda: readonly(self._delta[-1][:B]))

    def d_input(self) -> np.ndarray:
        """Read-only dL/dx (B, in) of the last backward with ``need_input_grad=True``."""
        B = self._input_batch
        if B == 0:
            raise ValueError("grads: no dL/dx yet; call model.backward(..., need_input_grad=True)")
        return self._cached(("d_input", B), lambda: readonly(self._rows(B)[2]))

    # -- parameter gradients ----------------------------------------------------------------
    def d_weights(self, i: int) -> np.ndarray:
        """Read-only dL/dW_i (out, in) (latent: after the weight quantizer's STE)."""
        return self._dw_ro[layer_index(i, len(self._dw))]

    def d_weights_mut(self, i: int) -> np.ndarray:
        """Writable dL/dW_i (out, in), a view into :meth:`flat`."""
        return self._dw[layer_index(i, len(self._dw))]

    def d_biases(self, i: int) -> np.ndarray | None:
        """Read-only dL/db_i (out,), or None when the model has no biases."""
        i = layer_index(i, len(self._db))
        return self._db_ro[i] if self._model.bias else None

    def d_biases_mut(self, i: int) -> np.ndarray | None:
        """Writable dL/db_i (out,), a view into :meth:`flat`; None when the model has no biases."""
        i = layer_index(i, len(self._db))
        return self._db[i] if self._model.bias else None

    def flat(self) -> np.ndarray:
        """All parameter gradients, float32 (num_params,), laid out like ``model.flat_params()``."""
        return self._flat

    def parameters(self) -> list[tuple[str, np.ndarray]]:
        """``[("w0", dW0), ("b0", db0), ...]``: writable views into :meth:`flat`."""
        return [(name, v) for (name, _, _), v in zip(self._entries, flat_views(self._flat, self._entries))]

    def zero_params(self) -> None:
        """Set every parameter gradient to 0."""
        self._flat.fill(0.0)

    def scale_params(self, s: float) -> None:
        """Multiply every parameter gradient by ``s`` (a finite number)."""
        if not isinstance(s, numbers.Real) or not math.isfinite(s):
            raise ValueError(f"s: expected a finite number, got {s!r}")
        scale_inplace(self._flat, float(s))

    def global_l2_norm_params(self) -> float:
        """sqrt(sum of all squared parameter gradients), accumulated in float64."""
        return math.sqrt(sum_squares(self._flat))

    def clip_global_norm_params(self, max_norm: float) -> float:
        """If the global norm n exceeds ``max_norm`` (> 0), scale every parameter gradient by
        ``max_norm / (n + 1e-6)`` (torch.nn.utils.clip_grad_norm_); return n (pre-clip).
        A NaN norm is returned as is and nothing is scaled."""
        if not isinstance(max_norm, numbers.Real) or not max_norm > 0:
            raise ValueError(f"max_norm: expected a number > 0, got {max_norm!r}")
        n = self.global_l2_norm_params()
        if n > max_norm:
            scale_inplace(self._flat, max_norm / (n + 1e-6))
        return n


# -- losses ----------------------------------------------------------------------------------
def as_f32_2d(name: str, a) -> np.ndarray:
    if not _is_f32c(a):
        if np.asarray(a).dtype.kind not in "biuf":
            raise TypeError(f"{name}: expected a numeric (float32) array, got dtype {np.asarray(a).dtype}")
        a = np.ascontiguousarray(a, dtype=np.float32)
    if a.ndim != 2 or a.shape[0] < 1 or a.shape[1] < 1:
        raise ValueError(f"{name}: expected a non-empty 2-d array (batch, outputs), got shape {a.shape}")
    return a


def _grad_out(d_out, shape) -> np.ndarray:
    if d_out is None:
        return np.zeros((0, shape[1]), np.float32)
    if type(d_out) is not np.ndarray or d_out.dtype != _F32:
        raise TypeError(f"d_out: expected a float32 numpy array, got {type(d_out).__name__} "
                        f"{getattr(d_out, 'dtype', '')}")
    if d_out.shape != shape or not d_out.flags.c_contiguous or not d_out.flags.writeable:
        raise ValueError(f"d_out: expected a writable C-contiguous array of shape {shape}, got {d_out.shape}")
    return d_out


def as_labels(labels, B: int) -> np.ndarray:
    labels = np.asarray(labels)
    if labels.dtype.kind not in "iu":
        raise TypeError(f"labels: expected an integer array, got dtype {labels.dtype}")
    if labels.shape != (B,):
        raise ValueError(f"labels: expected shape ({B},), got {labels.shape}")
    return labels


def cross_entropy_loss(logits, labels, d_out=None) -> float:
    """Mean softmax cross-entropy of ``logits`` (B, K) against integer ``labels`` (B,) in [0, K).

    loss = (1/B) sum_i [log sum_k exp(logits[i,k]) - logits[i, labels[i]]]  (max-shifted)
    If ``d_out`` (B, K) float32 is given: d_out = (softmax(logits) - onehot(labels)) / B.
    """
    logits = as_f32_2d("logits", logits)
    labels = as_labels(labels, logits.shape[0])
    return float(softmax_cross_entropy(logits, labels, _grad_out(d_out, logits.shape)))


def mse_loss(y, target, d_out=None) -> float:
    """Mean squared error over batch AND outputs: loss = (1/(B K)) sum (y - t)^2.

    y, target (B, K); if ``d_out`` (B, K) float32 is given: d_out = 2 (y - t) / (B K).
    """
    y = as_f32_2d("y", y)
    target = as_f32_2d("target", target)
    if target.shape != y.shape:
        raise ValueError(f"target: expected shape {y.shape} (as y), got {target.shape}")
    return float(mse(y, target, _grad_out(d_out, y.shape)))


def accuracy(logits, labels) -> float:
    """Share of rows whose argmax (ties: lowest index) equals the label; logits (B, K), labels (B,)."""
    logits = as_f32_2d("logits", logits)
    labels = as_labels(labels, logits.shape[0])
    return float(np.mean(np.argmax(logits, axis=1) == labels))
