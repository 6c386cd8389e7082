"""PyTorch eager reference implementations for the ``train`` and ``quality`` benchmark suites.

Imported only when ``torch`` is importable (the suites check first); nothing else in qatlab
imports this module. Everything here is plain eager PyTorch, written the way a PyTorch user
would write QAT for this recipe:

* ``nn.Linear`` layers; the weight each layer multiplies with is ``quantize(W)`` computed by an
  ``autograd.Function`` whose backward is the identity straight-through estimator (qatlab's
  default ``ste="identity"``);
* ternary (BitNet b1.58 absmean): ``alpha = mean|W|``, ``Wq = alpha * clamp(rint(W / alpha), -1, 1)``,
  computed with ``torch.fake_quantize_per_tensor_affine(W, alpha, 0, -1, 1)``;
* k-bit fake quantization: symmetric per-tensor, scale from the current min/max of ``W``
  (``max(-min, max) / ((qmax - qmin) / 2)``, as qatlab's observer with averaging constant 1),
  ``torch.fake_quantize_per_tensor_affine(W, scale, 0, -2^(k-1), 2^(k-1) - 1)``;
* k-bit per output channel (the ``conv`` and mnist ``quality`` recipes): the same min/max scale per
  row/filter, ``torch.fake_quantize_per_channel_affine(W, scales, 0, axis 0, ...)``;
* ``F.cross_entropy`` (mean) and ``torch.optim.Adam`` (defaults but ``lr``), ``zero_grad(set_to_none=True)``.

:class:`TorchCnn` is the LeNet-style twin of qatlab's Cnn: ``conv -> ReLU -> max-pool`` per
convolution (``QuantConv2d``), flatten, then ``QuantLinear`` layers (ReLU between them).
"""
from __future__ import annotations

import contextlib
import math
import time

import numpy as np
import torch
import torch.nn.functional as F
from torch import nn

FLOAT32_EPS = float(np.finfo(np.float32).eps)


@contextlib.contextmanager
def num_threads(n: int | None):
    """Run the block with ``torch.set_num_threads(n)`` (None: leave as is), then restore."""
    old = torch.get_num_threads()
    if n is not None:
        torch.set_num_threads(int(n))
    try:
        yield
    finally:
        torch.set_num_threads(old)


class _TernarySte(torch.autograd.Function):
    """Forward: absmean ternary fake quantization of W; backward: identity STE."""

    @staticmethod
    def forward(ctx, w):
        alpha = max(float(w.detach().abs().mean()), FLOAT32_EPS)
        return torch.fake_quantize_per_tensor_affine(w.detach(), alpha, 0, -1, 1)

    @staticmethod
    def backward(ctx, grad):
        return grad


class _FakeQuantSte(torch.autograd.Function):
    """Forward: symmetric per-tensor k-bit fake quantization with a min/max scale; backward: identity."""

    @staticmethod
    def forward(ctx, w, qmin, qmax):
        wd = w.detach()
        lo, hi = min(float(wd.min()), 0.0), max(float(wd.max()), 0.0)
        scale = max(np.float32(max(-lo, hi)) / np.float32((qmax - qmin) / 2), FLOAT32_EPS)
        return torch.fake_quantize_per_tensor_affine(wd, float(scale), 0, qmin, qmax)

    @staticmethod
    def backward(ctx, grad):
        return grad, None, None


class _FakeQuantPcSte(torch.autograd.Function):
    """Forward: symmetric k-bit fake quantization per output channel (axis 0), min/max scale per
    channel; backward: identity."""

    @staticmethod
    def forward(ctx, w, qmin, qmax):
        wd = w.detach()
        flat = wd.reshape(wd.shape[0], -1)
        lo = torch.clamp(flat.min(dim=1).values, max=0.0)
        hi = torch.clamp(flat.max(dim=1).values, min=0.0)
        scale = torch.clamp(torch.maximum(-lo, hi) / np.float32((qmax - qmin) / 2), min=FLOAT32_EPS)
        zp = torch.zeros(wd.shape[0], dtype=torch.int32)
        return torch.fake_quantize_per_channel_affine(wd, scale, zp, 0, qmin, qmax)

    @staticmethod
    def backward(ctx, grad):
        return grad, None, None


def quantize_weight(w, quant: str, qmin: int, qmax: int, per_channel: bool = False):
    """The weight a layer multiplies with: ``w`` (float), ternary or k-bit fake (identity STE)."""
    if quant == "ternary":
        return _TernarySte.apply(w)
    if quant == "fake":
        return (_FakeQuantPcSte if per_channel else _FakeQuantSte).apply(w, qmin, qmax)
    return w


def _check_quant(quant: str) -> str:
    if quant not in ("float", "fake", "ternary"):
        raise ValueError(f"quant: expected float, fake or ternary, got {quant!r}")
    return quant


