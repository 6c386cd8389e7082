"""MetricsLog: the thread-safe columnar log a run writes and views read.

A trainer thread calls :meth:`MetricsLog.append` with one row (a dict of
scalars); any number of readers call :meth:`MetricsLog.since` with their own
cursor and get only the rows they have not seen. Columns are float64 numpy
arrays grown by doubling; a column that first appears late is NaN-filled
before that row, and a row that lacks a column gets NaN there.

Memory is bounded: once ``capacity`` rows are stored, the most numerous kind of
row (rows with the same set of columns, e.g. per-step rows) keeps every other
row and from then on stores half as many, so a run of any length holds at most
``capacity`` rows while rare rows (per-epoch test metrics) are kept. Every row
keeps its global ``row_id``; cursors are row ids, so readers are never confused
by thinning.
"""
from __future__ import annotations

import csv
import io
import math
import threading

import numpy as np

DEFAULT_CAPACITY = 100_000
# The columns a training run logs, named once here (the loop writes them, the store and the views read them).
#: A step row, every ``metrics_every`` steps (and after the first).
STEP_COLUMNS = ("step", "epoch", "time", "loss", "lr", "steps_per_second", "active_grad_fraction")
#: Per-layer metrics of a step row, in row order; layer i's column is ``<metric>_<i>``.
LAYER_METRICS = ("grad_norm", "noise_mse", "sqnr_db", "saturation", "scale", "frac_neg", "frac_zero", "frac_pos")
#: Phase training's columns of a step row.
PHASE_COLUMNS = ("phase", "backward_passes", "speedup_steps", "speedup_wall", "pred_error", "pred_cosine", "pred_gain",
                 "full_len", "predict_len")
#: The row after each epoch.
EPOCH_COLUMNS = ("step", "epoch", "time", "test_loss", "test_accuracy", "train_accuracy", "train_loss")
_REAL = (int, float, np.integer, np.floating)
_REAL_TYPES = frozenset((int, float, np.float64, np.float32, np.int64))   # checked first: the common ones


