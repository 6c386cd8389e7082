"""User data files: ``.npz``, ``.csv`` and IDX pairs, validated and split.

Error messages name the file (its name, not its directory), the array or row, and
what is allowed; they never quote the file's contents or list its unexpected keys,
so a page can show them without leaking what a file holds.
"""
from __future__ import annotations

import gzip
import math
import os
import re
import warnings
import zipfile
from pathlib import Path

import numpy as np

from .dataset import TASKS, Dataset, check_int, check_test_fraction, pixels_to_unit, split_indices
from .idx import read_idx
from .limits import (MAX_CLASSES, MAX_CSV_BYTES, MAX_FILE_BYTES, check_decompressed, check_file_size,
                     check_shape)

NPZ_KEYS = ("X", "y", "X_test", "y_test")
# An IDX images file, e.g. train-images-idx3-ubyte(.gz); its labels swap "images-idx3" for "labels-idx1".
IDX_IMAGES = re.compile(r"images-idx3-ubyte(\.gz)?$", re.IGNORECASE)
IDX_NAME = re.compile(r"-idx[1-4]-ubyte(\.gz)?$", re.IGNORECASE)


# ----------------------------------------------------------------------------- .npz

_NPY_HEADERS = {(1, 0): np.lib.format.read_array_header_1_0, (2, 0): np.lib.format.read_array_header_2_0}

def _npy_header(zf: zipfile.ZipFile, member: str, fname: str, key: str) -> tuple[tuple, np.dtype]:
    """Shape and dtype of a ``.npy`` member, read from its header only."""
    with zf.open(member) as f:
        try:
            version = np.lib.format.read_magic(f)
            read_header = _NPY_HEADERS.get(version)
            if read_header is None:
                raise ValueError("unsupported .npy version")
            shape, _, dtype = read_header(f)
        except (ValueError, EOFError, SyntaxError, TypeError):
            raise ValueError(f"{fname}: member {key!r} is not a .npy array numpy can read without pickle") from None
    if dtype.hasobject:
        raise ValueError(f"{fname}: {key} holds Python objects, which would need pickle; "
                         f"store numeric arrays")
    return shape, dtype


def _read_npz(path: Path) -> dict[str, np.ndarray]:
    fname = path.name
    check_file_size(fname, path.stat().st_size, MAX_FILE_BYTES)
    try:
        with zipfile.ZipFile(path) as zf:
            members = {n[:-4]: n for n in zf.namelist() if n.endswith(".npy")}
            present = [k for k in NPZ_KEYS if k in members]
            for key in ("X", "y"):
                if key not in present:
                    raise ValueError(f"{fname}: missing key {key!r}; a .npz needs 'X' and 'y', "
                                     f"optionally 'X_test' and 'y_test'")
            if ("X_test" in present) != ("y_test" in present):
                have, miss = ("X_test", "y_test") if "X_test" in present else ("y_test", "X_test")
                raise ValueError(f"{fname}: has {have!r} but missing key {miss!r}; give both or neither")
            headers = {k: _npy_header(zf, members[k], fname, k) for k in present}
            total = 0
            for key, (shape, dtype) in headers.items():
                nbytes = math.prod(shape) * dtype.itemsize
                if nbytes > zf.getinfo(members[key]).file_size:
                    raise ValueError(f"{fname}: member {key!r} is shorter than its .npy header says "
                                     f"(truncated or corrupt)")
                check_shape(f"{fname}: {key}", shape if shape else (0,))
                total += nbytes
            check_decompressed(fname, total)
            arrays = {}
            for key in present:
                with zf.open(members[key]) as f:
                    arrays[key] = np.lib.format.read_array(f, allow_pickle=False)
    except (OSError, EOFError, zipfile.BadZipFile, zipfile.LargeZipFile, NotImplementedError):
        raise ValueError(f"{fname}: not a readable .npz file (corrupt, truncated or not a zip archive)") from None
    return arrays


# ----------------------------------------------------------------------------- .csv

def _parse_row(line: str) -> list[float] | None:
    try:
        return [float(v) for v in line.split(",")]
    except ValueError:
        return None


def _first_bad_row(rows: list[tuple[int, str]], n_cols: int) -> str:
    """Where the slow, row-by-row parse fails, said without the offending values."""
    for lineno, line in rows:
        cells = line.split(",")
        if len(cells) != n_cols:
            return f"row {lineno}: has {len(cells)} columns, expected {n_cols}"
        for col, cell in enumerate(cells, 1):
            try:
                float(cell)
            except ValueError:
                return f"row {lineno}, column {col}: not a number"
    return "the values could not be read as numbers"


