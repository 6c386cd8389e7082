r"""The convolutional model (:class:`Cnn`), with the buffers (:class:`CnnScratch`, :class:`CnnGradients`)
the training loop drives it through, the way it drives :class:`~qatlab.nn.mlp.Mlp`.

Layers, for input images (C, H, W) given as rows of ``C*H*W`` features (or as (B, C, H, W))::

    conv l  (l < len(conv_channels)):  a = act(conv(in, Wq_l) + b_l)   k x k, stride 1, no padding
                                       a -> activation quantizer (if any) -> max pool (if pool > 1)
    flatten, then dense layers [F, *hidden, K] as in Mlp (no activation on the last).

Layer ``i`` counts the convolutions first, then the dense layers; ``weights(i)`` is the (out, in)
matrix of every layer -- for a convolution the (Cout, C*k*k) view of its (Cout, C, k, k) kernel
(:meth:`Cnn.conv_weight`) -- so weight quantizers (per tensor or per output channel), the ternary
quantizer, LSQ scales, optimizers and the loop's metrics see conv and dense layers alike.
Activation quantizers: one per layer but the last (after each conv's activation, before its pool,
and after each hidden dense layer's activation). Parameters live in one flat float32 buffer
``w0, b0, w1, b1, ...`` (:meth:`Cnn.flat_params`), mirrored by :class:`CnnGradients`.
"""
from __future__ import annotations

import math
import numbers

import numpy as np

from ..runtime import parallel
from ..kernels.conv import cols_to_nchw, maxpool_backward, maxpool_forward
from ..kernels.dense import ACT_CODES, IDENTITY, RELU, act_backward_inplace, bias_act_inplace
from .layers import (ConvGeom, by_chunks, by_images, conv_backward_chunk, conv_forward_chunk, grad_parts,
                     he_normal, pair, pool_size, sum_parts)
from .mlp import Gradients, QuantizedLayers, check_choice, flat_views, layer_index, readonly


def check_image_shape(image_shape) -> tuple[int, int, int]:
    if isinstance(image_shape, (str, bytes)) or not hasattr(image_shape, "__len__") or len(image_shape) != 3:
        raise ValueError(f"image_shape: expected (channels, height, width), got {image_shape!r}")
    out = []
    for v in image_shape:
        if isinstance(v, bool) or not isinstance(v, numbers.Integral) or v < 1:
            raise ValueError(f"image_shape: expected three positive ints (C, H, W), got {image_shape!r}")
        out.append(int(v))
    return tuple(out)


def conv_plan(image_shape, conv_channels, kernel_size, pool):
    """[(ConvGeom, pool window (ph, pw), pooled (C, H, W))] of each conv layer; ValueError naming
    ``kernel_size`` or ``pool`` when a window does not fit its feature map. Allocates nothing.
    For height-1 images (1-d signals) an int kernel_size k means (1, k) and an int pool p (1, p)."""
    c, h, w = check_image_shape(image_shape)
    if isinstance(conv_channels, (str, bytes)) or not hasattr(conv_channels, "__len__") or not len(conv_channels):
        raise ValueError(f"conv_channels: expected a non-empty list of positive ints, got {conv_channels!r}")
    kh, kw = pair("kernel_size", kernel_size, 1)
    ph, pw = pair("pool", pool, 1)
    if h == 1 and not isinstance(kernel_size, (tuple, list)):
        kh = 1
    if h == 1 and not isinstance(pool, (tuple, list)):
        ph = 1
    plan = []
    for l, co in enumerate(conv_channels):
        if isinstance(co, bool) or not isinstance(co, numbers.Integral) or co < 1:
            raise ValueError(f"conv_channels[{l}]: expected a positive int, got {co!r}")
        if kh > h or kw > w:
            raise ValueError(f"kernel_size: {kh}x{kw} is larger than conv layer {l}'s {h}x{w} input "
                             f"(image {tuple(image_shape)}); use a smaller kernel_size or pool, or fewer conv layers")
        g = ConvGeom(c, int(co), kh, kw, 1, 1, 0, 0, h, w)
        if ph > g.oh or pw > g.ow:
            raise ValueError(f"pool: a {ph}x{pw} window is larger than conv layer {l}'s "
                             f"{g.oh}x{g.ow} output; use a smaller pool or kernel_size")
        c, h, w = int(co), pool_size(g.oh, ph, ph), pool_size(g.ow, pw, pw)
        plan.append((g, (ph, pw), (c, h, w)))
    return plan


