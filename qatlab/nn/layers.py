r"""Layers: :class:`Conv2d`, :class:`MaxPool2d`, :class:`Flatten`, :class:`Linear` (float32, NCHW).

Each layer has ``forward(x) -> y`` and ``backward(dy) -> dx`` (dL/dy of the last forward in, dL/dx
out); layers with weights also store ``grad_weight`` / ``grad_bias``. ``weight`` is (out, in, kh, kw)
for a convolution and (out, in) for a linear layer, ``bias`` (out,); both writable float32 arrays.
The arrays a layer returns are its own buffers, overwritten by its next call (allocated once per
input shape). Weights start He-normal (std sqrt(2 / fan_in)) from ``np.random.default_rng(seed)``,
biases at 0.

:class:`ConvGeom` with :func:`conv_forward` / :func:`conv_backward` is the convolution on
caller-owned buffers, run in chunks of images (:func:`by_chunks`); :class:`~qatlab.nn.cnn.Cnn`
drives the same per-chunk functions with its own buffers, several layers per chunk.
"""
from __future__ import annotations

import math
import numbers
import threading
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass

import numpy as np

from ..runtime import fpmode, parallel
from ..kernels.conv import (bias_act_pool, col2im, cols_to_nchw, im2col, maxpool_backward, maxpool_forward,
                            nchw_to_cols, pool_to_cols)
from ..kernels.dense import IDENTITY, bias_grad


def _int(name: str, v, lo: int) -> int:
    if isinstance(v, bool) or not isinstance(v, numbers.Integral):
        raise TypeError(f"{name}: expected an int >= {lo}, got {v!r}")
    if v < lo:
        raise ValueError(f"{name}: expected an int >= {lo}, got {v!r}")
    return int(v)


def pair(name: str, v, lo: int) -> tuple[int, int]:
    """(h, w) from an int or a pair of ints, each >= lo (TypeError/ValueError naming ``name``)."""
    if isinstance(v, (tuple, list)):
        if len(v) != 2:
            raise ValueError(f"{name}: expected an int or a pair (h, w) of ints >= {lo}, got {v!r}")
        return _int(name, v[0], lo), _int(name, v[1], lo)
    return (_int(name, v, lo),) * 2


def he_normal(rng, shape, fan_in: int) -> np.ndarray:
    return (rng.standard_normal(shape) * math.sqrt(2.0 / fan_in)).astype(np.float32)


def _f32(name: str, x, ndim: int) -> np.ndarray:
    if type(x) is not np.ndarray or x.dtype != np.float32 or not x.flags.c_contiguous:
        if np.asarray(x).dtype.kind not in "biuf":
            raise TypeError(f"{name}: expected a numeric (float32) array, got dtype {np.asarray(x).dtype}")
        x = np.ascontiguousarray(x, dtype=np.float32)
    if x.ndim != ndim:
        raise ValueError(f"{name}: expected a {ndim}-d array, got shape {x.shape}")
    return x


#: A product of at least this many multiply-adds is split in :data:`GEMM_PARTS` column blocks
#: (the thread hand-off is then a small part of the product).
MIN_SPLIT_MACS = 1 << 22
#: Column blocks of a split product: fixed, not the core count, because BLAS computes a block's
#: columns in the last bits differently from the whole product's; one core runs them one by one.
GEMM_PARTS = 2
#: A product with fewer columns than this stays whole (two OpenBLAS calls on a narrow product at
#: once are slower than one whole).
MIN_BLOCK_COLUMNS = 64


def gemm(a: np.ndarray, b: np.ndarray, out: np.ndarray) -> np.ndarray:
    """out = a @ b (float32); large products with enough columns in :data:`GEMM_PARTS` column blocks
    of b/out, run on the cores. The blocks depend only on the shapes, so a run gives the same bits
    on any core count."""
    m, k = a.shape
    n = b.shape[1]
    if m * k * n < MIN_SPLIT_MACS or n < MIN_BLOCK_COLUMNS:
        return np.dot(a, b, out=out)
    parallel.split_rows(lambda lo, hi: np.matmul(a, b[:, lo:hi], out=out[:, lo:hi]), n, GEMM_PARTS)
    return out


