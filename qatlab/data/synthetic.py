"""Seeded synthetic tasks: Gaussian-cluster classification and a ternary-teacher regression."""
from __future__ import annotations

import math
import numbers
from typing import Any

import numpy as np

from .dataset import TASKS, Dataset, check_int, check_test_fraction, split_indices

_DEFAULT_NOISE = {"classification": 1.5, "regression": 0.0}


def make_synthetic(kind: str = "classification", n_samples: int = 2000, n_features: int = 64,
                   n_classes: int = 10, test_fraction: float = 0.2, seed: int = 0,
                   noise: float | None = None, n_outputs: int = 8, hidden: int = 64) -> Dataset:
    """A seeded synthetic task, split like the other loaders.

    ``kind="classification"`` (Gaussian clusters): class centres ``c_j`` are drawn
    uniformly from ``[-1, 1]^n_features``; labels are balanced
    (``arange(n_samples) % n_classes``, shuffled) and ``x = c_y + noise * N(0, I)``.
    The default ``noise=1.5`` gives a task a linear model does not solve
    perfectly at 64 features (about 90% Bayes accuracy for 10 classes); fewer
    features make it harder, more make it easier. Uses ``n_classes``.

    ``kind="regression"`` (ternary teacher, the reference trainer's
    ``32-64-8``-style task): ``x`` uniform in ``[-1, 1]^n_features`` and
    ``t = W2 @ sign(W1 @ x) / sqrt(hidden) + noise * N(0, I)``, with fixed random
    ternary teacher weights ``W1 (hidden, n_features)`` and
    ``W2 (n_outputs, hidden)``, entries uniform over {-1, 0, +1} (rows of ``W1``
    that came out all zero get one random +-1, so every hidden unit is live).
    With the default ``noise=0`` the targets are exactly realizable by a
    2-layer ternary network with a ``sign`` hidden layer and output scale
    ``1/sqrt(hidden)``. The teacher is returned in ``meta["teacher_w1"]``,
    ``meta["teacher_w2"]`` (int8) and ``meta["teacher_scale"]``. Uses
    ``n_outputs`` and ``hidden``; ``n_classes`` is ignored.

    Args:
        kind: ``"classification"`` or ``"regression"``.
        n_samples: total samples (train + test), integer >= 2.
        n_features: input features ``d``, integer >= 1.
        n_classes: classes (classification), integer >= 2.
        test_fraction: share held out, in (0, 1) exclusive.
        seed: integer >= 0; seeds both the data and the split.
        noise: float >= 0, the cluster standard deviation (classification) or
            the target noise standard deviation (regression); ``None`` picks
            1.5 (classification) or 0.0 (regression).
        n_outputs: regression targets ``k``, integer >= 1.
        hidden: hidden units of the regression teacher, integer >= 1.

    Returns:
        ``Dataset`` with ``X (n, n_features) float32``; classification
        ``y (n,) int64``, ``n_classes=n_classes``; regression
        ``y (n, n_outputs) float32``, ``n_classes=0``.
    """
    if kind not in TASKS:
        raise ValueError(f"kind: must be one of {TASKS}, got {kind!r}")
    n_samples = check_int("n_samples", n_samples, 2)
    n_features = check_int("n_features", n_features, 1)
    test_fraction = check_test_fraction(test_fraction)
    seed = check_int("seed", seed, 0)
    if noise is None:
        noise = _DEFAULT_NOISE[kind]
    if (isinstance(noise, bool) or not isinstance(noise, numbers.Real)
            or not math.isfinite(noise) or noise < 0):
        raise ValueError(f"noise: must be a finite number >= 0, got {noise!r}")
    noise = float(noise)
    if kind == "classification":
        n_classes = check_int("n_classes", n_classes, 2)
    else:
        n_outputs = check_int("n_outputs", n_outputs, 1)
        hidden = check_int("hidden", hidden, 1)
    train, test = split_indices(n_samples, test_fraction, seed)  # checks the split first

    # A stream independent of the split's default_rng(seed).
    rng = np.random.default_rng([seed, 0x5D47A])
    meta: dict[str, Any] = {}
    if kind == "classification":
        centres = rng.uniform(-1.0, 1.0, size=(n_classes, n_features))
        y = rng.permutation(np.arange(n_samples) % n_classes).astype(np.int64)
        X = (centres[y] + noise * rng.standard_normal((n_samples, n_features))).astype(np.float32)
        name = "synthetic-classification"
        meta["centres"] = centres.astype(np.float32)
    else:
        w1 = rng.integers(-1, 2, size=(hidden, n_features)).astype(np.int8)
        for r in np.flatnonzero(~w1.any(axis=1)):
            w1[r, rng.integers(n_features)] = rng.choice(np.array([-1, 1], dtype=np.int8))
        w2 = rng.integers(-1, 2, size=(n_outputs, hidden)).astype(np.int8)
        scale = 1.0 / math.sqrt(hidden)
        X = rng.uniform(-1.0, 1.0, size=(n_samples, n_features)).astype(np.float32)
        h = np.sign(X.astype(np.float64) @ w1.T.astype(np.float64))
        t = scale * (h @ w2.T.astype(np.float64))
        if noise > 0:
            t = t + noise * rng.standard_normal(t.shape)
        y = t.astype(np.float32)
        n_classes = 0
        name = "synthetic-regression"
        meta.update(teacher_w1=w1, teacher_w2=w2, teacher_scale=scale)
    return Dataset(X[train], y[train], X[test], y[test], n_classes=n_classes,
                   task=kind, name=name, meta=meta)


