"""How predictable are a run's real gradients? The phase bench's diagnostic of its predictions.

Phase training predicts the gradient of the next steps from the real gradients already seen. That
can only work as far as the real gradients themselves carry over from step to step. This module
trains a config with full backprop (per-call Python path: forward, loss, backward, optimizer; the
batch order of :func:`qatlab.train.trainer.train_experiment`), keeps the last real minibatch
gradients and measures, over the whole run:

* ``lag_<k>``: mean cosine(g_t, g_(t+k)) -- what "predict g_(t+k) as the last real gradient" gets;
* ``momentum``: mean cosine(g_t + m (g_t - g_(t-1)), g_(t+1)) -- the ``momentum`` predictor's
  formula from the last two real gradients, one step ahead (m = ``phase.prediction.momentum``).

Measured on digits (the ExperimentConfig defaults, seed 0, 920 steps): +0.24 at lag 1, +0.12 at
lag 2, +0.03 at lag 3, -0.14 and -0.11 at lags 5 and 9; momentum +0.16 (below plain reuse at
lag 1). The gradient keeps some of its direction for a step or two, then points back (Adam's
steps along it overshoot), so a prediction 2-9 steps past the last real gradient, as a predict
block of 10 needs, has nothing left to extrapolate.
"""
from __future__ import annotations

import math
from collections.abc import Iterator, Sequence

import numpy as np

from .. import config as C
from ..data import load_dataset
from ..nn import cross_entropy_loss
from ..optim import make_optimizer
from ..train.build import build_model

LAGS = (1, 2, 3, 5, 9)


def lag_cosines(grads: np.ndarray, lags: Sequence[int] = LAGS) -> dict[int, float]:
    """Mean over t of cosine(g_t, g_(t+k)) for each lag k; grads (T, n), one gradient per row.

    NaN for a lag >= T. Rows of norm 0 count as cosine 0.
    """
    g = np.asarray(grads, dtype=np.float64)
    norms = np.linalg.norm(g, axis=1)
    unit = np.divide(g, norms[:, None], out=np.zeros_like(g), where=norms[:, None] > 0)
    return {k: float(np.mean(np.sum(unit[:-k] * unit[k:], axis=1))) if k < len(g) else math.nan for k in lags}


def real_gradients(cfg: C.ExperimentConfig) -> Iterator[np.ndarray]:
    """Train ``cfg`` with full backprop (cross-entropy, every batch of every epoch, the batch order of
    the training loop) and yield each step's real gradient, float32 (n,): the model's live flat
    gradient buffer, valid until the generator resumes (then the optimizer steps with it)."""
    if cfg.optim.loss != "cross_entropy":
        raise ValueError(f"cfg.optim.loss: expected 'cross_entropy', got {cfg.optim.loss!r}")
    data = load_dataset(cfg.data)
    mlp = build_model(cfg, data.n_features, data.n_outputs)
    bs = min(cfg.optim.batch_size, data.n_train)
    opt = make_optimizer(cfg.optim, mlp.flat_params(), math.ceil(data.n_train / bs))
    scratch, grads = mlp.scratch(bs), mlp.gradients(bs)
    rng = np.random.default_rng(cfg.optim.seed)
    for _ in range(cfg.optim.epochs):
        order = rng.permutation(data.n_train)
        for pos in range(0, data.n_train, bs):
            idx = order[pos: pos + bs]
            xb = np.ascontiguousarray(data.X_train[idx])
            cross_entropy_loss(mlp.forward(xb, scratch), data.y_train[idx], grads.d_output_mut())
            mlp.backward(xb, scratch, grads, need_input_grad=False)
            yield grads.flat()
            opt.step(grads.flat())


def gradient_predictability(cfg: C.ExperimentConfig, lags: Sequence[int] = LAGS) -> dict[str, float]:
    """``{"lag_<k>": mean cosine(g_t, g_(t+k)), "momentum": ..., "steps": T}`` over the real
    gradients of :func:`real_gradients` (module doc), keeping only the last ``max(lags) + 1``."""
    m = float(cfg.phase.prediction.momentum)
    depth = max(lags) + 1
    ring: np.ndarray | None = None
    sums = {k: 0.0 for k in lags}
    counts = {k: 0 for k in lags}
    mom_sum, mom_count, t = 0.0, 0, 0
    for g in real_gradients(cfg):
        if ring is None:
            ring = np.zeros((depth, len(g)), np.float32)
        ring[t % depth] = g
        for k in lags:
            if t >= k:
                sums[k] += _cos(ring[(t - k) % depth], g)
                counts[k] += 1
        if t >= 2:
            g1, g2 = ring[(t - 1) % depth].astype(np.float64), ring[(t - 2) % depth]
            mom_sum += _cos(g1 + m * (g1 - g2), g)
            mom_count += 1
        t += 1
    out = {f"lag_{k}": sums[k] / counts[k] if counts[k] else math.nan for k in lags}
    out["momentum"] = mom_sum / mom_count if mom_count else math.nan
    out["steps"] = t
    return out


def _cos(a: np.ndarray, b: np.ndarray) -> float:
    a, b = a.astype(np.float64, copy=False), b.astype(np.float64, copy=False)
    den = math.sqrt(float(a @ a) * float(b @ b))
    return float(a @ b) / den if den > 0 else 0.0
