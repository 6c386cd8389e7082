"""MetricsLog: append/since cursors, NaN backfill of late or missing columns, last(), bounded memory by
thinning (row ids monotonic, cursors stay valid), one writer with several concurrent readers, to_csv."""
from __future__ import annotations

import csv
import io
import math
import threading
import time

import numpy as np
import pytest

from qatlab.metrics import MetricsLog


def _ids(batch) -> list[int]:
    return batch["row_id"].astype(np.int64).tolist()


# ----------------------------------------------------------------------------- construction

@pytest.mark.parametrize("capacity", [15, 0, -1, 16.0, "100", None])
def test_capacity_must_be_int_at_least_16(capacity):
    with pytest.raises(ValueError, match="capacity"):
        MetricsLog(capacity)


def test_empty_log():
    log = MetricsLog(16)
    assert len(log) == 0 and log.total_rows == 0
    batch, cursor = log.since(0)
    assert cursor == 0 and list(batch) == ["row_id"] and len(batch["row_id"]) == 0
    assert math.isnan(log.last("loss")) and log.last("loss", default=-1.0) == -1.0
    assert log.to_csv().strip() == "row_id"


# ----------------------------------------------------------------------------- append / since

def test_append_and_since_cursors():
    log = MetricsLog()
    for i in range(5):
        log.append({"step": i, "loss": 10.0 - i})
    batch, cursor = log.since(0)
    assert cursor == 5 and len(log) == 5 and log.total_rows == 5
    assert _ids(batch) == [0, 1, 2, 3, 4]
    np.testing.assert_array_equal(batch["step"], np.arange(5.0))
    np.testing.assert_array_equal(batch["loss"], 10.0 - np.arange(5.0))
    assert all(col.dtype == np.float64 for col in batch.values())

    empty, cursor2 = log.since(cursor)
    assert cursor2 == 5 and all(len(col) == 0 for col in empty.values())
    log.append({"step": 5, "loss": 5.0})
    log.append({"step": 6, "loss": 4.0})
    batch, cursor3 = log.since(cursor)
    assert cursor3 == 7 and _ids(batch) == [5, 6] and batch["step"].tolist() == [5.0, 6.0]
    mid, _ = log.since(3)
    assert _ids(mid) == [3, 4, 5, 6]
    assert _ids(log.since(-10)[0]) == list(range(7))
    beyond, c = log.since(100)
    assert len(beyond["row_id"]) == 0 and c == 7


def test_since_returns_copies():
    log = MetricsLog()
    log.append({"x": 1.0})
    batch, _ = log.since(0)
    batch["x"][0] = 99.0
    assert log.columns()["x"][0] == 1.0


def test_late_column_is_nan_backfilled_and_missing_values_are_nan():
    log = MetricsLog()
    log.append({"step": 0, "loss": 1.0})
    log.append({"step": 1, "loss": 0.9})
    log.append({"step": 2, "test_accuracy": 0.5})          # late column, loss missing
    log.append({"step": 3, "loss": 0.7})                   # test_accuracy missing
    cols = log.columns()
    assert log.keys == ["row_id", "step", "loss", "test_accuracy"]
    np.testing.assert_array_equal(cols["loss"], [1.0, 0.9, np.nan, 0.7])
    np.testing.assert_array_equal(cols["test_accuracy"], [np.nan, np.nan, 0.5, np.nan])
    assert all(len(c) == 4 for c in cols.values())


def test_late_column_after_buffer_growth():
    log = MetricsLog()
    for i in range(200):                                   # past the initial 64-row buffer
        log.append({"step": i})
    log.append({"step": 200, "late": 1.0})
    cols = log.columns()
    assert np.isnan(cols["late"][:200]).all() and cols["late"][200] == 1.0


def test_non_finite_values_are_kept_and_last_skips_them():
    log = MetricsLog()
    log.append({"loss": 2.0})
    log.append({"loss": np.inf})
    log.append({"loss": np.nan, "other": 1.0})
    cols = log.columns()
    assert cols["loss"][1] == np.inf and np.isnan(cols["loss"][2])
    assert log.last("loss") == 2.0             # most recent *finite* value
    assert log.last("other") == 1.0
    assert log.last("missing", default=7.0) == 7.0


def test_last_returns_most_recent_finite():
    log = MetricsLog()
    log.append({"test_accuracy": 0.5, "loss": 3.0})
    log.append({"loss": 2.0})
    log.append({"test_accuracy": 0.75, "loss": 1.0})
    log.append({"loss": 0.5})
    assert log.last("test_accuracy") == 0.75 and log.last("loss") == 0.5
    assert log.last("row_id") == 3.0


