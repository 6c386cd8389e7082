"""Metric rows in the store: chunks of rows that share their columns, as float64 blobs.

Every metrics row keeps all its columns (one row of a matrix, never one record per value); rows
with the same column names in the same order (a "kind": per-step rows, per-epoch rows) are
written together as one ``row_chunks`` record: ``seqs`` (int64, the rows' numbers in the run)
and ``payload`` (float64, columns x rows: each column contiguous), its column names in ``row_kinds``. A
batch of rows costs one record per kind, and reading a history decodes a few large blobs with
numpy instead of 100k small records in Python. :func:`compact` merges a finished run's chunks.
"""
from __future__ import annotations

import json
import numbers

import numpy as np

#: A compacted chunk holds at most this many rows (compacting holds about four chunks in memory).
CHUNK_ROWS = 16384
_REAL_TYPES = frozenset((int, float, bool, np.float64, np.float32, np.int64))
#: MetricsLog's own row numbering; the store numbers rows itself (``history()["row_id"]``).
ROW_ID = "row_id"


def group_rows(rows) -> list[tuple[tuple, np.ndarray, np.ndarray]]:
    """``[(column names, positions (k,), values float64 (k, columns))]`` of ``rows`` grouped by kind.

    ``rows``: a list of dicts ``{column: real number}``; a bad row raises before anything is written.
    Each kind's values are converted by numpy in one go (a run's flush must not hold the GIL long);
    only a kind numpy cannot read as numbers is checked value by value, for the error message.
    """
    if isinstance(rows, dict) or not isinstance(rows, (list, tuple)):
        raise TypeError(f"rows: expected a list of dicts, got {type(rows).__name__}")
    groups: dict[tuple, tuple[list, list]] = {}
    for i, row in enumerate(rows):
        if not isinstance(row, dict):
            raise TypeError(f"rows[{i}]: expected a dict of column -> number, got {type(row).__name__}")
        if ROW_ID in row:
            keys = tuple(k for k in row if k != ROW_ID)
            values = [row[k] for k in keys]
        else:
            keys, values = tuple(row), list(row.values())
        positions, matrix = groups.setdefault(keys, ([], []))
        positions.append(i)
        matrix.append(values)
    out = []
    for keys, (positions, matrix) in groups.items():
        for key in keys:
            if not isinstance(key, str):
                raise TypeError(f"rows[{positions[0]}]: column names must be str, got {key!r}")
        values = np.array(matrix)
        if values.dtype.kind not in "biuf":           # text, None, complex, huge ints: look closer
            values = _checked(rows, positions, keys, matrix)
        out.append((keys, np.array(positions, np.int64), values.astype(np.float64).reshape(len(positions), len(keys))))
    return out


def _checked(rows, positions, keys, matrix) -> np.ndarray:
    """``matrix`` as float64 after a value-by-value check; TypeError naming the first value that is not real."""
    for i, values in zip(positions, matrix):
        for key, value in zip(keys, values):
            if value.__class__ not in _REAL_TYPES and not isinstance(value, numbers.Real):
                raise TypeError(f"rows[{i}][{key!r}]: expected a real number, got {type(value).__name__}")
    return np.array(matrix, np.float64)


def group_columns(columns: dict) -> tuple[int, list[tuple[tuple, np.ndarray, np.ndarray]]]:
    """(row count, groups as in :func:`group_rows`) of ``{column: array (n,)}`` in MetricsLog's
    form (NaN where a row lacks a column): a row's columns are the ones not NaN there."""
    names = [k for k in columns if k != ROW_ID]
    if not names:
        return 0, []
    try:
        mat = np.column_stack([np.asarray(columns[k], np.float64).reshape(-1) for k in names])
    except (TypeError, ValueError) as exc:
        raise ValueError(f"columns: expected equal-length numeric arrays ({exc})") from exc
    present = ~np.isnan(mat)
    patterns, inverse = np.unique(np.packbits(present, axis=1), axis=0, return_inverse=True)
    groups = []
    for p in range(len(patterns)):
        pos = np.flatnonzero(inverse.reshape(-1) == p)
        cols = np.flatnonzero(present[pos[0]])
        if len(cols):
            groups.append((tuple(names[c] for c in cols), pos, mat[np.ix_(pos, cols)]))
    return len(mat), groups


def kind_id(conn, keys: tuple) -> int:
    """The ``row_kinds`` id of these column names (added when new)."""
    text = json.dumps(list(keys))
    found = conn.execute("SELECT id FROM row_kinds WHERE columns = ?", (text,)).fetchone()
    if found:
        return found[0]
    return conn.execute("INSERT INTO row_kinds (columns) VALUES (?)", (text,)).lastrowid


def insert_groups(conn, run_id: str, n: int, groups) -> int:
    """Append ``n`` rows (``groups`` from :func:`group_rows`/:func:`group_columns`) after the run's
    rows, inside the caller's transaction; returns the run's new row count. ``KeyError`` for an unknown run."""
    found = conn.execute("SELECT n_rows FROM runs WHERE id = ?", (run_id,)).fetchone()
    if found is None:
        raise KeyError(f"run_id: no run {run_id!r} in this store")
    start = found[0]
    for keys, positions, values in groups:
        seqs = positions + start
        _insert_chunk(conn, run_id, kind_id(conn, keys), seqs, values)
    conn.execute("UPDATE runs SET n_rows = ? WHERE id = ?", (start + n, run_id))
    return start + n