def _read_csv(path: Path) -> dict[str, np.ndarray]:
    fname = path.name
    check_file_size(fname, path.stat().st_size, MAX_CSV_BYTES)
    try:
        text = path.read_bytes().decode("utf-8-sig")
    except UnicodeDecodeError as e:
        raise ValueError(f"{fname}: not a UTF-8 text CSV (undecodable byte at offset {e.start})") from None
    rows = [(i, ln) for i, ln in enumerate(text.splitlines(), 1)
            if ln.strip() and not ln.lstrip().startswith("#")]
    if rows and _parse_row(rows[0][1]) is None:
        rows = rows[1:]  # header row
    if not rows:
        raise ValueError(f"{fname}: empty data (no numeric rows)")
    n_cols = len(rows[0][1].split(","))
    if n_cols < 2:
        raise ValueError(f"{fname}: CSV needs at least 2 columns (features..., label), got {n_cols}")
    check_shape(fname, (len(rows), n_cols - 1))
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            table = np.loadtxt([ln for _, ln in rows], delimiter=",", dtype=np.float64, ndmin=2, comments=None)
    except ValueError:
        raise ValueError(f"{fname}: CSV must be numeric with the same number of columns in every row; "
                         f"{_first_bad_row(rows, n_cols)}") from None
    return {"X": table[:, :-1], "y": table[:, -1]}


# ----------------------------------------------------------------------------- IDX

def labels_beside(images: Path) -> Path:
    """The labels file paired with an IDX images file, in the same real directory.

    ``xxx-images-idx3-ubyte[.gz]`` pairs with ``xxx-labels-idx1-ubyte`` (gzipped or
    not). The labels must resolve into the images' own directory, so a symlink cannot
    pull in a file from elsewhere.
    """
    real = images.resolve()
    stem = IDX_IMAGES.sub("", real.name)
    for suffix in ("labels-idx1-ubyte.gz", "labels-idx1-ubyte"):
        cand = (real.parent / (stem + suffix))
        if cand.is_file() and cand.resolve().parent == real.parent:
            return cand.resolve()
    raise ValueError(f"{images.name}: no labels file {stem}labels-idx1-ubyte[.gz] beside it")


def read_idx_pair(images: Path, labels: Path) -> tuple[np.ndarray, np.ndarray, tuple[int, int, int]]:
    """``(X (n, C*H*W) float32, y (n,) labels, (C, H, W))`` from an images and a labels IDX file.

    Images are ``(n, H, W)`` (one channel) or ``(n, C, H, W)``; ``uint8`` pixels are
    divided by 255 to [0, 1], other dtypes are kept as values.
    """
    X = read_idx(images)
    y = read_idx(labels)
    if X.ndim not in (3, 4):
        raise ValueError(f"{images.name}: IDX images must have 3 or 4 dimensions (n, [C,] H, W), got {X.ndim}")
    if y.ndim != 1:
        raise ValueError(f"{labels.name}: IDX labels must have 1 dimension, got {y.ndim}")
    if len(X) != len(y):
        raise ValueError(f"{images.name}: has {len(X)} images but {labels.name} has {len(y)} labels")
    shape = (1, *X.shape[1:]) if X.ndim == 3 else X.shape[1:]
    if X.dtype == np.uint8:
        flat = pixels_to_unit(X, 255.0)
    else:
        flat = X.reshape(len(X), -1)
    return flat, y, tuple(int(s) for s in shape)


# ----------------------------------------------------------------------------- checks

def _as_features(name: str, X: np.ndarray) -> tuple[np.ndarray, tuple[int, int, int] | None]:
    """2-D float32 features and the image shape of a 3-D ``(n, H, W)`` / 4-D ``(n, C, H, W)`` X."""
    if X.ndim not in (2, 3, 4):
        raise ValueError(f"{name}: must be 2-D (n_samples, n_features), 3-D (n, H, W) or 4-D (n, C, H, W), "
                         f"got shape {X.shape}")
    if min(X.shape) == 0:
        raise ValueError(f"{name}: empty data, shape {X.shape}")
    if not (np.issubdtype(X.dtype, np.number) or X.dtype == np.bool_) or np.iscomplexobj(X):
        raise ValueError(f"{name}: must be real numeric, got dtype {X.dtype}")
    check_shape(name, X.shape)
    image = None
    if X.ndim > 2:
        image = tuple(int(s) for s in ((1, *X.shape[1:]) if X.ndim == 3 else X.shape[1:]))
    if image is not None and X.dtype == np.uint8:  # uint8 images are pixels 0..255, as in IDX files
        return pixels_to_unit(X, 255.0), image
    out = np.ascontiguousarray(X.reshape(len(X), -1), dtype=np.float32)
    _check_finite(name, out)
    return out, image