class MetricsLog:
    """Columnar float64 log of metric rows, safe to append from one thread and read from many.

    Args:
        capacity: most rows kept in memory (>= 16); older rows are thinned 2:1 past it.
    """

    def __init__(self, capacity: int = DEFAULT_CAPACITY):
        if not isinstance(capacity, int) or capacity < 16:
            raise ValueError(f"capacity: must be an int >= 16, got {capacity!r}")
        self.capacity = capacity
        self.meta: dict = {}
        self._lock = threading.Lock()
        self._cols: dict[str, np.ndarray] = {"row_id": np.empty(64)}
        self._kind = np.empty(64, np.int64)   # per stored row: index of its key set ("kind")
        self._seq = np.empty(64, np.int64)    # per stored row: its number among rows of that kind
        self._kinds: dict[frozenset, int] = {}
        self._count: list[int] = []           # rows ever appended, per kind
        self._stride: list[int] = []          # store every stride-th row of a kind once thinned
        self._n = 0          # rows stored
        self._next_id = 0    # rows ever appended
        self._plans: dict[tuple, tuple] = {}   # row keys in order -> (kind, its columns, the others)

    def append(self, row: dict) -> None:
        """Append one row: ``{column_name: number}``; non-finite values are kept as given.

        A value that is not a real number raises ``TypeError`` naming its column; the log is
        left untouched (no row id used, no column created).
        """
        for key, value in row.items():
            if value.__class__ not in _REAL_TYPES and not isinstance(value, _REAL):
                raise TypeError(f"row[{key!r}]: expected a real number, got {type(value).__name__}")
        keys = tuple(row)
        with self._lock:
            plan = self._plans.get(keys) or self._plan(keys)
            kind = plan[0]
            row_id = self._next_id
            self._next_id += 1
            seq = self._count[kind]
            self._count[kind] += 1
            if seq % self._stride[kind]:
                return
            if self._n == self.capacity:
                self._thin()
                if seq % self._stride[kind]:
                    return
            if self._n == len(self._cols["row_id"]):
                self._grow()
                plan = self._plan(keys)
            n = self._n
            _, cols, others = plan
            for col, value in zip(cols, row.values()):
                col[n] = value
            for col in others:
                col[n] = np.nan
            self._cols["row_id"][n] = row_id
            self._kind[n], self._seq[n] = kind, seq
            self._n = n + 1

    def _plan(self, keys: tuple) -> tuple:
        """Where a row with these keys (in this order) goes: (its kind, its columns in key order,
        the other columns), creating missing columns (NaN-filled); cached until the columns change."""
        kind = self._kinds.setdefault(frozenset(keys), len(self._kinds))
        if kind == len(self._count):
            self._count.append(0)
            self._stride.append(1)
        size = len(self._cols["row_id"])
        if any(key not in self._cols for key in keys):
            self._plans.clear()                  # every cached plan lacks the new columns
            for key in keys:
                if key not in self._cols:
                    self._cols[key] = np.full(size, np.nan)
        wanted = set(keys)
        plan = (kind, [self._cols[key] for key in keys],
                [col for key, col in self._cols.items() if key not in wanted and key != "row_id"])
        self._plans[keys] = plan
        return plan

    def _grow(self) -> None:
        self._plans.clear()                      # the columns are new arrays
        new_size = min(2 * len(self._cols["row_id"]), self.capacity)
        for key, col in self._cols.items():
            grown = np.full(new_size, np.nan)
            grown[: self._n] = col[: self._n]
            self._cols[key] = grown
        for name in ("_kind", "_seq"):
            grown = np.zeros(new_size, np.int64)
            grown[: self._n] = getattr(self, name)[: self._n]
            setattr(self, name, grown)

    def _thin(self) -> None:
        """Keep every other row of the kind that holds the most rows (rare kinds, such as the
        per-epoch test rows, keep all their rows) and store half as many of it from now on."""
        n = self._n
        kinds = self._kind[:n]
        target = int(np.argmax(np.bincount(kinds, minlength=len(self._count))))
        stride = self._stride[target]
        keep = (kinds != target) | (self._seq[:n] % (2 * stride) == 0)
        m = int(keep.sum())
        for col in self._cols.values():
            col[:m] = col[:n][keep]
            col[m:] = np.nan
        self._kind[:m] = self._kind[:n][keep]
        self._seq[:m] = self._seq[:n][keep]
        self._n = m
        self._stride[target] = 2 * stride

    def since(self, cursor: int = 0) -> tuple[dict[str, np.ndarray], int]:
        """Rows with ``row_id >= cursor`` as ``{column: array (k,)}`` copies, and the next cursor."""
        with self._lock:
            ids = self._cols["row_id"][: self._n]
            start = int(np.searchsorted(ids, cursor))
            batch = {key: col[start: self._n].copy() for key, col in self._cols.items()}
            return batch, self._next_id

    def columns(self) -> dict[str, np.ndarray]:
        """All stored rows, ``{column: array (n,)}`` (copies)."""
        return self.since(0)[0]

    def last(self, key: str, default: float = math.nan) -> float:
        """Most recent finite value of column ``key`` (``default`` if none)."""
        with self._lock:
            col = self._cols.get(key)
            if col is None:
                return default
            finite = np.flatnonzero(np.isfinite(col[: self._n]))
            return float(col[finite[-1]]) if len(finite) else default

    @property
    def keys(self) -> list[str]:
        """Column names, in order of first appearance."""
        with self._lock:
            return list(self._cols)

    def __len__(self) -> int:
        return self._n

    @property
    def total_rows(self) -> int:
        """Rows ever appended (stored or thinned away)."""
        return self._next_id

    @property
    def nbytes(self) -> int:
        """Bytes held by the column buffers."""
        return sum(col.nbytes for col in self._cols.values())

    def to_csv(self) -> str:
        """All stored rows as CSV text (header = column names)."""
        cols = self.columns()
        out = io.StringIO()
        writer = csv.writer(out)
        writer.writerow(list(cols))
        for values in zip(*cols.values()):
            writer.writerow(["" if math.isnan(v) else repr(float(v)) for v in values])
        return out.getvalue()