def by_images(fn, n_images: int, n_elements: int) -> None:
    """``fn(lo, hi)`` over ranges of images, on the cores when the buffer is large (the ranges write
    disjoint parts of the output, so the result is the same however they are split)."""
    if n_elements >= parallel.MIN_ELEMENTS and n_images >= 2 * parallel.cores():
        parallel.split_rows(fn, n_images, parallel.cores())
    else:
        fn(0, n_images)


#: A convolution works on chunks of this many images: each chunk's im2col, products, activation and
#: pool run together on one core (its data stay in that core's cache), the cores take chunks as they
#: get free, and weight gradients are summed over chunks in chunk order, so the bits depend on the
#: batch size only, never on the core count or on which core ran what.
CHUNK_IMAGES = 16

_helpers: ThreadPoolExecutor | None = None


def n_chunks(n_images: int) -> int:
    return -(-n_images // CHUNK_IMAGES)


def by_chunks(fn, n_images: int, n_elements: int) -> None:
    """``fn(lo, hi)`` for each chunk of :data:`CHUNK_IMAGES` images (chunks write disjoint outputs).
    When there are several and the work (``n_elements`` touched) is large, helper threads take chunks
    from a shared queue beside the caller. The caller never waits for a helper that has not started
    (on a loaded machine it may not get a core for milliseconds): it withdraws it and runs the
    remaining chunks itself; it only waits for chunks a helper is running."""
    global _helpers
    n = n_chunks(n_images)

    def run(k):
        fn(k * CHUNK_IMAGES, min((k + 1) * CHUNK_IMAGES, n_images))

    if n < 2 or parallel.cores() < 2 or n_elements < parallel.MIN_ELEMENTS:
        for k in range(n):
            run(k)
        return
    queue, taking = iter(range(n)), threading.Lock()

    def work():
        while True:
            with taking:
                k = next(queue, None)
            if k is None:
                return
            run(k)

    if _helpers is None:
        _helpers = ThreadPoolExecutor(parallel.cores() - 1, thread_name_prefix="qatlab-chunks")
    mode = fpmode.get_mode()          # helpers compute in the caller's floating-point mode
    helpers = [_helpers.submit(_in_mode, mode, work) for _ in range(min(parallel.cores(), n) - 1)]
    try:
        work()
    finally:
        for f in helpers:
            if not f.cancel():
                f.result()


def _in_mode(mode, fn) -> None:
    before = fpmode.get_mode()
    fpmode.set_mode(mode)
    try:
        fn()
    finally:
        fpmode.set_mode(before)


@dataclass(frozen=True)
class ConvGeom:
    """Shapes of one convolution over (C, H, W) images: output (Cout, OH, OW), ``ck = C*kh*kw`` rows
    of its im2col matrix and ``p = OH*OW`` columns per image."""

    c_in: int
    c_out: int
    kh: int
    kw: int
    sh: int
    sw: int
    ph: int
    pw: int
    h: int
    w: int

    @property
    def oh(self) -> int:
        return (self.h + 2 * self.ph - self.kh) // self.sh + 1

    @property
    def ow(self) -> int:
        return (self.w + 2 * self.pw - self.kw) // self.sw + 1

    @property
    def ck(self) -> int:
        return self.c_in * self.kh * self.kw

    @property
    def p(self) -> int:
        return self.oh * self.ow

    def check(self, name: str = "kernel_size") -> "ConvGeom":
        """ValueError naming ``name`` when the kernel is larger than the padded image."""
        if self.kh > self.h + 2 * self.ph or self.kw > self.w + 2 * self.pw:
            raise ValueError(f"{name}: a {self.kh}x{self.kw} kernel does not fit a {self.h}x{self.w} "
                             f"feature map (padding {self.ph}x{self.pw})")
        return self


def conv_forward_chunk(g: ConvGeom, x, w2, bias, act: int, cols, z, y, pool, idx, lo: int, hi: int) -> None:
    """:func:`conv_forward` for images lo <= b < hi (writes those images' parts of cols, z, y, idx)."""
    B, P = x.shape[0], g.p
    im2col(x, g.kh, g.kw, g.sh, g.sw, g.ph, g.pw, lo, hi, cols)
    np.matmul(w2, cols[:, lo * P:hi * P], out=z[:, lo * P:hi * P])
    if pool is None:
        cols_to_nchw(z, bias, act, lo, hi, y.reshape(B, g.c_out, P))
    else:
        bias_act_pool(z, bias, act, pool[0], pool[1], g.oh, g.ow, lo, hi, y, idx)


def conv_forward(g: ConvGeom, x, w2, bias, act: int, cols, z, y, pool=None, idx=None) -> None:
    """y = act(conv(x) + bias) (B, Cout, OH, OW) for x (B, C, H, W); w2 (Cout, ck); scratch cols
    (ck, B*p) and z (Cout, B*p) (kept for the backward). With ``pool`` = (ph, pw) (act RELU or
    IDENTITY), y is instead the max pool of that (stride = window) and idx its argmax
    (:func:`~qatlab.kernels.conv.bias_act_pool`): the activation map is never written."""
    by_chunks(lambda lo, hi: conv_forward_chunk(g, x, w2, bias, act, cols, z, y, pool, idx, lo, hi),
              x.shape[0], cols.size)


def grad_parts(g: ConvGeom, n_images: int) -> tuple[np.ndarray, np.ndarray]:
    """Buffers of per-chunk weight and bias gradients of a convolution over up to n_images images."""
    n = n_chunks(n_images)
    return np.empty((n, g.c_out, g.ck), np.float32), np.empty((n, g.c_out), np.float32)


def conv_backward_chunk(g: ConvGeom, dy, y, act: int, cols, w2, dz, parts, dcols, dx, idx, lo: int, hi: int):
    """:func:`conv_backward` for images lo <= b < hi, leaving their chunk's gradients in ``parts``."""
    B, P = dy.shape[0], g.p
    k = lo // CHUNK_IMAGES
    if idx is None:
        nchw_to_cols(dy.reshape(B, g.c_out, P), y.reshape(B, g.c_out, P), act, lo, hi, dz, parts[1][k])
    else:
        pool_to_cols(dy, idx, y, act, P, lo, hi, dz, parts[1][k])
    np.matmul(dz[:, lo * P:hi * P], cols[:, lo * P:hi * P].T, out=parts[0][k])
    if dx is not None:
        np.matmul(w2.T, dz[:, lo * P:hi * P], out=dcols[:, lo * P:hi * P])
        col2im(dcols, g.kh, g.kw, g.sh, g.sw, g.ph, g.pw, lo, hi, dx)


def sum_parts(parts, n_images: int, dw2, db) -> None:
    """dw2, db = the sums of the chunks' gradients, in chunk order."""
    dw_parts, db_parts = parts
    dw2[:] = dw_parts[0]
    db[:] = db_parts[0]
    for k in range(1, n_chunks(n_images)):
        dw2 += dw_parts[k]
        db += db_parts[k]


def conv_backward(g: ConvGeom, dy, y, act: int, cols, w2, dz, parts, dw2, db, dcols=None, dx=None,
                  idx=None) -> None:
    """From dy = dL/dy (B, Cout, OH, OW) and the forward's y and cols: dw2 (Cout, ck), db (Cout,) and,
    when dx (B, C, H, W) is given, dx (through dcols (ck, B*p)). With ``idx`` (a pooled forward),
    dy and y are those of the pooled output. dz (Cout, B*p) is scratch; ``parts``
    (:func:`grad_parts`) hold each chunk's gradients, summed in chunk order."""
    by_chunks(lambda lo, hi: conv_backward_chunk(g, dy, y, act, cols, w2, dz, parts, dcols, dx, idx, lo, hi),
              dy.shape[0], cols.size)
    sum_parts(parts, dy.shape[0], dw2, db)


def pool_size(size: int, k: int, s: int) -> int:
    return (size - k) // s + 1


class Conv2d:
    """2-d convolution ``y = conv(x, weight) + bias`` (cross-correlation, as torch's conv2d).

    x (B, in_channels, H, W) -> y (B, out_channels, OH, OW), OH = (H + 2 ph - kh) // sh + 1.
    kernel_size, stride, padding: an int or a pair (h, w).
    """

    def __init__(self, in_channels, out_channels, kernel_size, stride=1, padding=0, seed=0):
        self.in_channels = _int("in_channels", in_channels, 1)
        self.out_channels = _int("out_channels", out_channels, 1)
        self.kernel_size = pair("kernel_size", kernel_size, 1)
        self.stride = pair("stride", stride, 1)
        self.padding = pair("padding", padding, 0)
        seed = _int("seed", seed, 0)
        kh, kw = self.kernel_size
        fan_in = self.in_channels * kh * kw
        self._w = he_normal(np.random.default_rng(seed), (self.out_channels, fan_in), fan_in)
        self._b = np.zeros(self.out_channels, np.float32)
        self._gw = np.zeros_like(self._w)
        self.grad_bias = np.zeros_like(self._b)
        self._bufs, self._g, self._last = None, None, None

    weight = property(lambda self: self._w.reshape(self.out_channels, self.in_channels, *self.kernel_size),
                      lambda self, v: _assign(self.weight, v, "weight"))
    bias = property(lambda self: self._b, lambda self, v: _assign(self._b, v, "bias"))
    grad_weight = property(lambda self: self._gw.reshape(self.weight.shape))

    def _buffers(self, shape):
        if self._bufs is None or self._bufs[0] != shape:
            B, C, H, W = shape
            g = ConvGeom(C, self.out_channels, *self.kernel_size, *self.stride, *self.padding, H, W).check()
            n = B * g.p
            self._g = g
            self._bufs = (shape, np.empty((g.ck, n), np.float32), np.empty((g.c_out, n), np.float32),
                          np.empty((B, g.c_out, g.oh, g.ow), np.float32), np.empty((g.ck, n), np.float32),
                          np.empty((B, C, H, W), np.float32), grad_parts(g, B))
        return self._bufs

    def forward(self, x) -> np.ndarray:
        """y (B, out_channels, OH, OW) for x (B, in_channels, H, W)."""
        x = _f32("x", x, 4)
        if x.shape[1] != self.in_channels or x.shape[0] < 1:
            raise ValueError(f"x: expected shape (batch >= 1, {self.in_channels}, H, W), got {x.shape}")
        _, cols, z, y, _, _, _ = self._buffers(x.shape)
        conv_forward(self._g, x, self._w, self._b, IDENTITY, cols, z, y)
        self._last = x.shape
        return y

    def backward(self, dy) -> np.ndarray:
        """dx (B, in_channels, H, W) from dy = dL/dy of the last forward; sets grad_weight/grad_bias."""
        if self._last is None:
            raise ValueError("dy: call forward(x) before backward(dy)")
        _, cols, z, y, dcols, dx, parts = self._bufs
        dy = _f32("dy", dy, 4)
        if dy.shape != y.shape:
            raise ValueError(f"dy: expected shape {y.shape} (the last output), got {dy.shape}")
        conv_backward(self._g, dy, y, IDENTITY, cols, self._w, z, parts, self._gw, self.grad_bias, dcols, dx)
        return dx

    def __repr__(self) -> str:
        return (f"Conv2d({self.in_channels}, {self.out_channels}, kernel_size={self.kernel_size}, "
                f"stride={self.stride}, padding={self.padding})")


class MaxPool2d:
    """Max pooling over kh x kw windows (stride defaults to the window), no padding, floor mode:
    x (B, C, H, W) -> y (B, C, (H - kh) // sh + 1, (W - kw) // sw + 1). The backward sends each
    output's gradient to the (first) maximum of its window."""

    def __init__(self, kernel_size, stride=None):
        self.kernel_size = pair("kernel_size", kernel_size, 1)
        self.stride = self.kernel_size if stride is None else pair("stride", stride, 1)
        self._bufs = None
        self._last = None

    def forward(self, x) -> np.ndarray:
        x = _f32("x", x, 4)
        B, C, H, W = x.shape
        (kh, kw), (sh, sw) = self.kernel_size, self.stride
        if kh > H or kw > W:
            raise ValueError(f"kernel_size: a {kh}x{kw} window does not fit a {H}x{W} input")
        if self._bufs is None or self._bufs[0] != x.shape:
            shape = (B, C, pool_size(H, kh, sh), pool_size(W, kw, sw))
            self._bufs = (x.shape, np.empty(shape, np.float32), np.empty(shape, np.int32),
                          np.empty(x.shape, np.float32))
        _, y, idx, _ = self._bufs
        maxpool_forward(x, kh, kw, sh, sw, y, idx)
        self._last = x.shape
        return y

    def backward(self, dy) -> np.ndarray:
        if self._last is None:
            raise ValueError("dy: call forward(x) before backward(dy)")
        _, y, idx, dx = self._bufs
        dy = _f32("dy", dy, 4)
        if dy.shape != y.shape:
            raise ValueError(f"dy: expected shape {y.shape} (the last output), got {dy.shape}")
        maxpool_backward(dy, idx, dx)
        return dx

    def __repr__(self) -> str:
        return f"MaxPool2d(kernel_size={self.kernel_size}, stride={self.stride})"


class Flatten:
    """(B, ...) -> (B, prod(...)) (a view); the backward reshapes dy back to the last input's shape."""

    def __init__(self):
        self._last = None

    def forward(self, x) -> np.ndarray:
        x = np.asarray(x)
        if x.ndim < 1:
            raise ValueError(f"x: expected an array with a batch axis, got shape {x.shape}")
        self._last = x.shape
        return x.reshape(x.shape[0], -1)

    def backward(self, dy) -> np.ndarray:
        if self._last is None:
            raise ValueError("dy: call forward(x) before backward(dy)")
        dy = np.asarray(dy)
        if dy.size != math.prod(self._last) or dy.shape[:1] != self._last[:1]:
            raise ValueError(f"dy: expected {self._last[0]} rows of {math.prod(self._last[1:])} values, got {dy.shape}")
        return dy.reshape(self._last)

    def __repr__(self) -> str:
        return "Flatten()"


class Linear:
    """Dense layer ``y = x @ weight.T + bias``: x (B, in_features) -> y (B, out_features)."""

    def __init__(self, in_features, out_features, seed=0):
        self.in_features = _int("in_features", in_features, 1)
        self.out_features = _int("out_features", out_features, 1)
        seed = _int("seed", seed, 0)
        self._w = he_normal(np.random.default_rng(seed), (self.out_features, self.in_features), self.in_features)
        self._b = np.zeros(self.out_features, np.float32)
        self.grad_weight = np.zeros_like(self._w)
        self.grad_bias = np.zeros_like(self._b)
        self._x, self._y, self._dx = None, None, None

    weight = property(lambda self: self._w, lambda self, v: _assign(self._w, v, "weight"))
    bias = property(lambda self: self._b, lambda self, v: _assign(self._b, v, "bias"))

    def forward(self, x) -> np.ndarray:
        x = _f32("x", x, 2)
        if x.shape[1] != self.in_features or x.shape[0] < 1:
            raise ValueError(f"x: expected shape (batch >= 1, {self.in_features}), got {x.shape}")
        if self._y is None or self._y.shape[0] != x.shape[0]:
            self._y = np.empty((x.shape[0], self.out_features), np.float32)
            self._dx = np.empty(x.shape, np.float32)
        gemm(x, self._w.T, self._y)
        self._y += self._b
        self._x = x
        return self._y

    def backward(self, dy) -> np.ndarray:
        if self._x is None:
            raise ValueError("dy: call forward(x) before backward(dy)")
        dy = _f32("dy", dy, 2)
        if dy.shape != self._y.shape:
            raise ValueError(f"dy: expected shape {self._y.shape} (the last output), got {dy.shape}")
        gemm(dy.T, self._x, self.grad_weight)
        bias_grad(dy, self.grad_bias)
        return gemm(dy, self._w, self._dx)

    def __repr__(self) -> str:
        return f"Linear({self.in_features}, {self.out_features})"


def _assign(target: np.ndarray, value, name: str) -> None:
    """Copy ``value`` into ``target`` (same shape, finite numbers): weights stay views of one buffer."""
    v = np.asarray(value)
    if v.dtype.kind not in "biuf":
        raise TypeError(f"{name}: expected a numeric array, got dtype {v.dtype}")
    if v.shape != target.shape:
        raise ValueError(f"{name}: expected shape {target.shape}, got {v.shape}")
    if not np.all(np.isfinite(v)):
        raise ValueError(f"{name}: must hold finite numbers (no NaN or inf)")
    target[...] = v
