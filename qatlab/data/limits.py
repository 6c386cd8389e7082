"""Size limits on user data, checked before anything large is read or allocated.

They keep a stray label, a huge file or a small archive that expands a thousandfold
from building a giant model or exhausting the server's memory. Each limit raises
``ValueError`` naming the quantity, the limit and (for sizes) the value found.

- ``MAX_CLASSES``: classification labels must be integers in ``0 .. MAX_CLASSES - 1``.
- ``MAX_FEATURES``: input features per sample (``prod`` of an image's ``C, H, W``).
- ``MAX_SAMPLES``: samples per file (train and test counted separately).
- ``MAX_FILE_BYTES``: size on disk of a ``.npz`` or IDX file.
- ``MAX_CSV_BYTES``: size on disk of a ``.csv`` (parsing text costs ~10x its size).
- ``MAX_DECOMPRESSED_BYTES``: total size of the arrays a ``.npz`` or gzipped IDX
  file declares in its headers, checked before any array is read.
- ``MAX_UPLOAD_BYTES``: one file uploaded through the page (:func:`save_upload`).
"""
from __future__ import annotations

MAX_CLASSES = 1000
MAX_FEATURES = 100_000
MAX_SAMPLES = 1_000_000
MAX_FILE_BYTES = 200 * 2**20
MAX_CSV_BYTES = 50 * 2**20
MAX_DECOMPRESSED_BYTES = 400 * 2**20
MAX_UPLOAD_BYTES = 20 * 2**20


def _mb(n: int) -> str:
    return f"{n / 2**20:.1f} MB"


def check_file_size(name: str, size: int, limit: int = MAX_FILE_BYTES) -> None:
    if size > limit:
        raise ValueError(f"{name}: file is {_mb(size)}, above the limit of {_mb(limit)}")


def check_decompressed(name: str, nbytes: int) -> None:
    if nbytes > MAX_DECOMPRESSED_BYTES:
        raise ValueError(f"{name}: its arrays would take {_mb(nbytes)} in memory once read, above the "
                         f"limit of {_mb(MAX_DECOMPRESSED_BYTES)}")


def check_shape(name: str, shape: tuple[int, ...]) -> None:
    """Samples (first axis) and features (product of the others) within the limits."""
    n = shape[0] if shape else 0
    features = 1
    for s in shape[1:]:
        features *= s
    if n > MAX_SAMPLES:
        raise ValueError(f"{name}: {n} samples, above the limit of {MAX_SAMPLES}")
    if features > MAX_FEATURES:
        raise ValueError(f"{name}: {features} features per sample, above the limit of {MAX_FEATURES}")
