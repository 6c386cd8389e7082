"""LSQ: the scales of FakeQuantize weight quantizers with ``learn_scale``, trained by their own optimizer."""
from __future__ import annotations

import numpy as np

from ..diverged import NonFiniteError
from ..optim import make_optimizer
from ..quant import FLOAT32_EPS, SCALE_MAX, FakeQuantize


def lsq_quantizers(mlp) -> list[FakeQuantize]:
    """The weight quantizers of ``mlp`` whose scale is learned."""
    return [q for q in mlp.weight_quantizers if isinstance(q, FakeQuantize) and q.learn_scale]


class LsqScales:
    """The LSQ scales of every quantizer, learned in log space by their own optimizer.

    The optimizer sees ``log s`` and the gradient ``dL/d(log s) = s dL/ds``, so a step changes a
    scale by a relative amount (~lr) whatever its size; stepping ``s`` itself with Adam moves an
    8-bit scale of ~0.02 by ~lr = 0.01 per step and collapses it.
    """

    def __init__(self, quantizers, cfg, steps_per_epoch, layers=None):
        self.quantizers = quantizers
        self.layers = list(range(len(quantizers))) if layers is None else list(layers)   # for messages
        self.sizes = [np.size(q.scale) for q in quantizers]
        scales = np.concatenate([np.atleast_1d(q.scale).astype(np.float32) for q in quantizers])
        self.log_scales = np.log(scales)
        self.grads = np.zeros_like(self.log_scales)
        self.opt = make_optimizer(cfg.optim, self.log_scales, steps_per_epoch)

    @classmethod
    def of(cls, mlp, cfg, steps_per_epoch) -> "LsqScales | None":
        """The LSQ scales of ``mlp``'s quantizers, or None when no quantizer learns its scale."""
        quantizers = lsq_quantizers(mlp)
        if not quantizers:
            return None
        return cls(quantizers, cfg, steps_per_epoch, [mlp.weight_quantizers.index(q) for q in quantizers])

    def step(self) -> None:
        i = 0
        for q, n in zip(self.quantizers, self.sizes):
            self.grads[i: i + n] = q.scale_grad * np.atleast_1d(q.scale)
            i += n
        self.opt.step(self.grads)
        with np.errstate(over="ignore", invalid="ignore"):
            scales = np.maximum(np.exp(self.log_scales), FLOAT32_EPS)
        if not np.all(scales <= SCALE_MAX):     # NaN or past what float32 holds: the run diverged
            self._blew_up(scales)
        i = 0
        for q, n in zip(self.quantizers, self.sizes):
            s = scales[i: i + n]
            q.update_params(s.copy() if np.ndim(q.scale) else float(s[0]), q.zero_point)
            i += n

    def _blew_up(self, scales: np.ndarray) -> None:
        """Raise NonFiniteError naming the first layer whose scale left float32 (nothing updated)."""
        i = 0
        for layer, n in zip(self.layers, self.sizes):
            bad = scales[i: i + n][~(scales[i: i + n] <= SCALE_MAX)]
            if bad.size:
                value = float(bad[0])
                raise NonFiniteError(f"scale: LSQ scale of layer {layer} became {value}",
                                     f"LSQ scale of layer {layer}", value)
            i += n
