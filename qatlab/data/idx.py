"""IDX files (the MNIST format), plain or gzipped, read with every header field checked.

Layout: two zero bytes, a dtype code, the number of dimensions ``ndim``, then
``ndim`` big-endian uint32 sizes, then the values big-endian in row-major order.
``idx1`` files hold labels ``(n,)``, ``idx3`` files images ``(n, rows, cols)``.
Anything that does not fit (bad magic, unknown dtype code, zero sizes, data shorter
or longer than the header says, a broken gzip stream) raises ``ValueError`` without
quoting the file's bytes.
"""
from __future__ import annotations

import gzip
import math
import os
import struct
import zlib
from pathlib import Path

import numpy as np

from .limits import MAX_FILE_BYTES, check_decompressed, check_file_size, check_shape

# IDX dtype codes -> numpy dtypes (big-endian).
IDX_DTYPES = {0x08: np.dtype(np.uint8), 0x09: np.dtype(np.int8), 0x0B: np.dtype(">i2"),
              0x0C: np.dtype(">i4"), 0x0D: np.dtype(">f4"), 0x0E: np.dtype(">f8")}
_GZIP_MAGIC = b"\x1f\x8b"
_MAX_NDIM = 4


def _read_exact(f, n: int, name: str, what: str) -> bytes:
    buf = f.read(n)
    if len(buf) != n:
        raise ValueError(f"{name}: truncated IDX file: {what} needs {n} bytes, only {len(buf)} present")
    return buf


def _parse(f, name: str) -> np.ndarray:
    magic = _read_exact(f, 4, name, "the magic number")
    if magic[0] != 0 or magic[1] != 0:
        raise ValueError(f"{name}: not an IDX file (the magic number must start with two zero bytes)")
    dtype = IDX_DTYPES.get(magic[2])
    if dtype is None:
        raise ValueError(f"{name}: unknown IDX dtype code 0x{magic[2]:02X}; expected one of "
                         f"{', '.join(f'0x{c:02X}' for c in IDX_DTYPES)}")
    ndim = magic[3]
    if not 1 <= ndim <= _MAX_NDIM:
        raise ValueError(f"{name}: IDX header gives {ndim} dimensions; expected 1..{_MAX_NDIM}")
    shape = struct.unpack(f">{ndim}I", _read_exact(f, 4 * ndim, name, "the dimension sizes"))
    if min(shape) == 0:
        raise ValueError(f"{name}: IDX header gives an empty shape {shape}")
    check_shape(name, shape)
    nbytes = math.prod(shape) * dtype.itemsize
    check_decompressed(name, nbytes)
    body = _read_exact(f, nbytes, name, f"shape {shape} of {dtype.name}")
    if f.read(1):
        raise ValueError(f"{name}: IDX file is longer than its header's shape {shape} of {dtype.name}")
    return np.frombuffer(body, dtype=dtype).reshape(shape).astype(dtype.newbyteorder("="))


def read_idx(path: str | os.PathLike) -> np.ndarray:
    """The array stored in an IDX file (gzipped or not, told by its first bytes).

    Returns an array of the header's shape in native byte order: ``uint8``,
    ``int8``, ``int16``, ``int32``, ``float32`` or ``float64``.

    Raises:
        ValueError: not a regular file, above ``MAX_FILE_BYTES`` on disk, corrupt
            or truncated (gzip or IDX), sizes above ``MAX_SAMPLES`` /
            ``MAX_FEATURES`` / ``MAX_DECOMPRESSED_BYTES``.
    """
    path = Path(path)
    name = path.name
    if path.is_dir():
        raise ValueError(f"path: {name!r} is a directory, not an IDX file")
    if not path.is_file():
        raise ValueError(f"path: no such file {name!r}")
    check_file_size(name, path.stat().st_size, MAX_FILE_BYTES)
    with open(path, "rb") as raw:
        gz = raw.read(2) == _GZIP_MAGIC
        raw.seek(0)
        f = gzip.GzipFile(fileobj=raw, mode="rb") if gz else raw
        try:
            return _parse(f, name)
        except (OSError, EOFError, zlib.error):  # gzip.BadGzipFile is an OSError
            raise ValueError(f"{name}: corrupt or truncated gzip stream") from None