class QuantConv2d(nn.Conv2d):
    """``nn.Conv2d`` (no padding, stride 1) whose forward convolves with ``quantize(weight)``."""

    def __init__(self, c_in: int, c_out: int, k: int, quant: str = "float", bits: int = 8, per_channel=False):
        super().__init__(c_in, c_out, k)
        self.quant = _check_quant(quant)
        self.per_channel = bool(per_channel)
        self.qmin, self.qmax = -(2 ** (bits - 1)), 2 ** (bits - 1) - 1

    def forward(self, x):
        return F.conv2d(x, quantize_weight(self.weight, self.quant, self.qmin, self.qmax, self.per_channel),
                        self.bias)


class TorchCnn(nn.Module):
    """conv(k x k) -> ReLU -> max-pool(pool) per entry of ``channels``, flatten, dense ``hidden``
    layers (ReLU), then ``n_classes`` logits; ``in_shape`` (C, H, W). ``params``: optional list of
    (weight, bias) numpy pairs, one per layer in order, copied in."""

    def __init__(self, in_shape, channels, kernel: int, pool: int, hidden, n_classes: int,
                 quant: str = "float", bits: int = 8, per_channel: bool = False, params=None):
        super().__init__()
        c, h, w = in_shape
        convs = []
        for c_out in channels:
            convs.append(QuantConv2d(c, c_out, kernel, quant, bits, per_channel))
            c, h, w = c_out, (h - kernel + 1) // pool, (w - kernel + 1) // pool
        self.convs = nn.ModuleList(convs)
        self.pool = pool
        sizes = [c * h * w, *hidden, n_classes]
        self.dense = nn.ModuleList(QuantLinear(a, b, quant, bits, per_channel) for a, b in zip(sizes[:-1], sizes[1:]))
        if params is not None:
            layers = [*self.convs, *self.dense]
            if len(params) != len(layers):
                raise ValueError(f"params: expected {len(layers)} (weight, bias) pairs, got {len(params)}")
            with torch.no_grad():
                for layer, (wt, b) in zip(layers, params):
                    layer.weight.copy_(torch.from_numpy(np.asarray(wt, np.float32).reshape(layer.weight.shape)))
                    layer.bias.copy_(torch.from_numpy(np.asarray(b, np.float32)))

    def forward(self, x):
        for conv in self.convs:
            x = F.relu(conv(x))
            if self.pool > 1:
                x = F.max_pool2d(x, self.pool)
        x = x.flatten(1)
        last = len(self.dense) - 1
        for i, layer in enumerate(self.dense):
            x = layer(x)
            if i < last:
                x = F.relu(x)
        return x


class QuantLinear(nn.Linear):
    """``nn.Linear`` whose forward multiplies with ``quantize(weight)`` (identity STE backward).

    quant: ``"float"`` (plain Linear), ``"ternary"`` or ``"fake"`` (``bits``-bit symmetric).
    """

    def __init__(self, n_in: int, n_out: int, quant: str = "float", bits: int = 8, per_channel: bool = False):
        super().__init__(n_in, n_out)
        self.quant = _check_quant(quant)
        self.per_channel = bool(per_channel)
        self.qmin, self.qmax = -(2 ** (bits - 1)), 2 ** (bits - 1) - 1

    def quantized_weight(self):
        return quantize_weight(self.weight, self.quant, self.qmin, self.qmax, self.per_channel)

    def forward(self, x):
        return F.linear(x, self.quantized_weight(), self.bias)


class TorchMlp(nn.Module):
    """ReLU MLP ``sizes[0] -> ... -> sizes[-1]`` of :class:`QuantLinear` layers (no activation on the last).

    weights/biases: optional lists of numpy arrays, ``(out, in)`` and ``(out,)``, copied in (so
    both implementations can start from the same initial point); otherwise torch's default init.
    """

    def __init__(self, sizes, quant: str = "float", bits: int = 8, weights=None, biases=None):
        super().__init__()
        self.layers = nn.ModuleList(QuantLinear(a, b, quant, bits) for a, b in zip(sizes[:-1], sizes[1:]))
        with torch.no_grad():
            for i, layer in enumerate(self.layers):
                if weights is not None:
                    layer.weight.copy_(torch.from_numpy(np.asarray(weights[i], np.float32)))
                if biases is not None:
                    layer.bias.copy_(torch.from_numpy(np.asarray(biases[i], np.float32)))

    def forward(self, x):
        last = len(self.layers) - 1
        for i, layer in enumerate(self.layers):
            x = layer(x)
            if i < last:
                x = F.relu(x)
        return x