def test_numpy_scalars_and_ints_are_accepted():
    log = MetricsLog()
    log.append({"a": np.float32(0.5), "b": np.int64(3), "c": 2, "d": True})
    cols = log.columns()
    assert (cols["a"][0], cols["b"][0], cols["c"][0], cols["d"][0]) == (0.5, 3.0, 2.0, 1.0)


@pytest.mark.parametrize("bad", ["abc", None, [1.0], np.zeros(2)])
def test_non_numeric_value_raises_and_leaves_log_untouched(bad):
    log = MetricsLog()
    log.append({"a": 1.0})
    before_keys, before_cols = log.keys, log.columns()
    with pytest.raises(TypeError, match="'b'"):
        log.append({"a": 2.0, "b": bad})
    assert log.keys == before_keys and log.total_rows == 1 and len(log) == 1
    for key, col in log.columns().items():
        np.testing.assert_array_equal(col, before_cols[key])
    log.append({"a": 3.0})
    assert _ids(log.columns()) == [0, 1]                   # no row id was burnt


def test_meta_is_a_free_dict():
    log = MetricsLog()
    log.meta["config"] = {"lr": 0.1}
    assert log.meta == {"config": {"lr": 0.1}}


# ----------------------------------------------------------------------------- thinning

def _fill(log: MetricsLog, n: int, start: int = 0) -> None:
    for i in range(start, start + n):
        log.append({"step": float(i), "twice": 2.0 * i})


@pytest.mark.parametrize("capacity,n", [(16, 1000), (17, 333), (100, 5000), (64, 64), (64, 65)])
def test_thinning_bounds_rows_and_keeps_ids_monotonic_and_rows_intact(capacity, n):
    log = MetricsLog(capacity)
    _fill(log, n)
    cols = log.columns()
    ids = cols["row_id"]
    assert len(log) <= capacity and len(ids) == len(log)
    assert log.total_rows == n
    assert np.all(np.diff(ids) > 0)
    assert ids[0] == 0                                     # the first row survives every thinning
    # every column still belongs to its row (no torn rows after compaction)
    np.testing.assert_array_equal(cols["step"], ids)
    np.testing.assert_array_equal(cols["twice"], 2 * ids)
    # kept rows are evenly spaced by the current stride (a power of two) and reach the newest rows
    gaps = np.unique(np.diff(ids))
    assert len(gaps) <= 1
    stride = int(gaps[0]) if len(gaps) else 1
    assert stride & (stride - 1) == 0
    assert ids[-1] > n - 1 - stride
    assert len(log) > capacity // 2 - 1 or n <= capacity  # thinning halves, never empties


def test_memory_stays_bounded_over_a_long_run():
    log = MetricsLog(64)
    _fill(log, 2000)
    nbytes = log.nbytes
    _fill(log, 50_000, start=2000)
    assert len(log) <= 64
    assert log.nbytes == nbytes <= 64 * 3 * 8          # 3 float64 columns of at most 64 rows
    assert log.total_rows == 52_000


def test_memory_bound_with_default_capacity_buffer_doubling():
    log = MetricsLog(1000)
    _fill(log, 999)
    assert len(log) == 999 and log.nbytes <= 1000 * 3 * 8
    _fill(log, 5000, start=999)
    assert len(log) <= 1000 and log.nbytes <= 1000 * 3 * 8


def test_cursors_stay_valid_across_thinning():
    log = MetricsLog(16)
    _fill(log, 10)
    _, cursor = log.since(0)
    assert cursor == 10
    _fill(log, 100, start=10)                           # forces several thinnings
    batch, cursor2 = log.since(cursor)
    ids = _ids(batch)
    assert cursor2 == 110
    assert ids and min(ids) >= 10 and ids == sorted(set(ids))
    np.testing.assert_array_equal(batch["step"], batch["row_id"])
    assert _ids(log.since(cursor2)[0]) == []
    _fill(log, 1, start=110)
    batch, cursor3 = log.since(cursor2)
    assert cursor3 == 111 and all(i >= 110 for i in _ids(batch))


def test_late_column_after_thinning():
    log = MetricsLog(16)
    _fill(log, 50)
    for i in range(50, 58):
        log.append({"step": float(i), "twice": 2.0 * i, "late": 1.0})
    cols = log.columns()
    late, ids = cols["late"], cols["row_id"]
    assert len(late) == len(log) and (ids >= 50).any()
    np.testing.assert_array_equal(np.isnan(late), ids < 50)