def _check_finite(name: str, out: np.ndarray) -> None:
    bad = ~np.isfinite(out)
    if bad.any():
        row, col = np.argwhere(bad)[0]
        raise ValueError(f"{name}: contains NaN or inf (or values beyond the float32 range), "
                         f"{int(bad.sum())} entries, first at [{row}, {col}]")


def _as_labels(name: str, y: np.ndarray, n: int) -> np.ndarray:
    if y.ndim != 1:
        raise ValueError(f"{name}: classification labels must be 1-D (n_samples,), got shape {y.shape}")
    if len(y) != n:
        raise ValueError(f"{name}: has {len(y)} labels but X has {n} rows; len(X) must equal len(y)")
    allowed = f"integers in 0..{MAX_CLASSES - 1}"
    if y.dtype == np.bool_ or np.issubdtype(y.dtype, np.integer):
        if y.dtype != np.bool_ and len(y) and (y.min() < 0 or y.max() >= MAX_CLASSES):
            first = int(np.flatnonzero((y < 0) | (y >= MAX_CLASSES))[0])
            raise ValueError(f"{name}: classification labels must be {allowed} (at most {MAX_CLASSES} "
                             f"classes); label at index {first} is outside")
        return y.astype(np.int64)
    if np.issubdtype(y.dtype, np.floating):
        bad = ~np.isfinite(y) | (y != np.rint(y)) | (y < 0) | (y >= MAX_CLASSES)
        if bad.any():
            first = int(np.flatnonzero(bad)[0])
            raise ValueError(f"{name}: classification labels must be {allowed} (at most {MAX_CLASSES} "
                             f"classes); label at index {first} is not")
        return y.astype(np.int64)
    raise ValueError(f"{name}: classification labels must be {allowed}, got dtype {y.dtype}")


def _as_targets(name: str, y: np.ndarray, n: int) -> np.ndarray:
    if y.ndim == 1:
        y = y[:, None]
    if y.ndim != 2:
        raise ValueError(f"{name}: regression targets must be (n_samples,) or (n_samples, k), got shape {y.shape}")
    if len(y) != n:
        raise ValueError(f"{name}: has {len(y)} rows but X has {n} rows; len(X) must equal len(y)")
    if y.shape[1] == 0:
        raise ValueError(f"{name}: empty data, shape {y.shape}")
    if not (np.issubdtype(y.dtype, np.number) or y.dtype == np.bool_) or np.iscomplexobj(y):
        raise ValueError(f"{name}: must be real numeric, got dtype {y.dtype}")
    check_shape(name, y.shape)
    out = np.ascontiguousarray(y, dtype=np.float32)
    _check_finite(name, out)
    return out


def n_classes_of(y_train: np.ndarray, y_test: np.ndarray) -> int:
    """``max label + 1`` over both parts; at least 2 distinct labels required."""
    distinct = np.unique(np.concatenate([y_train, y_test]))
    if len(distinct) < 2:
        raise ValueError(f"y: classification needs at least 2 classes, got only {len(distinct)} distinct label")
    return int(distinct[-1]) + 1


def file_image_shape(path: str | os.PathLike) -> tuple[int, ...] | None:
    """``(C, H, W)`` of the images a data file holds, ``()`` when it holds flat features, None when
    that cannot be told without loading it (missing or unreadable: loading names the problem).
    Reads headers only: ``.csv`` rows are flat, IDX images are (1, H, W), a ``.npz``'s ``X`` by its shape."""
    p = Path(path)
    ext = p.suffix.lower()
    if ext == ".csv":
        return ()
    try:
        if IDX_IMAGES.search(p.name):
            with (gzip.open(p) if ext == ".gz" else open(p, "rb")) as f:
                head = f.read(16)         # magic, then the image count, height and width (big-endian)
            if len(head) < 16:
                return None
            return (1, int.from_bytes(head[8:12], "big"), int.from_bytes(head[12:16], "big"))
        if ext != ".npz":
            return None
        with zipfile.ZipFile(p) as zf:
            if "X.npy" not in zf.namelist():
                return None
            shape, _ = _npy_header(zf, "X.npy", p.name, "X")
    except (OSError, EOFError, ValueError, zipfile.BadZipFile):
        return None
    if len(shape) == 2:
        return ()
    if len(shape) in (3, 4):
        return tuple(int(s) for s in ((1, *shape[1:]) if len(shape) == 3 else shape[1:]))
    return None


# ----------------------------------------------------------------------------- load_arrays