class Cnn(QuantizedLayers):
    """[conv -> activation -> (quantizer) -> max pool] x len(conv_channels), flatten, dense layers.

    image_shape: (C, H, W) of the inputs (a 1-d signal is (C, 1, L): kernels then span one row,
    ``(1, k)``, and pools ``(1, pool)``). conv_channels: output channels of each conv layer.
    n_outputs: K. hidden: dense hidden sizes after the flatten. kernel_size: an int k (k x k) or
    (kh, kw); pool: max-pool window and stride after each conv (1 = none). activation: as Mlp's.
    Weights He-normal, drawn layer by layer from ``np.random.default_rng(seed)``; biases 0.
    """

    def __init__(self, image_shape, conv_channels, n_outputs, hidden=(), kernel_size=5, pool=2,
                 activation="relu", seed=0, weight_quantizers=None, activation_quantizers=None):
        self.image_shape = check_image_shape(image_shape)
        self._plan = conv_plan(self.image_shape, conv_channels, kernel_size, pool)
        self.conv_channels = tuple(int(c) for c in conv_channels)
        self.kernel_size = self._plan[0][0].kh, self._plan[0][0].kw
        self.pool = self._plan[0][1]
        self.activation = check_choice("activation", activation, tuple(ACT_CODES))
        self._act = ACT_CODES[self.activation]
        for name, v, lo in (("n_outputs", n_outputs, 1), ("seed", seed, 0)):
            if isinstance(v, bool) or not isinstance(v, numbers.Integral) or v < lo:
                raise ValueError(f"{name}: expected an int >= {lo}, got {v!r}")
        hidden = list(hidden)
        for j, h in enumerate(hidden):
            if isinstance(h, bool) or not isinstance(h, numbers.Integral) or h < 1:
                raise ValueError(f"hidden[{j}]: expected a positive int, got {h!r}")
        self.n_conv = len(self._plan)
        self.dense_sizes = (math.prod(self._plan[-1][2]), *map(int, hidden), int(n_outputs))
        self.num_layers = self.n_conv + len(self.dense_sizes) - 1
        self.n_features = math.prod(self.image_shape)
        # sizes: the features entering the model and leaving each layer (after its pool), as Mlp.sizes
        self.sizes = (self.n_features, *(math.prod(s) for _, _, s in self._plan), *self.dense_sizes[1:])
        self.bias = True
        self._entries, off = [], 0
        for i, (o, n_in) in enumerate(self._matrix_shapes()):
            self._entries += [(f"w{i}", (o, n_in), off), (f"b{i}", (o,), off + o * n_in)]
            off += o * n_in + o
        self._flat = np.zeros(off, np.float32)
        views = flat_views(self._flat, self._entries)
        self._w, self._b = views[::2], views[1::2]
        rng = np.random.default_rng(int(seed))
        for w in self._w:
            w[:] = he_normal(rng, w.shape, w.shape[1])
        self.set_quantizers(weight_quantizers, activation_quantizers)
        self._last_batch = 0

    def _matrix_shapes(self):
        return [(g.c_out, g.ck) for g, _, _ in self._plan] + list(zip(self.dense_sizes[1:], self.dense_sizes[:-1]))

    def conv_weight(self, i: int) -> np.ndarray:
        """Conv layer i's kernel as a writable (Cout, C, kh, kw) view of the same memory."""
        g = self._plan[layer_index(i, self.n_conv)][0]
        return self._w[i].reshape(g.c_out, g.c_in, g.kh, g.kw)

    def biases(self, i: int) -> np.ndarray:
        return self._b[layer_index(i, self.num_layers)]

    def layer_specs(self) -> list[dict]:
        """One dict per layer for summaries and exports: kind ("conv" | "dense"), weight_shape
        (conv: (Cout, C, kh, kw)), in_shape / out_shape (per sample, out after the pool), pool
        window, and macs (multiply-adds per sample)."""
        specs, shape = [], self.image_shape
        for g, p, pooled in self._plan:
            specs.append({"kind": "conv", "weight_shape": (g.c_out, g.c_in, g.kh, g.kw), "in_shape": shape,
                          "conv_shape": (g.c_out, g.oh, g.ow), "out_shape": pooled, "pool": p,
                          "macs": g.c_out * g.ck * g.p})
            shape = pooled
        for n_in, n_out in zip(self.dense_sizes[:-1], self.dense_sizes[1:]):
            specs.append({"kind": "dense", "weight_shape": (n_out, n_in), "in_shape": (n_in,),
                          "out_shape": (n_out,), "pool": None, "macs": n_in * n_out})
        return specs

    # -- buffers -------------------------------------------------------------------------------
    def scratch(self, batch_size: int, backward: bool = True) -> "CnnScratch":
        """Forward buffers for batches of up to ``batch_size`` rows. ``backward=False`` (evaluation
        only) keeps the im2col buffers to :data:`INFERENCE_ROWS` rows: the conv layers then run in
        chunks of that many, and :meth:`backward` refuses the scratch."""
        return CnnScratch(self, batch_size, backward)

    def gradients(self, batch_size: int | None = None) -> "CnnGradients":
        return CnnGradients(self, batch_size)

    # -- forward / backward --------------------------------------------------------------------
    def checked_input(self, x, scratch) -> np.ndarray:
        if not isinstance(scratch, CnnScratch) or scratch._model is not self:
            raise TypeError(f"scratch: expected a CnnScratch from this model's scratch(batch_size), got {scratch!r}")
        if type(x) is not np.ndarray or x.dtype != np.float32 or not x.flags.c_contiguous:
            if np.asarray(x).dtype.kind not in "biuf":
                raise TypeError(f"x: expected a numeric (float32) array, got dtype {np.asarray(x).dtype}")
            x = np.ascontiguousarray(x, dtype=np.float32)
        B = x.shape[0] if x.ndim else 0
        if x.shape[1:] not in ((self.n_features,), self.image_shape) or not 1 <= B <= scratch.batch_size:
            raise ValueError(f"x: expected shape (batch, {self.n_features}) or (batch, *{self.image_shape}) with "
                             f"1 <= batch <= {scratch.batch_size} (the scratch's batch_size), got {x.shape}")
        return x

    def forward(self, x, scratch: "CnnScratch") -> np.ndarray:
        """Logits (B, K), a view into ``scratch`` valid until its next forward; x (B, C*H*W) or
        (B, C, H, W), B <= scratch.batch_size."""
        x_in = x
        x = self.checked_input(x, scratch)
        B = x.shape[0]
        s = scratch._at(B)
        a = x.reshape(B, *self.image_shape)
        R = scratch._conv_rows
        for l in range(self.n_conv):
            self._weights_for(l, scratch)
        scratch._fused = [self._pool_fused(l) for l in range(self.n_conv)]
        for stage in self._stages():
            for r0 in range(0, B, R):   # one block unless the scratch is for evaluation only
                n, c = min(R, B - r0), scratch._at(min(R, B - r0))
                by_chunks(lambda lo, hi: self._forward_chunk(scratch, stage, a, s, c, r0, n, lo, hi), n,
                          c.cols[stage[0]].size)
            l, p = stage[-1], self._plan[stage[-1]][1]
            a = s.pooled[l]
            aq = self._aq[l]
            if aq is not None:      # quantize the whole batch's activations, then pool them
                aq.forward(s.act[l], s.actq[l])
                if p != (1, 1):
                    y, idx, aq_out = s.pooled[l], s.idx[l], s.actq[l]
                    by_images(lambda lo, hi: maxpool_forward(aq_out[lo:hi], *p, *p, y[lo:hi], idx[lo:hi]),
                              B, aq_out.size)
        a = a.reshape(B, -1)
        last = self.num_layers - 1
        for i in range(self.n_conv, last + 1):
            w = self._weights_for(i, scratch)
            s.a_in[i] = a
            h = s.h[i - self.n_conv]
            parallel.dot(a, w.T, out=h)
            bias_act_inplace(h, self._b[i], IDENTITY if i == last else self._act)
            aq = self._aq[i] if i < last else None
            if aq is not None:
                aq.forward(h, s.hq[i - self.n_conv])
                a = s.hq[i - self.n_conv]
            else:
                a = h
        scratch.batch = B
        scratch._spent = False
        scratch._x_in = x_in
        self._last_batch = B
        return s.h[-1]

    def _stages(self) -> list[list[int]]:
        """Runs of conv layers that go chunk by chunk together: a layer with an activation quantizer
        (which sees the whole batch) ends its run."""
        stages, run = [], []
        for l in range(self.n_conv):
            run.append(l)
            if self._aq[l] is not None or l == self.n_conv - 1:
                stages.append(run)
                run = []
        return stages

    def _forward_chunk(self, scratch, stage, a, s, c, r0, n, lo, hi) -> None:
        """The conv layers of ``stage`` (activation and pool included, but a quantized activation's)
        for images r0+lo..r0+hi of the block r0..r0+n, whose im2col and product buffers are c's."""
        blk = slice(r0, r0 + n)
        for l in stage:
            g, p, _ = self._plan[l]
            w = scratch._w_used[l]
            if scratch._fused[l]:
                conv_forward_chunk(g, a[blk], w, self._b[l], self._act, c.cols[l], c.z[l], s.pooled[l][blk],
                                   p, s.idx[l][blk], lo, hi)
            else:
                conv_forward_chunk(g, a[blk], w, self._b[l], self._act, c.cols[l], c.z[l], s.act[l][blk],
                                   None, None, lo, hi)
                if p != (1, 1) and self._aq[l] is None:
                    part = slice(r0 + lo, r0 + hi)
                    maxpool_forward(s.act[l][part], *p, *p, s.pooled[l][part], s.idx[l][part])
            a = s.pooled[l]

    def _backward_chunk(self, stage, scratch, s, gb, dx_input, lo, hi) -> None:
        """The backward of the conv layers of ``stage``, top to bottom, for images lo..hi: per-chunk
        gradients into the scratch's parts, input gradients into gb (dx_input: the first layer's)."""
        for l in reversed(stage):
            g, p, _ = self._plan[l]
            dx = gb.g_out[l - 1] if l > 0 else dx_input
            # dz goes where the forward's product was, dcols where its im2col matrix was (read for
            # dW just before): 40% less memory touched than separate buffers
            args = (s.cols[l], scratch._w_used[l], s.z[l], scratch._parts[l], s.cols[l] if dx is not None else None, dx)
            if scratch._fused[l]:
                conv_backward_chunk(g, gb.g_out[l], s.pooled[l], self._act, *args, s.idx[l], lo, hi)
                continue
            if p != (1, 1) and self._aq[l] is None:
                part = slice(lo, hi)
                maxpool_backward(gb.g_out[l][part], s.idx[l][part], gb.g_act[l][part])
            conv_backward_chunk(g, gb.g_act[l], s.act[l], self._act, *args, None, lo, hi)

    def _pool_fused(self, l: int) -> bool:
        """Whether conv layer l's activation and max pool run fused (:func:`~qatlab.kernels.conv.bias_act_pool`):
        a pool, no activation quantizer between, and an activation that commutes with max."""
        return self._plan[l][1] != (1, 1) and self._aq[l] is None and self._act in (RELU, IDENTITY)

    def _weights_for(self, i, scratch) -> np.ndarray:
        q = self._wq[i]
        if q is None:
            scratch._w_used[i] = self._w[i]
        else:
            q.forward(self._w[i], scratch._wq[i])
            scratch._w_used[i] = scratch._wq[i]
        return scratch._w_used[i]

    def backward(self, x, scratch: "CnnScratch", grads: "CnnGradients", need_input_grad: bool = True):
        """Backpropagate ``grads.d_output()`` through the last ``forward(x, scratch)``: overwrites every
        parameter gradient (latent: after the weight quantizers' STE); returns dL/dx (B, C*H*W), or
        None when ``need_input_grad`` is False (the first conv then skips its input gradient).
        One backward per forward: it writes its conv gradients into the forward's im2col buffers."""
        if not isinstance(grads, CnnGradients) or grads._model is not self:
            raise TypeError(f"grads: expected CnnGradients from this model's gradients(), got {grads!r}")
        if not isinstance(scratch, CnnScratch) or scratch._model is not self:
            raise TypeError(f"scratch: expected a CnnScratch from this model's scratch(batch_size), got {scratch!r}")
        B = scratch.batch
        if B == 0:
            raise ValueError("scratch: run forward(x, scratch) before backward(x, scratch, grads)")
        if not scratch.backward:
            raise ValueError("scratch: made with backward=False (evaluation only); use model.scratch(batch_size)")
        if scratch._spent:
            raise ValueError("scratch: backward already ran for the last forward (it reuses the forward's "
                             "im2col buffers); run forward(x, scratch) again")
        if x is not scratch._x_in and self.checked_input(x, scratch).shape[0] != B:
            raise ValueError(f"x: backward got {np.shape(x)[0]} rows but the last forward had {B}")
        if grads._cap < B:
            raise ValueError(f"grads: d_output has {grads._cap} rows, the batch has {B}; "
                             "write dL/dy into grads.d_output_mut() after forward")
        s, gb = scratch._at(B), grads._at(B)
        last, nc = self.num_layers - 1, self.n_conv
        for i in range(last, nc - 1, -1):
            d, h = gb.delta[i - nc + 1], s.h[i - nc]
            act_backward_inplace(d, h, IDENTITY if i == last else self._act, grads._db[i])
            parallel.dot(d.T, s.a_in[i], out=grads._dw[i])
            self._weight_ste(i, grads)
            parallel.dot(d, scratch._w_used[i], out=gb.delta[i - nc])
            aq = self._aq[i - 1]
            if aq is not None and i > nc:
                aq.backward(gb.delta[i - nc], s.h[i - nc - 1], gb.delta[i - nc])
        dx_input = gb.d_input4 if need_input_grad else None
        for stage in reversed(self._stages()):
            l, p = stage[-1], self._plan[stage[-1]][1]
            aq = self._aq[l]
            if aq is not None:     # the whole batch through the pool and the activation quantizer first
                if p != (1, 1):
                    d, idx, da = gb.g_out[l], s.idx[l], gb.g_act[l]
                    by_images(lambda lo, hi: maxpool_backward(d[lo:hi], idx[lo:hi], da[lo:hi]), B, da.size)
                aq.backward(gb.g_act[l], s.act[l], gb.g_act[l])
            by_chunks(lambda lo, hi: self._backward_chunk(stage, scratch, s, gb, dx_input, lo, hi), B,
                      s.cols[stage[0]].size)
            for l in stage:
                sum_parts(scratch._parts[l], B, grads._dw[l], grads._db[l])
                self._weight_ste(l, grads)
        scratch._spent = True
        grads._input_batch = B if need_input_grad else 0
        return grads.d_input() if need_input_grad else None

    def _weight_ste(self, i, grads) -> None:
        q = self._wq[i]
        if q is not None:
            q.backward(grads._dw[i], self._w[i], grads._dw[i])

    def export(self, path) -> str:
        """Write integer weights, scales and architecture to ``path`` (.npz); see :mod:`qatlab.nn.export`."""
        from .export import export_model
        return export_model(self, path)

    def __repr__(self) -> str:
        q = sum(q is not None for q in self._wq), sum(q is not None for q in self._aq)
        return (f"Cnn(image_shape={self.image_shape}, conv_channels={list(self.conv_channels)}, "
                f"kernel_size={self.kernel_size}, pool={self.pool}, dense={list(self.dense_sizes)}, "
                f"activation={self.activation!r}, quantized weights/activations={q[0]}/{q[1]})")


