"""The Dataset container, argument checks and the seeded train/test split."""
from __future__ import annotations

import math
import numbers
from dataclasses import dataclass, field
from typing import Any

import numpy as np

TASKS = ("classification", "regression")


@dataclass(repr=False)
class Dataset:
    """A train/test split ready for training.

    Fields (``n_train``/``n_test`` samples, ``d`` features, ``k`` outputs):

    - ``X_train``: ``(n_train, d) float32``; ``X_test``: ``(n_test, d) float32``.
    - ``y_train``/``y_test``: classification ``(n,) int64`` labels in
      ``0 .. n_classes - 1``; regression ``(n, k) float32`` targets.
    - ``n_classes``: number of classes (classification), 0 for regression.
    - ``task``: ``"classification"`` or ``"regression"``.
    - ``name``: short human-readable name (``"digits"``, a file name, ...).
    - ``meta``: free-form extras (e.g. the teacher weights of a synthetic
      regression task); empty by default.
    - ``image_shape``: ``(C, H, W)`` when each row of ``X`` is an image stored
      channel-major (``X.reshape(n, C, H, W)`` gives the images; one-dimensional
      signals are height-1 images ``(C, 1, L)``), ``None`` for plain features.

    Construction checks shapes, dtypes, the task and ``image_shape``, raising ``ValueError``.
    """

    X_train: np.ndarray
    y_train: np.ndarray
    X_test: np.ndarray
    y_test: np.ndarray
    n_classes: int
    task: str
    name: str
    meta: dict[str, Any] = field(default_factory=dict)
    image_shape: tuple[int, int, int] | None = None

    def __post_init__(self) -> None:
        if self.task not in TASKS:
            raise ValueError(f"Dataset.task: must be one of {TASKS}, got {self.task!r}")
        for part in ("train", "test"):
            X = getattr(self, f"X_{part}")
            y = getattr(self, f"y_{part}")
            if not isinstance(X, np.ndarray) or X.dtype != np.float32 or X.ndim != 2:
                raise ValueError(f"Dataset.X_{part}: must be a 2-D float32 array, got "
                                 f"{getattr(X, 'dtype', type(X).__name__)} with shape {np.shape(X)}")
            want = (np.int64, 1) if self.task == "classification" else (np.float32, 2)
            if not isinstance(y, np.ndarray) or y.dtype != want[0] or y.ndim != want[1]:
                raise ValueError(f"Dataset.y_{part}: {self.task} needs a {want[1]}-D "
                                 f"{np.dtype(want[0]).name} array, got "
                                 f"{getattr(y, 'dtype', type(y).__name__)} with shape {np.shape(y)}")
            if len(X) != len(y):
                raise ValueError(f"Dataset: len(X_{part}) = {len(X)} != len(y_{part}) = {len(y)}")
        if self.X_train.shape[1] != self.X_test.shape[1]:
            raise ValueError(f"Dataset: X_train has {self.X_train.shape[1]} features, "
                             f"X_test has {self.X_test.shape[1]}")
        if self.task == "regression" and self.y_train.shape[1] != self.y_test.shape[1]:
            raise ValueError(f"Dataset: y_train has {self.y_train.shape[1]} outputs, "
                             f"y_test has {self.y_test.shape[1]}")
        if self.image_shape is not None:
            shape = self.image_shape
            if (not isinstance(shape, tuple) or len(shape) != 3
                    or not all(isinstance(s, int) and not isinstance(s, bool) and s >= 1 for s in shape)
                    or math.prod(shape) != self.X_train.shape[1]):
                raise ValueError(f"Dataset.image_shape: must be None or a tuple of 3 ints >= 1 (C, H, W) "
                                 f"whose product is the {self.X_train.shape[1]} features, got {shape!r}")

    @property
    def n_features(self) -> int:
        """Input features ``d`` (columns of ``X_train``)."""
        return int(self.X_train.shape[1])

    @property
    def n_outputs(self) -> int:
        """Network outputs: ``n_classes`` for classification, ``k`` for regression."""
        if self.task == "classification":
            return int(self.n_classes)
        return int(self.y_train.shape[1])

    @property
    def n_train(self) -> int:
        """Number of training samples."""
        return int(self.X_train.shape[0])

    @property
    def n_test(self) -> int:
        """Number of test samples."""
        return int(self.X_test.shape[0])

    def __repr__(self) -> str:
        return (f"Dataset(name={self.name!r}, task={self.task!r}, n_train={self.n_train}, "
                f"n_test={self.n_test}, n_features={self.n_features}, n_outputs={self.n_outputs}, "
                f"image_shape={self.image_shape})")


def check_test_fraction(test_fraction) -> float:
    if (isinstance(test_fraction, bool) or not isinstance(test_fraction, numbers.Real)
            or not math.isfinite(test_fraction) or not 0.0 < test_fraction < 1.0):
        raise ValueError(f"test_fraction: must be a number in (0, 1) exclusive, got {test_fraction!r}")
    return float(test_fraction)


def check_int(name: str, value, low: int) -> int:
    if isinstance(value, bool) or not isinstance(value, numbers.Integral) or value < low:
        raise ValueError(f"{name}: must be an integer >= {low}, got {value!r}")
    return int(value)


def split_indices(n: int, test_fraction: float, seed: int) -> tuple[np.ndarray, np.ndarray]:
    """(train_idx, test_idx) of a seeded shuffled split of ``n`` samples.

    ``perm = np.random.default_rng(seed).permutation(n)``; the first
    ``round(n * test_fraction)`` indices form the test set, the rest the training set.
    """
    n_test = int(round(n * test_fraction))
    if n_test < 1 or n_test > n - 1:
        raise ValueError(f"test_fraction: {test_fraction} of {n} samples gives {n_test} test and "
                         f"{n - n_test} training samples; both must be >= 1")
    perm = np.random.default_rng(seed).permutation(n)
    return perm[n_test:], perm[:n_test]


def pixels_to_unit(raw: np.ndarray, max_value: float) -> np.ndarray:
    """``(n, ...)`` integer pixels -> ``(n, prod(...)) float32`` divided by ``max_value``.

    Casts into one float32 buffer and divides in place (no float64 temporary), so
    60000 28x28 images cost their 188 MB once.
    """
    out = np.empty((raw.shape[0], math.prod(raw.shape[1:])), dtype=np.float32)
    out[...] = raw.reshape(out.shape)
    np.divide(out, np.float32(max_value), out=out)
    return out
