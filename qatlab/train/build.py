"""Build the model and its quantizers from an ExperimentConfig.

Weight quantizers (``QuantConfig.weights``):

* ``float``: none.
* ``fake``: ``FakeQuantize(weight_bits, symmetric)``, per-tensor or per output row
  (``per_channel``). ``scale_mode="observer"`` re-reads the min/max of the latent
  weights every step (``MovingAverageMinMaxObserver(1.0)``: the current range);
  ``scale_mode="lsq"`` learns the scale (LSQ), initialised to ``2 mean|W| / sqrt(qmax - zp)``
  with zero point ``zp`` 0 (symmetric) or ``2^(b-1)`` (affine: the grid is centred on 0).
* ``ternary``: ``TernaryQuantizer`` (absmean).

Activation quantizers (``activations="fake"``): an affine ``FakeQuantize`` per hidden
layer with a ``MovingAverageMinMaxObserver(0.01)``, observing during training only.
"""
from __future__ import annotations

import math

import numpy as np

from ..config import ExperimentConfig
from ..nn import Mlp
from ..quant import FakeQuantize, MovingAverageMinMaxObserver, TernaryQuantizer


def weight_quantizer(cfg: ExperimentConfig, w: np.ndarray):
    """The weight quantizer of one layer with latent weights ``w`` (out, in), or None."""
    q = cfg.quant
    if q.weights == "float":
        return None
    if q.weights == "ternary":
        return TernaryQuantizer(ste=q.ste)
    axis = 0 if q.per_channel else None
    fq = FakeQuantize(bits=q.weight_bits, symmetric=q.symmetric, ste=q.ste, axis=axis,
                      observer=MovingAverageMinMaxObserver(1.0, axis=axis))
    if q.scale_mode == "observer":
        fq.observer_enabled = True
        return fq
    qmin, qmax = fq.quant_range()
    # Affine: centre the integer grid on 0 (zero point 2^(b-1)), else every negative latent would
    # quantize to 0 (the affine range is [0, 2^b - 1]). Symmetric: zero point 0.
    zp = 0 if q.symmetric else (qmin + qmax + 1) // 2
    absmean = np.abs(w).mean(axis=1) if axis == 0 else np.abs(w).mean()
    scale = np.maximum(2.0 * absmean / math.sqrt(max(qmax - zp, 1)), 1e-6).astype(np.float32)
    fq.update_params(scale if axis == 0 else float(scale), np.full(len(w), zp, np.int64) if axis == 0 else zp)
    fq.learn_scale = True
    return fq


def activation_quantizer(cfg: ExperimentConfig):
    """Hidden-activation quantizer (affine, observing), or None when activations are off."""
    q = cfg.quant
    if q.activations == "off":
        return None
    return FakeQuantize(bits=q.activation_bits, symmetric=False, ste=q.activation_ste,
                        observer=MovingAverageMinMaxObserver(0.01), observer_enabled=True)


def build_model(cfg: ExperimentConfig, n_inputs: int, n_outputs: int) -> Mlp:
    """Mlp ``[n_inputs, *hidden, n_outputs]`` seeded by ``optim.seed``, with its quantizers."""
    sizes = [n_inputs, *cfg.model.hidden, n_outputs]
    mlp = Mlp(sizes, activation=cfg.model.activation, seed=cfg.optim.seed)
    wq = [weight_quantizer(cfg, mlp.weights(i)) for i in range(mlp.num_layers)]
    aq = [activation_quantizer(cfg) for _ in range(mlp.num_layers - 1)]
    mlp.set_quantizers(wq, aq)
    return mlp


def set_observing(mlp: Mlp, on: bool) -> None:
    """Switch the activation quantizers' observers (off for evaluation, on for training)."""
    for q in mlp.activation_quantizers:
        if q is not None:
            q.observer_enabled = on
