"""Datasets: the embedded 8x8 digits, seeded synthetic tasks, and user arrays.

Every loader returns a :class:`Dataset` with float32 features and a seeded,
shuffled train/test split, so the same arguments give the same arrays, bit for
bit. Conventions (shapes with ``n`` samples and ``d`` features):

- classification: ``X`` is ``(n, d) float32``, ``y`` is ``(n,) int64`` with labels
  in ``0 .. n_classes - 1``;
- regression: ``X`` is ``(n, d) float32``, ``y`` is ``(n, k) float32`` and
  ``n_classes`` is 0.

The split: ``perm = np.random.default_rng(seed).permutation(n)``; the first
``round(n * test_fraction)`` indices of ``perm`` form the test set, the rest the
training set (both kept in permutation order). No stratification.

Bad arguments raise ``ValueError`` naming the parameter and the allowed range.
This module depends on numpy only.
"""
from __future__ import annotations

import functools
import math
import numbers
import os
import warnings
import zipfile
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from .config import DataConfig

__all__ = ["Dataset", "load_digits", "make_synthetic", "load_arrays", "load_dataset", "DIGITS_PATH"]

#: Location of the shipped digits asset (made by ``assets/make_digits.py``).
DIGITS_PATH = Path(__file__).resolve().parent.parent / "assets" / "digits.npz"

