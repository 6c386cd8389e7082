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
* ``F.cross_entropy`` (mean) and ``torch.optim.Adam`` (defaults but ``lr``), ``zero_grad(set_to_none=True)``.
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


class QuantLinear(nn.Linear):
    """``nn.Linear`` whose forward multiplies with ``quantize(weight)`` (identity STE backward).

    quant: ``"float"`` (plain Linear), ``"ternary"`` or ``"fake"`` (``bits``-bit symmetric).
    """

    def __init__(self, n_in: int, n_out: int, quant: str = "float", bits: int = 8):
        super().__init__(n_in, n_out)
        if quant not in ("float", "fake", "ternary"):
            raise ValueError(f"quant: expected float, fake or ternary, got {quant!r}")
        self.quant = quant
        self.qmin, self.qmax = -(2 ** (bits - 1)), 2 ** (bits - 1) - 1

    def quantized_weight(self):
        if self.quant == "ternary":
            return _TernarySte.apply(self.weight)
        if self.quant == "fake":
            return _FakeQuantSte.apply(self.weight, self.qmin, self.qmax)
        return self.weight

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
        opt = torch.optim.Adam(model.parameters(), lr=lr)
        Xtr, ytr = torch.from_numpy(np.ascontiguousarray(ds.X_train)), torch.from_numpy(ds.y_train.astype(np.int64))
        Xte, yte = torch.from_numpy(np.ascontiguousarray(ds.X_test)), torch.from_numpy(ds.y_test.astype(np.int64))
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