def insert_rows(conn, run_id: str, rows) -> int:
    """:func:`insert_groups` of a list of row dicts."""
    return insert_groups(conn, run_id, len(rows), group_rows(rows))


def _insert_chunk(conn, run_id, kind, seqs, values) -> None:
    conn.execute("INSERT INTO row_chunks (run_id, first_seq, kind, n, seqs, payload) VALUES (?,?,?,?,?,?)",
                 (run_id, int(seqs[0]), kind, len(seqs), np.ascontiguousarray(seqs, np.int64).tobytes(),
                  np.ascontiguousarray(np.asarray(values, np.float64).T).tobytes()))   # column-major


def _chunks(conn, run_id: str):
    """(row count, {kind: (column names, [seqs blobs], [payload blobs])} in order of the kinds' first rows)."""
    found = conn.execute("SELECT n_rows FROM runs WHERE id = ?", (run_id,)).fetchone()
    if found is None:
        raise KeyError(f"run_id: no run {run_id!r} in this store")
    kinds: dict[int, tuple] = {}
    for kind, seqs, payload in conn.execute(
            "SELECT kind, seqs, payload FROM row_chunks WHERE run_id = ? ORDER BY first_seq", (run_id,)):
        if kind not in kinds:
            names = conn.execute("SELECT columns FROM row_kinds WHERE id = ?", (kind,)).fetchone()[0]
            kinds[kind] = (tuple(json.loads(names)), [], [])
        kinds[kind][1].append(seqs)
        kinds[kind][2].append(payload)
    return found[0], kinds


def _decode(keys, seqs, payload) -> tuple[np.ndarray, np.ndarray]:
    """(seqs int64 (m,), values float64 (columns, m)) of one chunk (payload is column-major)."""
    s = np.frombuffer(seqs, np.int64)
    return s, np.frombuffer(payload, np.float64).reshape(len(keys), len(s))


def read(conn, run_id: str) -> dict[str, np.ndarray]:
    """``{"row_id": 0..n-1, column: float64 (n,) ...}``, columns in order of first appearance, NaN
    where a row lacks a column (the form of :meth:`qatlab.metrics.MetricsLog.columns`)."""
    n, kinds = _chunks(conn, run_id)
    names = list(dict.fromkeys(key for keys, _, _ in kinds.values() for key in keys))
    block = np.full((len(names) + 1, n), np.nan)      # one allocation; each column a contiguous row
    block[0] = np.arange(n)
    where = {name: i + 1 for i, name in enumerate(names)}
    for keys, seqs, payloads in kinds.values():
        rows_of = [where[key] for key in keys]
        for seq_blob, payload in zip(seqs, payloads):
            s, v = _decode(keys, seq_blob, payload)
            if len(s) and s[-1] - s[0] + 1 == len(s):          # consecutive rows: a slice, not a scatter
                block[rows_of, s[0]:s[-1] + 1] = v
            else:
                for r, values in zip(rows_of, v):
                    block[r, s] = values
    return {ROW_ID: block[0], **{name: block[where[name]] for name in names}}


def compact(conn, run_id: str) -> None:
    """Merge the run's chunks of each kind into chunks of up to :data:`CHUNK_ROWS` rows, reading the
    stored chunks in order and writing each merged chunk as soon as it is full, so the memory it takes
    does not grow with the run's length."""
    kinds = conn.execute("SELECT kind, COUNT(*) FROM row_chunks WHERE run_id = ? GROUP BY kind", (run_id,))
    for kind, count in kinds.fetchall():
        if count == 1:
            continue
        keys = tuple(json.loads(conn.execute("SELECT columns FROM row_kinds WHERE id = ?", (kind,)).fetchone()[0]))
        firsts = [f for (f,) in conn.execute("SELECT first_seq FROM row_chunks WHERE run_id = ? AND kind = ? "
                                             "ORDER BY first_seq", (run_id, kind))]
        seqs, values, n = [], [], 0            # rows read and not yet written: (m,) and (columns, m) parts
        for i, first in enumerate(firsts):
            blob = conn.execute("SELECT seqs, payload FROM row_chunks WHERE run_id = ? AND first_seq = ?",
                                (run_id, first)).fetchone()
            s, v = _decode(keys, *blob)
            seqs.append(s)
            values.append(v)
            n += len(s)
            last = i == len(firsts) - 1
            if n >= CHUNK_ROWS or last:
                # the stored chunks read so far go, then the merged ones take their place
                conn.execute("DELETE FROM row_chunks WHERE run_id = ? AND kind = ? AND first_seq BETWEEN ? AND ?",
                             (run_id, kind, int(seqs[0][0]), first))
                seqs, values = _write_merged(conn, run_id, kind, seqs, values, all_rows=last)
                n = sum(len(x) for x in seqs)


def _write_merged(conn, run_id, kind, seqs, values, all_rows: bool):
    """Write the parts' rows as chunks of :data:`CHUNK_ROWS` rows (and, with ``all_rows``, the rest);
    returns the rows left unwritten, as parts."""
    s, v = np.concatenate(seqs), np.concatenate(values, axis=1)
    start = 0
    while len(s) - start >= (1 if all_rows else CHUNK_ROWS):
        end = min(start + CHUNK_ROWS, len(s))
        _insert_chunk(conn, run_id, kind, s[start:end], v[:, start:end].T)
        start = end
    return ([s[start:]], [v[:, start:]]) if start < len(s) else ([], [])
