"""Datasets: digits, mnist, mnist1d, Fashion-MNIST, seeded synthetic tasks and user files.

Every loader returns a :class:`Dataset` with float32 features. Conventions (``n``
samples, ``d`` features):

- classification: ``X`` is ``(n, d) float32``, ``y`` is ``(n,) int64`` with labels
  in ``0 .. n_classes - 1``;
- regression: ``X`` is ``(n, d) float32``, ``y`` is ``(n, k) float32`` and
  ``n_classes`` is 0;
- images: each row of ``X`` is one image flattened channel-major, and
  ``Dataset.image_shape`` is its ``(C, H, W)`` (one-dimensional signals are
  height-1 images); pixel images (uint8 sources) are scaled to [0, 1], while
  mnist1d keeps the standardised values its package makes.

Sets without a fixed split are split by ``test_fraction``/``seed``:
``perm = np.random.default_rng(seed).permutation(n)``; the first
``round(n * test_fraction)`` indices of ``perm`` form the test set, the rest the
training set (both kept in permutation order). mnist1d and fashion_mnist keep
their published splits and ignore ``test_fraction``.

User files are checked against the limits in :mod:`qatlab.data.limits`; errors
never quote a file's contents. Bad arguments raise ``ValueError`` naming the
parameter and the allowed range. This package depends on numpy only.
"""
from __future__ import annotations

import os

from ..config import DataConfig
from .dataset import Dataset, split_indices
from .datadir import list_data_files, resolve_data_file, save_upload
from .files import load_arrays, read_idx_pair
from .idx import read_idx
from .limits import (MAX_CLASSES, MAX_CSV_BYTES, MAX_DECOMPRESSED_BYTES, MAX_FEATURES, MAX_FILE_BYTES, MAX_SAMPLES,
                     MAX_UPLOAD_BYTES)
from .shipped import (ASSETS_DIR, DATA_DIR_ENV, DATASET_CARDS, DIGITS_PATH, FASHION_MNIST_FILES,
                      FASHION_MNIST_SYSTEM_DIR, MNIST1D_PATH, MNIST_PATH, fashion_mnist_dir, load_digits,
                      load_fashion_mnist, load_mnist, load_mnist1d)
from .synthetic import make_synthetic

__all__ = ["Dataset", "load_dataset", "load_digits", "load_mnist", "load_mnist1d", "load_fashion_mnist",
           "make_synthetic", "load_arrays", "read_idx", "read_idx_pair", "split_indices", "DATASET_CARDS",
           "list_data_files", "resolve_data_file", "save_upload", "fashion_mnist_dir",
           "ASSETS_DIR", "DIGITS_PATH", "MNIST_PATH", "MNIST1D_PATH", "FASHION_MNIST_SYSTEM_DIR",
           "FASHION_MNIST_FILES", "DATA_DIR_ENV", "MAX_CLASSES", "MAX_FEATURES", "MAX_SAMPLES", "MAX_FILE_BYTES",
           "MAX_CSV_BYTES", "MAX_DECOMPRESSED_BYTES", "MAX_UPLOAD_BYTES", "check_data_here"]


def load_dataset(cfg) -> Dataset:
    """Build the dataset a :class:`qatlab.config.DataConfig` describes.

    Calls ``cfg.validate()`` first, then dispatches on ``cfg.dataset``:
    ``"digits"`` / ``"mnist"`` -> :func:`load_digits` / :func:`load_mnist`
    (``test_fraction``, ``seed``); ``"mnist1d"`` -> :func:`load_mnist1d` (fixed
    split); ``"fashion_mnist"`` -> :func:`load_fashion_mnist` (fixed split; ``path``
    names its directory if set); ``"synthetic"`` -> :func:`make_synthetic`
    (classification, Gaussian clusters, with ``n_samples``, ``n_features``,
    ``n_classes``, ``test_fraction``, ``seed``); ``"file"`` -> :func:`load_arrays`
    (classification, ``path``, ``test_fraction``, ``seed``).
    """
    if not isinstance(cfg, DataConfig):
        raise TypeError(f"cfg: expected a qatlab.config.DataConfig, got {type(cfg).__name__}")
    cfg.validate()
    if cfg.dataset == "digits":
        return load_digits(test_fraction=cfg.test_fraction, seed=cfg.seed)
    if cfg.dataset == "mnist":
        return load_mnist(test_fraction=cfg.test_fraction, seed=cfg.seed)
    if cfg.dataset == "mnist1d":
        return load_mnist1d()
    if cfg.dataset == "fashion_mnist":
        return load_fashion_mnist(cfg.path or None)
    if cfg.dataset == "synthetic":
        return make_synthetic("classification", n_samples=cfg.n_samples, n_features=cfg.n_features,
                              n_classes=cfg.n_classes, test_fraction=cfg.test_fraction, seed=cfg.seed)
    if cfg.dataset == "file":
        return load_arrays(cfg.path, test_fraction=cfg.test_fraction, seed=cfg.seed)
    raise ValueError(f"DataConfig.dataset: unknown dataset {cfg.dataset!r}")  # unreachable via Param


def check_data_here(data_cfg, where: str) -> None:
    """ValueError naming a data path that does not exist on this machine, the one that trains the run
    (``where``: ``"worker tcp://..."``, ``"this machine"``)."""
    path = data_cfg.path
    if data_cfg.dataset == "file" and not os.path.isfile(path):
        raise ValueError(f"data.path: {path!r} is not a file on {where}; a run's data file must exist "
                         "where the run trains (copy it there or use a shipped dataset)")
    if data_cfg.dataset == "fashion_mnist" and path and not os.path.isdir(path):
        raise ValueError(f"data.path: {path!r} is not a directory on {where}; the Fashion-MNIST files "
                         "must exist where the run trains")