def make_train_step(model: TorchMlp, x: np.ndarray, labels: np.ndarray, lr: float = 1e-2):
    """A zero-argument callable doing one eager training step on fixed data; returns (step, optimizer).

    step(): ``zero_grad(set_to_none=True)``; ``loss = cross_entropy(model(x), labels)``;
    ``loss.backward()``; ``opt.step()``; returns the loss tensor.
    """
    xt = torch.from_numpy(np.ascontiguousarray(x, np.float32))
    yt = torch.from_numpy(np.asarray(labels, np.int64))
    opt = torch.optim.Adam(model.parameters(), lr=lr)

    def step():
        opt.zero_grad(set_to_none=True)
        loss = F.cross_entropy(model(xt), yt)
        loss.backward()
        opt.step()
        return loss

    return step, opt


def _evaluate(model: TorchMlp, X: torch.Tensor, y: torch.Tensor) -> tuple[float, float]:
    with torch.no_grad():
        out = model(X)
        return float(F.cross_entropy(out, y)), float((out.argmax(dim=1) == y).double().mean())


def train(ds, sizes, quant: str = "float", bits: int = 8, *, epochs: int = 40, batch_size: int = 64,
          lr: float = 1e-2, seed: int = 0, weights=None, biases=None, threads: int | None = 1) -> dict:
    """Train :class:`TorchMlp` on ``ds`` (a qatlab Dataset) with the qatlab recipe; returns final metrics.

    Batches follow qatlab's order exactly (``np.random.default_rng(seed).permutation`` per epoch).
    Like qatlab's loop, the test split is evaluated after every epoch and the train loss/accuracy
    are the epoch's batches' (from their forward passes, before each update). Returns
    ``{test_accuracy, test_loss, train_loss, train_accuracy, seconds, steps, steps_per_second, status}``.
    """
    with num_threads(threads):
        torch.manual_seed(seed)
        model = TorchMlp(sizes, quant, bits, weights, biases)
    return train_model(ds, model, epochs=epochs, batch_size=batch_size, lr=lr, seed=seed, threads=threads)


def train_cnn(ds, in_shape, channels, kernel: int, pool: int, hidden, quant: str = "float", bits: int = 8,
              per_channel: bool = False, *, params=None, epochs: int = 20, batch_size: int = 64,
              lr: float = 1e-3, seed: int = 0, threads: int | None = 1) -> dict:
    """Train :class:`TorchCnn` on ``ds`` (rows reshaped to ``in_shape``) like :func:`train`."""
    with num_threads(threads):
        torch.manual_seed(seed)
        model = TorchCnn(in_shape, channels, kernel, pool, hidden, ds.n_outputs, quant, bits, per_channel, params)
    return train_model(ds, model, epochs=epochs, batch_size=batch_size, lr=lr, seed=seed, threads=threads,
                       in_shape=in_shape)


def train_model(ds, model: nn.Module, *, epochs: int, batch_size: int, lr: float, seed: int,
                threads: int | None = 1, in_shape=None) -> dict:
    """The training loop of :func:`train` for any model (inputs reshaped to ``(-1, *in_shape)`` if given)."""
    def tensor(X):
        X = np.ascontiguousarray(X, np.float32)
        return torch.from_numpy(X if in_shape is None else X.reshape(len(X), *in_shape))

    with num_threads(threads):
        opt = torch.optim.Adam(model.parameters(), lr=lr)
        Xtr, Xte = tensor(ds.X_train), tensor(ds.X_test)
        ytr, yte = torch.from_numpy(ds.y_train.astype(np.int64)), torch.from_numpy(ds.y_test.astype(np.int64))
        rng = np.random.default_rng(seed)
        n = len(Xtr)
        bs = min(batch_size, n)
        step, status = 0, "finished"
        test_loss = test_acc = train_loss = train_acc = math.nan
        t0 = time.perf_counter()
        for _ in range(epochs):
            order = torch.from_numpy(rng.permutation(n))
            epoch_loss, epoch_correct = 0.0, 0
            for start in range(0, n, bs):
                idx = order[start: start + bs]
                opt.zero_grad(set_to_none=True)
                out = model(Xtr[idx])
                loss = F.cross_entropy(out, ytr[idx])
                loss.backward()
                opt.step()
                step += 1
                lv = loss.detach().item()
                if not math.isfinite(lv):
                    status = "diverged"
                    break
                epoch_loss += lv * len(idx)
                epoch_correct += int((out.detach().argmax(dim=1) == ytr[idx]).sum())
            if status != "finished":
                break
            train_loss = epoch_loss / n
            test_loss, test_acc = _evaluate(model, Xte, yte)
            train_acc = epoch_correct / n
        seconds = time.perf_counter() - t0
    return {"test_accuracy": test_acc, "test_loss": test_loss, "train_loss": train_loss,
            "train_accuracy": train_acc, "seconds": seconds, "steps": step,
            "steps_per_second": step / seconds if seconds > 0 else math.nan, "status": status}
