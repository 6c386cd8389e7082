"""The server's data directory: what the page may list, open and upload.

The page never takes a free-form path. It lists the directory with
:func:`list_data_files`, turns a chosen name into a path with
:func:`resolve_data_file` (refused if its real path leaves the directory), and
stores uploads with :func:`save_upload` (size-capped, a whitelisted extension, a
sanitised name, and the content loaded under the limits before it is kept).
"""
from __future__ import annotations

import os
import re
import tempfile
from pathlib import Path

from .files import IDX_IMAGES, IDX_NAME, load_arrays
from .idx import read_idx
from .limits import MAX_UPLOAD_BYTES

#: Most files :func:`list_data_files` returns (a huge directory is cut, not walked to the end).
MAX_LISTED = 1000
_SAFE_CHARS = re.compile(r"[^A-Za-z0-9._-]+")
_MAX_NAME = 100


def _is_data_name(name: str) -> bool:
    """A name an upload may have: .npz, .csv or any IDX file (images and their labels)."""
    return name.lower().endswith((".npz", ".csv")) or bool(IDX_NAME.search(name))


def _is_loadable_name(name: str) -> bool:
    """A name that load_arrays takes: .npz, .csv or IDX images (their labels are found beside them)."""
    return name.lower().endswith((".npz", ".csv")) or bool(IDX_IMAGES.search(name))


def _root(data_dir) -> Path:
    root = Path(data_dir).resolve()
    if not root.is_dir():
        raise ValueError(f"data_dir: {str(data_dir)!r} is not a directory")
    return root


def resolve_data_file(data_dir: str | os.PathLike, name: str) -> Path:
    """The real path of ``name`` inside ``data_dir`` (symlinks resolved).

    Raises ``ValueError`` with one and the same message whether the file is missing,
    not a regular file, or resolves outside ``data_dir`` (``..``, an absolute name, a
    symlink out), so a caller cannot probe the server's filesystem with it.
    """
    root = _root(data_dir)
    if not isinstance(name, str):
        raise TypeError(f"name: must be a str, got {type(name).__name__}")
    refused = ValueError(f"name: no data file {name!r} in the data directory")
    if not name or "\x00" in name:
        raise refused
    try:
        real = (root / name).resolve()
    except (OSError, RuntimeError):  # e.g. a symlink loop
        raise refused from None
    if not real.is_relative_to(root) or not real.is_file():
        raise refused
    return real


def list_data_files(data_dir: str | os.PathLike) -> list[str]:
    """Sorted relative names (``/``-separated) of the files under ``data_dir`` that
    :func:`load_arrays` takes: ``.npz``, ``.csv`` and IDX images (``*images-idx3-ubyte[.gz]``,
    whose labels file is found beside them, so labels files are not listed).

    Only files that :func:`resolve_data_file` accepts are listed (symlinks leading
    out are left out); symlinked folders are not descended; hidden entries are
    skipped; at most ``MAX_LISTED`` names.
    """
    root = _root(data_dir)
    names: list[str] = []
    for top, dirs, files in os.walk(root):
        dirs[:] = sorted(d for d in dirs if not d.startswith("."))
        for f in sorted(files):
            if f.startswith(".") or not _is_loadable_name(f):
                continue
            rel = Path(top, f).relative_to(root).as_posix()
            try:
                resolve_data_file(root, rel)
            except ValueError:
                continue
            names.append(rel)
            if len(names) >= MAX_LISTED:
                return sorted(names)
    return sorted(names)


def _safe_name(filename: str) -> str:
    if not isinstance(filename, str):
        raise TypeError(f"filename: must be a str, got {type(filename).__name__}")
    base = re.split(r"[\\/]", filename)[-1]
    base = _SAFE_CHARS.sub("_", base).lstrip("._")
    if not _is_data_name(base):
        raise ValueError(f"filename: must end in .npz or .csv, or be an IDX file (*-idx1-ubyte, "
                         f"*-idx3-ubyte, optionally .gz); got {filename!r}")
    if len(base) > _MAX_NAME:
        raise ValueError(f"filename: at most {_MAX_NAME} characters, got {len(base)}")
    return base


def _free_name(dest: Path, base: str) -> Path:
    """``base`` in ``dest``, or with ``-1``, ``-2``, ... before its extension if taken.

    IDX names keep their ``images-idx3-ubyte[.gz]`` tail whole (``train-1-images-idx3-ubyte.gz``)
    so an images file still finds its labels.
    """
    idx = re.search(r"[-_.]?(?:(?:images|labels)-)?idx[1-4]-ubyte(?:\.gz)?$", base, re.IGNORECASE)
    stem, ext = (base[:idx.start()], base[idx.start():]) if idx else os.path.splitext(base)
    cand, i = dest / base, 1
    while cand.exists() or cand.is_symlink():
        cand = dest / (f"{stem}-{i}{ext}" if stem else f"{i}-{ext}")
        i += 1
    return cand


def save_upload(filename: str, content: bytes, dest_dir: str | os.PathLike) -> Path:
    """Keep an uploaded file in ``dest_dir`` after checking it; returns its path.

    Checks, in order, before anything is written: ``content`` is bytes of at most
    ``MAX_UPLOAD_BYTES``; ``filename`` (only its last path component is used,
    characters outside ``A-Za-z0-9._-`` become ``_``) has a whitelisted extension.
    Then the bytes go to a hidden temporary file in ``dest_dir`` and are loaded as
    the page would load them (``.npz``/``.csv`` with :func:`load_arrays` as a
    classification set; IDX with :func:`read_idx`) under the limits; only if that
    succeeds is the file renamed to its final name (``name-1.ext`` etc. if taken).
    Errors are ``ValueError``s naming the file, never quoting its content.
    """
    if not isinstance(content, (bytes, bytearray, memoryview)):
        raise TypeError(f"content: must be bytes, got {type(content).__name__}")
    if len(content) > MAX_UPLOAD_BYTES:
        raise ValueError(f"content: upload is {len(content) / 2**20:.1f} MB, above the limit of "
                         f"{MAX_UPLOAD_BYTES / 2**20:.0f} MB")
    base = _safe_name(filename)
    dest = _root(dest_dir)
    idx = IDX_NAME.search(base)
    suffix = base[idx.start():] if idx else Path(base).suffix
    fd, tmp = tempfile.mkstemp(dir=dest, prefix=".upload-", suffix=suffix)
    try:
        with os.fdopen(fd, "wb") as f:
            f.write(content)
        tmp_path = Path(tmp)
        if idx:
            read_idx(tmp_path)
        else:
            try:
                load_arrays(tmp_path)
            except FileNotFoundError:
                raise ValueError(f"{base}: could not be read back") from None
        final = _free_name(dest, base)
        os.replace(tmp_path, final)
        return final
    except ValueError as e:
        raise ValueError(str(e).replace(Path(tmp).name, base)) from None
    finally:
        if os.path.exists(tmp):
            os.unlink(tmp)
