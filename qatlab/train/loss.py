"""The training loss of a config (cross-entropy or MSE, with one-hot targets made in place) and evaluation."""
from __future__ import annotations

import math

import numpy as np

from ..data import Dataset
from ..kernels.dense import count_correct
from ..nn import Mlp, cross_entropy_loss, mse_loss
from ..resources import EVAL_CHUNK   # test rows evaluated at once (the memory estimate counts them)
from .build import set_observing


class BatchLoss:
    """Loss of the configured kind with preallocated targets; ``__call__(y, rows, d_out) -> float``."""

    def __init__(self, kind: str, data: Dataset, batch_size: int):
        self.classify = data.task == "classification"
        self.kind = kind if self.classify else "mse"
        self.onehot = np.zeros((max(batch_size, EVAL_CHUNK), data.n_outputs), np.float32)

    def __call__(self, y, targets, d_out=None) -> float:
        if self.kind == "cross_entropy":
            return cross_entropy_loss(y, targets, d_out)
        return mse_loss(y, self._mse_targets(targets), d_out)

    def _mse_targets(self, targets):
        if not self.classify:
            return targets
        t = self.onehot[: len(targets)]
        t.fill(0.0)
        t[np.arange(len(targets)), targets] = 1.0
        return t

    def fused_block(self, y_train) -> dict:
        """The keyword arguments of :meth:`~qatlab.train.fused_step.FusedStep.steps` on the training split."""
        if not self.classify:
            return {"targets": np.ascontiguousarray(y_train, dtype=np.float32)}
        return {"labels": y_train, "onehot": self.kind != "cross_entropy"}

    def fused(self, targets) -> dict:
        """The keyword arguments of a :class:`~qatlab.train.fused_step.FusedStep` call for this batch's targets."""
        if self.kind == "cross_entropy":
            return {"labels": targets}
        return {"targets": self._mse_targets(targets)}


def evaluate(mlp: Mlp, X: np.ndarray, y: np.ndarray, loss: BatchLoss, scratch=None) -> tuple[float, float]:
    """(mean loss, accuracy) of ``mlp`` on X (n, in) / y (n,) or (n, k); accuracy nan for regression."""
    scratch = scratch or mlp.scratch(min(EVAL_CHUNK, len(X)))
    total, correct = 0.0, 0.0
    set_observing(mlp, False)
    try:
        for start in range(0, len(X), scratch.batch_size):
            xb, yb = X[start: start + scratch.batch_size], y[start: start + scratch.batch_size]
            out = mlp.forward(xb, scratch)
            total += loss(out, yb) * len(xb)
            if loss.classify:
                correct += count_correct(out, yb)
    finally:
        set_observing(mlp, True)
    return total / len(X), (correct / len(X) if loss.classify else math.nan)