def _epoch_pattern(log: MetricsLog, epochs: int, steps: int = 3) -> list[float]:
    """`steps` training rows then one epoch row (test_accuracy) per epoch; returns the accuracies."""
    accs = []
    for e in range(epochs):
        for s in range(steps):
            log.append({"step": float(e * steps + s), "loss": 1.0 / (1 + e)})
        accs.append(e / epochs)
        log.append({"step": float((e + 1) * steps), "test_accuracy": accs[-1]})
    return accs


def test_sparse_epoch_columns_survive_thinning():
    log = MetricsLog(64)
    accs = _epoch_pattern(log, epochs=500)           # epoch rows have ids 3, 7, 11, ...: all odd
    cols = log.columns()
    acc = cols["test_accuracy"]
    assert np.isfinite(acc).sum() >= 8               # the epoch curve keeps a shape ...
    assert log.last("test_accuracy") >= accs[-50]     # ... and reaches the last 10% of the run


# ----------------------------------------------------------------------------- threads

def _writer_readers(log: MetricsLog, n_rows: int, n_readers: int):
    done = threading.Event()
    seen = [[] for _ in range(n_readers)]
    batches = [0] * n_readers
    torn = []
    errors = []

    def write():
        try:
            for i in range(n_rows):
                log.append({"step": float(i), "twice": 2.0 * i})
                if i % 250 == 0:
                    time.sleep(0.0005)                       # let readers interleave mid-stream
        except Exception as e:  # pragma: no cover - reported below
            errors.append(e)
        finally:
            done.set()

    def read(k):
        try:
            cursor = 0
            while True:
                finished = done.is_set()
                batch, cursor = log.since(cursor)
                ids = batch["row_id"]
                if len(ids) and not (np.array_equal(batch["step"], ids)
                                     and np.array_equal(batch["twice"], 2 * ids)):
                    torn.append(k)
                seen[k].extend(ids.astype(np.int64).tolist())
                if not len(ids):
                    time.sleep(0.0002)
                else:
                    batches[k] += 1
                if finished and cursor == log.total_rows:
                    break
        except Exception as e:  # pragma: no cover - reported below
            errors.append(e)

    readers = [threading.Thread(target=read, args=(k,)) for k in range(n_readers)]
    for t in readers:
        t.start()
    w = threading.Thread(target=write)
    w.start()
    w.join(30)
    for t in readers:
        t.join(30)
    assert not w.is_alive() and not any(t.is_alive() for t in readers)
    assert not errors and not torn
    assert sum(batches) >= 4 * n_readers, batches        # the reads really interleaved with the writes
    return seen


def test_one_writer_many_readers_each_reader_sees_every_row_exactly_once():
    n = 8_000
    log = MetricsLog(100_000)
    seen = _writer_readers(log, n, n_readers=4)
    for ids in seen:
        assert ids == list(range(n))


def test_one_writer_many_readers_with_thinning_never_duplicates():
    n = 8_000
    log = MetricsLog(64)
    seen = _writer_readers(log, n, n_readers=3)
    final_ids = _ids(log.columns())
    for ids in seen:
        assert ids == sorted(set(ids))                   # strictly increasing: no row twice
        assert ids[0] == 0
        assert set(final_ids) <= set(ids)                 # nothing still stored was skipped ...
        assert ids[-1] == final_ids[-1]                   # ... and every reader caught up


# ----------------------------------------------------------------------------- csv

def test_to_csv_parses_back():
    log = MetricsLog()
    log.append({"step": 1, "loss": 0.1 + 0.2})
    log.append({"step": 2, "loss": np.inf, "acc": 1 / 3})
    log.append({"step": 3, "loss": -np.inf})
    log.append({"step": 4, "loss": 1e-300, "acc": np.nan})
    text = log.to_csv()
    rows = list(csv.reader(io.StringIO(text)))
    assert rows[0] == log.keys == ["row_id", "step", "loss", "acc"]
    assert len(rows) == 1 + len(log)
    cols = log.columns()
    for j, key in enumerate(rows[0]):
        parsed = np.array([float(r[j]) if r[j] != "" else np.nan for r in rows[1:]])
        np.testing.assert_array_equal(parsed, cols[key])   # exact: repr round-trips float64
    assert rows[1][3] == "" and rows[4][3] == ""             # NaN is an empty cell
    dict_rows = list(csv.DictReader(io.StringIO(text)))
    assert float(dict_rows[1]["acc"]) == 1 / 3 and dict_rows[1]["loss"] == "inf"