#: Rows of the im2col buffers of an evaluation-only scratch (``Cnn.scratch(n, backward=False)``).
INFERENCE_ROWS = 128


class _Rows:
    """Views of a buffer set for a batch of B rows (contiguous: cut from flat buffers)."""


def _cut(flat: np.ndarray, shape) -> np.ndarray:
    return flat[:math.prod(shape)].reshape(shape)


class CnnScratch:
    """Forward buffers of a :class:`Cnn` for batches of up to ``batch_size`` rows (allocated once):
    per conv layer its im2col matrix, product, activation output, quantized activation and pooled
    output (+ argmax indices); per dense layer its output and quantized activation; per layer a
    quantized-weight buffer. ``batch`` is the row count of the last forward (0 before any). The
    backward reuses the im2col and product buffers for its own conv gradients and keeps each chunk
    of images' weight gradients apart (summed in chunk order)."""

    def __init__(self, model: Cnn, batch_size: int, backward: bool = True):
        if isinstance(batch_size, bool) or not isinstance(batch_size, numbers.Integral) or batch_size < 1:
            raise ValueError(f"batch_size: expected an int >= 1, got {batch_size!r}")
        if not isinstance(backward, (bool, np.bool_)):
            raise TypeError(f"backward: expected a bool, got {backward!r}")
        self._model = model
        self.sizes = model.sizes
        self.batch_size = cap = int(batch_size)
        self.backward = bool(backward)
        self._conv_rows = rows = cap if backward else min(cap, INFERENCE_ROWS)
        self.batch = 0
        self._cols, self._z, self._act, self._actq, self._pooled, self._idx = [], [], [], [], [], []
        for l, (g, p, pooled) in enumerate(model._plan):
            self._cols.append(np.empty(g.ck * rows * g.p, np.float32))
            self._z.append(np.empty(g.c_out * rows * g.p, np.float32))
            self._act.append(np.empty((cap, g.c_out, g.oh, g.ow), np.float32))
            self._actq.append(np.empty_like(self._act[-1]) if model._aq[l] is not None else None)
            pooling = p != (1, 1)
            self._pooled.append(np.empty((cap, *pooled), np.float32) if pooling else None)
            self._idx.append(np.empty((cap, *pooled), np.int32) if pooling else None)
        self._h = [np.empty((cap, n), np.float32) for n in model.dense_sizes[1:]]
        self._hq = [np.empty((cap, n), np.float32) for n in model.dense_sizes[1:-1]]
        self._wq = [np.empty(shape, np.float32) for shape in model._matrix_shapes()]
        self._w_used = [None] * model.num_layers
        self._parts = [grad_parts(g, cap) for g, _, _ in model._plan] if backward else None
        self._fused = [False] * model.n_conv   # conv layer l's last forward pooled fused (act map not written)
        self._x_in = None
        self._spent = False     # backward ran since the last forward (it overwrote cols and z)
        self._views = {}

    def _at(self, B: int) -> _Rows:
        r = self._views.get(B)
        if r is None:
            m, r = self._model, _Rows()
            n = min(B, self._conv_rows)   # the im2col buffers hold a chunk of rows (evaluation) or all
            r.cols = [_cut(c, (g.ck, n * g.p)) for c, (g, _, _) in zip(self._cols, m._plan)]
            r.z = [_cut(z, (g.c_out, n * g.p)) for z, (g, _, _) in zip(self._z, m._plan)]
            r.act = [a[:B] for a in self._act]
            r.actq = [a[:B] if a is not None else None for a in self._actq]
            r.pooled = [p[:B] if p is not None else (q if q is not None else a)
                        for p, q, a in zip(self._pooled, r.actq, r.act)]
            r.idx = [i[:B] if i is not None else None for i in self._idx]
            r.h = [h[:B] for h in self._h]
            r.hq = [h[:B] for h in self._hq]
            r.a_in = [None] * (m.num_layers + 1)
            self._views[B] = r
        return r

    def output(self) -> np.ndarray:
        """Logits (batch, K) of the last forward."""
        return self._at(self.batch).h[-1]

    def weights_used(self, i: int) -> np.ndarray:
        """The (out, in) weights layer i used in the last forward: the quantized copy or the latent."""
        return self._w_used[layer_index(i, len(self._w_used))]

    def conv_output(self, l: int) -> np.ndarray:
        """Conv layer l's activation output (batch, Cout, OH, OW) (before its quantizer and pool).
        A fused pool does not write it: it is then made here from the product the forward kept
        (ValueError after the backward, which reuses that buffer)."""
        l = layer_index(l, len(self._act))
        r = self._at(self.batch)
        if self._fused[l]:
            if self._spent or self._conv_rows < self.batch:
                raise ValueError(f"l: conv layer {l}'s activations are not kept (fused with its pool); "
                                 "read them after a forward on a training scratch, before backward")
            g = self._model._plan[l][0]
            cols_to_nchw(r.z[l], self._model.biases(l), self._model._act, 0, self.batch,
                         r.act[l].reshape(self.batch, g.c_out, g.p))
        return r.act[l]


