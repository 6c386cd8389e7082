"""Build the model (Mlp or Cnn, by ``ModelConfig.architecture``) and its quantizers from an ExperimentConfig.

Weight quantizers (``QuantConfig.weights``):

* ``float``: none.
* ``fake``: ``FakeQuantize(weight_bits, symmetric)``, per-tensor or per output row
  (``per_channel``; a conv layer's rows are its output channels: its (Cout, C*kh*kw) view). ``scale_mode="observer"`` re-reads the min/max of the latent
  weights every step (``MovingAverageMinMaxObserver(1.0)``: the current range);
  ``scale_mode="lsq"`` learns the scale (LSQ), initialised to ``2 mean|W| / sqrt(qmax - zp)``
  with zero point ``zp`` 0 (symmetric) or ``2^(b-1)`` (affine: the grid is centred on 0).
* ``ternary``: ``TernaryQuantizer`` (absmean).

Activation quantizers (``activations="fake"``): an affine ``FakeQuantize`` per hidden
layer (conv layers: after the activation, before the pool) with a ``MovingAverageMinMaxObserver(0.01)``, observing during training only.
"""
from __future__ import annotations

import math

import numpy as np

from ..config import ExperimentConfig
from ..nn import Cnn, Mlp, conv_plan
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


def build_model(cfg: ExperimentConfig, n_inputs: int, n_outputs: int, image_shape=None) -> Mlp | Cnn:
    """The model of ``cfg.model.architecture``, seeded by ``optim.seed``, with its quantizers: an Mlp
    ``[n_inputs, *hidden, n_outputs]``, or a Cnn over images ``image_shape`` (C, H, W) with
    C*H*W == n_inputs (see :func:`check_cnn`)."""
    m = cfg.model
    if m.architecture == "cnn":
        check_cnn(cfg, n_inputs, image_shape)
        model = Cnn(image_shape, m.conv_channels, n_outputs, hidden=m.hidden, kernel_size=m.kernel_size,
                    pool=m.pool, activation=m.activation, seed=cfg.optim.seed)
    else:
        model = Mlp([n_inputs, *m.hidden, n_outputs], activation=m.activation, seed=cfg.optim.seed)
    wq = [weight_quantizer(cfg, model.weights(i)) for i in range(model.num_layers)]
    aq = [activation_quantizer(cfg) for _ in range(model.num_layers - 1)]
    model.set_quantizers(wq, aq)
    return model


def check_cnn(cfg: ExperimentConfig, n_inputs: int, image_shape) -> None:
    """ValueError naming the field when a cnn cannot be built on this data: no image shape (flat
    features), or a kernel or pool window larger than a feature map. Allocates nothing."""
    if image_shape is None:
        raise ValueError(f"ModelConfig.architecture: 'cnn' needs a dataset of images or 1-d signals "
                         f"(digits, mnist, fashion_mnist, mnist1d, or an image file); dataset "
                         f"{cfg.data.dataset!r} gives flat features -- use architecture='mlp'")
    if math.prod(image_shape) != n_inputs:
        raise ValueError(f"image_shape: {tuple(image_shape)} does not hold the {n_inputs} input features")
    try:
        conv_plan(image_shape, cfg.model.conv_channels, cfg.model.kernel_size, cfg.model.pool)
    except ValueError as e:
        raise ValueError(f"ModelConfig.{e}") from None


def set_observing(mlp: Mlp, on: bool) -> None:
    """Switch the activation quantizers' observers (off for evaluation, on for training)."""
    for q in mlp.activation_quantizers:
        if q is not None:
            q.observer_enabled = on