_TASKS = ("classification", "regression")
# Upper bound on n_classes (max label + 1) of user data: guards against a stray
# huge label silently asking for a giant output layer.
_MAX_CLASSES = 1_000_000


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

    Construction checks shapes, dtypes and the task, raising ``ValueError``.
    """

    X_train: np.ndarray
    y_train: np.ndarray
    X_test: np.ndarray
    y_test: np.ndarray
    n_classes: int
    task: str
    name: str
    meta: dict[str, Any] = field(default_factory=dict)

    def __post_init__(self) -> None:
        if self.task not in _TASKS:
            raise ValueError(f"Dataset.task: must be one of {_TASKS}, got {self.task!r}")
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
                f"n_test={self.n_test}, n_features={self.n_features}, n_outputs={self.n_outputs})")


# ----------------------------------------------------------------------------- validation

def _check_test_fraction(test_fraction) -> float:
    if (isinstance(test_fraction, bool) or not isinstance(test_fraction, numbers.Real)
            or not math.isfinite(test_fraction) or not 0.0 < test_fraction < 1.0):
        raise ValueError(f"test_fraction: must be a number in (0, 1) exclusive, got {test_fraction!r}")
    return float(test_fraction)


def _check_int(name: str, value, low: int) -> int:
    if isinstance(value, bool) or not isinstance(value, numbers.Integral) or value < low:
        raise ValueError(f"{name}: must be an integer >= {low}, got {value!r}")
    return int(value)


def _split_indices(n: int, test_fraction: float, seed: int) -> tuple[np.ndarray, np.ndarray]:
    """(train_idx, test_idx) of a seeded shuffled split of ``n`` samples."""
    n_test = int(round(n * test_fraction))
    if n_test < 1 or n_test > n - 1:
        raise ValueError(f"test_fraction: {test_fraction} of {n} samples gives {n_test} test and "
                         f"{n - n_test} training samples; both must be >= 1")
    perm = np.random.default_rng(seed).permutation(n)
    return perm[n_test:], perm[:n_test]


# ----------------------------------------------------------------------------- digits

@functools.lru_cache(maxsize=1)
def _digits_raw() -> tuple[np.ndarray, np.ndarray]:
    if not DIGITS_PATH.is_file():
        raise FileNotFoundError(f"digits asset not found at {DIGITS_PATH}; regenerate it with "
                                f"`python assets/make_digits.py` (needs scikit-learn)")
    with np.load(DIGITS_PATH, allow_pickle=False) as f:
        X = (f["X"].astype(np.float32) / np.float32(16.0))
        y = f["y"].astype(np.int64)
    X.flags.writeable = False
    y.flags.writeable = False
    return X, y


def load_digits(test_fraction: float = 0.2, seed: int = 0) -> Dataset:
    """The 8x8 handwritten digits (UCI, as bundled by scikit-learn), split for training.

    1797 samples, 64 features, 10 classes. Features are the pixel counts 0..16
    divided by 16, so ``X`` is float32 in [0, 1]; labels are int64 in 0..9.

    Args:
        test_fraction: share of samples held out, in (0, 1) exclusive;
            ``round(1797 * test_fraction)`` samples go to the test set.
        seed: integer >= 0 seeding the shuffle of the split.

    Returns:
        ``Dataset(task="classification", n_classes=10, name="digits")`` with
        ``X_train (n_train, 64) float32``, ``y_train (n_train,) int64``,
        ``X_test (n_test, 64) float32``, ``y_test (n_test,) int64``.
    """
    test_fraction = _check_test_fraction(test_fraction)
    seed = _check_int("seed", seed, 0)
    X, y = _digits_raw()
    train, test = _split_indices(len(X), test_fraction, seed)
    return Dataset(X[train], y[train], X[test], y[test], n_classes=10,
                   task="classification", name="digits")


# ----------------------------------------------------------------------------- synthetic

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
    if kind not in _TASKS:
        raise ValueError(f"kind: must be one of {_TASKS}, got {kind!r}")
    n_samples = _check_int("n_samples", n_samples, 2)
    n_features = _check_int("n_features", n_features, 1)
    test_fraction = _check_test_fraction(test_fraction)
    seed = _check_int("seed", seed, 0)
    if noise is None:
        noise = _DEFAULT_NOISE[kind]
    if (isinstance(noise, bool) or not isinstance(noise, numbers.Real)
            or not math.isfinite(noise) or noise < 0):
        raise ValueError(f"noise: must be a finite number >= 0, got {noise!r}")
    noise = float(noise)
    if kind == "classification":
        n_classes = _check_int("n_classes", n_classes, 2)
    else:
        n_outputs = _check_int("n_outputs", n_outputs, 1)
        hidden = _check_int("hidden", hidden, 1)
    train, test = _split_indices(n_samples, test_fraction, seed)  # checks the split first

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


# ----------------------------------------------------------------------------- user files

def _read_npz(path: Path) -> dict[str, np.ndarray]:
    try:
        with np.load(path, allow_pickle=False) as f:
            keys = set(f.files)
            arrays = {k: f[k] for k in ("X", "y", "X_test", "y_test") if k in keys}
    except ValueError as e:  # e.g. object arrays, which would need pickle
        raise ValueError(f"{path}: cannot read as .npz without pickle: {e}") from None
    except (OSError, EOFError, zipfile.BadZipFile) as e:
        raise ValueError(f"{path}: not a readable .npz file: {e}") from None
    for key in ("X", "y"):
        if key not in arrays:
            raise ValueError(f"{path}: missing key {key!r} (found keys: {sorted(keys)}); "
                             f"a .npz needs 'X' and 'y', optionally 'X_test' and 'y_test'")
    if ("X_test" in arrays) != ("y_test" in arrays):
        have, miss = ("X_test", "y_test") if "X_test" in arrays else ("y_test", "X_test")
        raise ValueError(f"{path}: has {have!r} but missing key {miss!r}; give both or neither")
    return arrays


def _is_numeric_row(line: str) -> bool:
    try:
        [float(v) for v in line.split(",")]
    except ValueError:
        return False
    return True


def _read_csv(path: Path) -> dict[str, np.ndarray]:
    try:
        text = path.read_text(encoding="utf-8-sig")
    except UnicodeDecodeError as e:
        raise ValueError(f"{path}: not a UTF-8 text CSV: {e}") from None
    lines = [ln for ln in text.splitlines() if ln.strip() and not ln.lstrip().startswith("#")]
    if lines and not _is_numeric_row(lines[0]):
        lines = lines[1:]  # header row
    if not lines:
        raise ValueError(f"{path}: empty data (no numeric rows)")
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            table = np.loadtxt(lines, delimiter=",", dtype=np.float64, ndmin=2, comments=None)
    except ValueError as e:
        raise ValueError(f"{path}: CSV must be numeric with the same number of columns "
                         f"in every row: {e}") from None
    if table.shape[1] < 2:
        raise ValueError(f"{path}: CSV needs at least 2 columns (features..., label), "
                         f"got {table.shape[1]}")
    return {"X": table[:, :-1], "y": table[:, -1]}


def _as_features(name: str, X: np.ndarray) -> np.ndarray:
    if X.ndim != 2:
        raise ValueError(f"{name}: must be 2-D (n_samples, n_features), got shape {X.shape}")
    if X.shape[0] == 0 or X.shape[1] == 0:
        raise ValueError(f"{name}: empty data, shape {X.shape}")
    if not (np.issubdtype(X.dtype, np.number) or X.dtype == np.bool_) or np.iscomplexobj(X):
        raise ValueError(f"{name}: must be real numeric, got dtype {X.dtype}")
    out = np.ascontiguousarray(X, dtype=np.float32)
    bad = ~np.isfinite(out)
    if bad.any():
        row, col = np.argwhere(bad)[0]
        raise ValueError(f"{name}: contains NaN or inf (or values beyond the float32 range), "
                         f"{int(bad.sum())} entries, first at [{row}, {col}]")
    return out


def _as_labels(name: str, y: np.ndarray, n: int) -> np.ndarray:
    if y.ndim != 1:
        raise ValueError(f"{name}: classification labels must be 1-D (n_samples,), got shape {y.shape}")
    if len(y) != n:
        raise ValueError(f"{name}: has {len(y)} labels but X has {n} rows; len(X) must equal len(y)")
    if y.dtype == np.bool_ or np.issubdtype(y.dtype, np.integer):
        labels = y.astype(np.int64)
    elif np.issubdtype(y.dtype, np.floating):
        if not np.isfinite(y).all() or not np.array_equal(y, np.rint(y)):
            raise ValueError(f"{name}: classification labels must be integers 0..n_classes-1, "
                             f"got non-integer values such as {float(y[~np.isfinite(y) | (y != np.rint(y))][0])}")
        if np.abs(y).max() >= _MAX_CLASSES:
            raise ValueError(f"{name}: labels must be in 0..{_MAX_CLASSES - 1}, got {float(y.min())}..{float(y.max())}")
        labels = y.astype(np.int64)
    else:
        raise ValueError(f"{name}: classification labels must be integers, got dtype {y.dtype}")
    if labels.min() < 0:
        raise ValueError(f"{name}: classification labels must be >= 0, got negative label {labels.min()}")
    if labels.max() >= _MAX_CLASSES:
        raise ValueError(f"{name}: labels must be in 0..{_MAX_CLASSES - 1}, got {labels.max()}")
    return labels


def _as_targets(name: str, y: np.ndarray, n: int) -> np.ndarray:
    if y.ndim == 1:
        y = y[:, None]
    if y.ndim != 2:
        raise ValueError(f"{name}: regression targets must be (n_samples,) or (n_samples, k), got shape {y.shape}")
    if len(y) != n:
        raise ValueError(f"{name}: has {len(y)} rows but X has {n} rows; len(X) must equal len(y)")
    if y.shape[1] == 0:
        raise ValueError(f"{name}: empty data, shape {y.shape}")
    return _as_features(name, y)


def load_arrays(path: str | os.PathLike, test_fraction: float = 0.2, seed: int = 0,
                task: str = "classification") -> Dataset:
    """User data from a ``.npz`` or ``.csv`` file, validated and split.

    ``.npz`` (read with ``np.load(path, allow_pickle=False)``): keys ``X``
    ``(n, d)`` and ``y`` (``(n,)`` labels, or ``(n,)``/``(n, k)`` regression
    targets); optional ``X_test``/``y_test`` (both or neither) give a fixed test
    set, in which case ``test_fraction`` and ``seed`` are unused. Other keys are
    ignored.

    ``.csv``: comma-separated numbers, one sample per row, the label (or the
    single regression target) in the last column. A first row that is not all
    numeric is a header and skipped; blank lines and lines starting with ``#``
    are ignored.

    Without a given test set the samples are split by ``test_fraction``/``seed``
    as in :func:`load_digits`. Classification labels must be integers >= 0
    (integral floats are accepted) with at least 2 distinct values;
    ``n_classes = max label + 1`` over train and test.

    Args:
        path: file path ending in ``.npz`` or ``.csv`` (case-insensitive).
        test_fraction: share held out when no test arrays are given, in (0, 1).
        seed: integer >= 0 seeding that split.
        task: ``"classification"`` or ``"regression"``.

    Returns:
        ``Dataset`` named after the file, with ``X (n, d) float32`` and
        ``y (n,) int64`` (classification) or ``y (n, k) float32`` (regression).

    Raises:
        FileNotFoundError: no file at ``path``.
        ValueError: unknown extension, missing key, X not 2-D, len(X) != len(y),
            empty data, NaN/inf in X (or y for regression), labels non-integer
            or negative, fewer than 2 classes, feature count of X_test != X.
    """
    test_fraction = _check_test_fraction(test_fraction)
    seed = _check_int("seed", seed, 0)
    if task not in _TASKS:
        raise ValueError(f"task: must be one of {_TASKS}, got {task!r}")
    path = Path(path)
    ext = path.suffix.lower()
    if ext not in (".npz", ".csv"):
        raise ValueError(f"path: unknown extension {path.suffix!r} of {str(path)!r}; expected .npz or .csv")
    if not path.is_file():
        raise FileNotFoundError(f"path: no such file {str(path)!r}")
    arrays = _read_npz(path) if ext == ".npz" else _read_csv(path)

    X = _as_features("X", arrays["X"])
    parse_y = _as_labels if task == "classification" else _as_targets
    y = parse_y("y", arrays["y"], len(X))
    if "X_test" in arrays:
        X_test = _as_features("X_test", arrays["X_test"])
        if X_test.shape[1] != X.shape[1]:
            raise ValueError(f"X_test: has {X_test.shape[1]} features but X has {X.shape[1]}")
        y_test = parse_y("y_test", arrays["y_test"], len(X_test))
        if task == "regression" and y_test.shape[1] != y.shape[1]:
            raise ValueError(f"y_test: has {y_test.shape[1]} targets per row but y has {y.shape[1]}")
        X_train, y_train = X, y
    else:
        train, test = _split_indices(len(X), test_fraction, seed)
        X_train, y_train, X_test, y_test = X[train], y[train], X[test], y[test]

    n_classes = 0
    if task == "classification":
        distinct = np.unique(np.concatenate([y_train, y_test]))
        if len(distinct) < 2:
            raise ValueError(f"y: classification needs at least 2 classes, got only label(s) {distinct.tolist()}")
        n_classes = int(distinct[-1]) + 1
    return Dataset(X_train, y_train, X_test, y_test, n_classes=n_classes, task=task, name=path.name,
                   meta={"path": str(path)})


# ----------------------------------------------------------------------------- config

def load_dataset(cfg) -> Dataset:
    """Build the dataset a :class:`qatlab.config.DataConfig` describes.

    Calls ``cfg.validate()`` first, then dispatches on ``cfg.dataset``:
    ``"digits"`` -> :func:`load_digits`; ``"synthetic"`` -> :func:`make_synthetic`
    (classification, Gaussian clusters, with ``n_samples``, ``n_features``,
    ``n_classes``); ``"file"`` -> :func:`load_arrays` (classification, ``path``).
    ``test_fraction`` and ``seed`` are passed to all three.

    Returns:
        A ``Dataset`` (shapes and dtypes as documented by the chosen loader).
    """
    if not isinstance(cfg, DataConfig):
        raise TypeError(f"cfg: expected a qatlab.config.DataConfig, got {type(cfg).__name__}")
    cfg.validate()
    if cfg.dataset == "digits":
        return load_digits(test_fraction=cfg.test_fraction, seed=cfg.seed)
    if cfg.dataset == "synthetic":
        return make_synthetic("classification", n_samples=cfg.n_samples, n_features=cfg.n_features,
                              n_classes=cfg.n_classes, test_fraction=cfg.test_fraction, seed=cfg.seed)
    if cfg.dataset == "file":
        return load_arrays(cfg.path, test_fraction=cfg.test_fraction, seed=cfg.seed)
    raise ValueError(f"DataConfig.dataset: unknown dataset {cfg.dataset!r}")  # unreachable via Param