class CnnGradients(Gradients):
    """Gradient buffers of a :class:`Cnn` (overwrite semantics), laid out like its flat parameters;
    the per-sample buffers (d_output, d_input, each layer's output gradient) grow to the batch.
    Same reading methods as :class:`~qatlab.nn.mlp.Gradients` (flat, d_weights, d_output_mut, ...)."""

    def __init__(self, model: Cnn, batch_size=None):
        self._model = model
        self._entries = model._entries
        self._flat = np.zeros(model.num_params, np.float32)
        views = flat_views(self._flat, self._entries)
        self._dw, self._db = views[::2], views[1::2]
        self._dw_ro = [readonly(a) for a in self._dw]
        self._db_ro = [readonly(a) for a in self._db]
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
        m = self._model
        self._g_out = [np.empty((B, *pooled), np.float32) for _, _, pooled in m._plan]
        self._g_act = [np.empty((B, g.c_out, g.oh, g.ow), np.float32) if p != (1, 1) else None
                       for g, p, _ in m._plan]
        self._dense = [np.empty((B, n), np.float32) for n in m.dense_sizes[1:]]
        self._delta = self._dense            # (Gradients' name; the last one is d_output)
        self._d_input = np.empty((B, m.n_features), np.float32)
        self._cap = B
        self._cache = {}

    def _at(self, B) -> _Rows:
        r = self._cache.get(("at", B))
        if r is None:
            m, r = self._model, _Rows()
            r.g_out = [a[:B] for a in self._g_out]
            r.g_act = [a[:B] if a is not None else o for a, o in zip(self._g_act, r.g_out)]
            # delta[j]: dL/d(input of dense layer j), the last one d_output; delta[0] is the flattened conv output
            r.delta = [r.g_out[-1].reshape(B, -1)] + [a[:B] for a in self._dense]
            r.d_input4 = self._d_input[:B].reshape(B, *m.image_shape)
            self._cache[("at", B)] = r
        return r

    def _rows(self, B):
        """(deltas, their transposes, d_input), as :meth:`Gradients._rows`; deltas[-1] is d_output."""
        r = self._cache.get(("rows", B))
        if r is None:
            d = self._at(B).delta
            r = self._cache[("rows", B)] = (d, [a.T for a in d], self._d_input[:B])
        return r