def _read_any(path: Path) -> dict:
    ext = path.suffix.lower()
    if ext == ".npz":
        return _read_npz(path)
    if ext == ".csv":
        return _read_csv(path)
    X, y, shape = read_idx_pair(path, labels_beside(path))
    return {"X": X, "y": y, "image_shape": shape}


def load_arrays(path: str | os.PathLike, test_fraction: float = 0.2, seed: int = 0,
                task: str = "classification") -> Dataset:
    """User data from a ``.npz``, ``.csv`` or IDX file, validated against the limits and split.

    ``.npz`` (members read with ``allow_pickle=False`` after their ``.npy`` headers
    are checked against the limits): keys ``X`` ``(n, d)``, ``(n, H, W)`` or
    ``(n, C, H, W)`` and ``y`` (``(n,)`` labels, or ``(n,)``/``(n, k)`` regression
    targets); optional ``X_test``/``y_test`` (both or neither) give a fixed test
    set, in which case ``test_fraction`` and ``seed`` are unused. Other keys are
    ignored. 3-D/4-D ``X`` is flattened channel-major and its ``(C, H, W)`` kept as
    ``Dataset.image_shape``; such ``uint8`` images are pixels and divided by 255 to
    [0, 1]; any other values are kept as stored (cast to float32).

    ``.csv``: comma-separated numbers, one sample per row, the label (or the
    single regression target) in the last column. A first row that is not all
    numeric is a header and skipped; blank lines and lines starting with ``#``
    are ignored.

    IDX: a file named ``...images-idx3-ubyte`` (optionally ``.gz``) with its
    ``...labels-idx1-ubyte[.gz]`` beside it; ``uint8`` pixels become [0, 1].

    Without a given test set the samples are split by ``test_fraction``/``seed``
    (``perm = default_rng(seed).permutation(n)``, the first ``round(n *
    test_fraction)`` are the test set). Classification labels must be integers in
    ``0 .. MAX_CLASSES - 1`` (integral floats are accepted) with at least 2
    distinct values; ``n_classes = max label + 1`` over train and test. Limits:
    see :mod:`qatlab.data.limits`.

    Returns:
        ``Dataset`` named after the file, with ``X (n, d) float32`` and
        ``y (n,) int64`` (classification) or ``y (n, k) float32`` (regression).

    Raises:
        FileNotFoundError: no file at ``path``.
        ValueError: a directory, unknown extension, missing key, bad shapes,
            len(X) != len(y), empty data, NaN/inf, labels outside the allowed
            range, fewer than 2 classes, a corrupt file, a limit exceeded.
    """
    test_fraction = check_test_fraction(test_fraction)
    seed = check_int("seed", seed, 0)
    if task not in TASKS:
        raise ValueError(f"task: must be one of {TASKS}, got {task!r}")
    path = Path(path)
    fname = path.name
    if path.is_dir():
        raise ValueError(f"path: {fname!r} is a directory; give a .npz, .csv or IDX file")
    if path.suffix.lower() not in (".npz", ".csv") and not IDX_IMAGES.search(fname):
        raise ValueError(f"path: unknown extension {path.suffix!r} of {fname!r}; expected .npz, .csv "
                         f"or an IDX images file (*images-idx3-ubyte[.gz])")
    if not path.is_file():
        raise FileNotFoundError(f"path: no such file {fname!r}")
    arrays = _read_any(path)

    X, image = _as_features("X", arrays["X"])
    image = arrays.get("image_shape", image)
    parse_y = _as_labels if task == "classification" else _as_targets
    y = parse_y("y", arrays["y"], len(X))
    if "X_test" in arrays:
        X_test, image_test = _as_features("X_test", arrays["X_test"])
        if X_test.shape[1] != X.shape[1] or image_test != image:
            raise ValueError(f"X_test: has shape {arrays['X_test'].shape[1:]} per sample but X has "
                             f"{arrays['X'].shape[1:]}")
        y_test = parse_y("y_test", arrays["y_test"], len(X_test))
        if task == "regression" and y_test.shape[1] != y.shape[1]:
            raise ValueError(f"y_test: has {y_test.shape[1]} targets per row but y has {y.shape[1]}")
        X_train, y_train = X, y
    else:
        train, test = split_indices(len(X), test_fraction, seed)
        X_train, y_train, X_test, y_test = X[train], y[train], X[test], y[test]

    n_classes = n_classes_of(y_train, y_test) if task == "classification" else 0
    return Dataset(X_train, y_train, X_test, y_test, n_classes=n_classes, task=task, name=fname,
                   meta={"path": str(path)}, image_shape=image)
