"""RunStore: runs, rows and models in SQLite; schema version and migration; refused files (newer,
foreign, not SQLite, corrupt); a locked file; two writer processes; interrupted runs; record()."""
from __future__ import annotations

import datetime as dt
import json
import multiprocessing
import os
import signal
import socket
import sqlite3
import subprocess
import sys
import textwrap
import threading
import time

import numpy as np
import pytest

import qatlab as ql
from qatlab.metrics import MetricsLog
from qatlab.runs import RunResult
from qatlab.store import (APP_ID, SCHEMA_VERSION, STATUSES, RunStore, StoreCorruptError, StoreLockedError,
                          record, when_unlocked)
from qatlab.store import artifacts
from qatlab.train.build import build_model

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def tiny(weights="ternary", **quant) -> ql.ExperimentConfig:
    return ql.ExperimentConfig(
        data=ql.DataConfig(dataset="synthetic", n_samples=200, n_features=16, n_classes=3, seed=1),
        model=ql.ModelConfig(hidden=[16]), quant=ql.QuantConfig(weights=weights, **quant),
        optim=ql.OptimConfig(epochs=2, batch_size=32, lr=0.05), metrics_every=1)


@pytest.fixture
def store(tmp_path):
    s = RunStore(tmp_path / "runs.sqlite")
    yield s
    s.close()


def mixed_rows(n: int, seed: int = 0) -> list[dict]:
    """Per-step rows, with a per-epoch row of other columns every 7th and a late new column."""
    rng = np.random.default_rng(seed)
    rows = []
    for i in range(n):
        if i % 7 == 6:
            rows.append({"step": i, "epoch": i / 7, "test_loss": float(rng.random()), "test_accuracy": 0.5})
        else:
            row = {"step": i, "loss": float(rng.random()), "lr": 0.01, "grad_norm_0": float(rng.random())}
            if i > n // 2:
                row["late"] = float(i)
            rows.append(row)
    return rows


def test_path_defaults_to_env_then_xdg(tmp_path, monkeypatch):
    monkeypatch.setenv("QATLAB_STORE", str(tmp_path / "env" / "s.sqlite"))
    assert RunStore().path == str(tmp_path / "env" / "s.sqlite")
    monkeypatch.delenv("QATLAB_STORE")
    monkeypatch.setenv("XDG_DATA_HOME", str(tmp_path / "xdg"))
    s = RunStore()
    assert s.path == str(tmp_path / "xdg" / "qatlab" / "runs.sqlite") and os.path.exists(s.path)


def test_file_has_app_id_version_and_wal(store):
    conn = sqlite3.connect(store.path)
    assert conn.execute("PRAGMA application_id").fetchone()[0] == APP_ID
    assert conn.execute("PRAGMA user_version").fetchone()[0] == SCHEMA_VERSION
    assert conn.execute("PRAGMA journal_mode").fetchone()[0] == "wal"


def test_create_and_get(store):
    cfg = tiny()
    rid = store.create_run(cfg, name="first", sweep_id="sw1", point={"quant.ste": "tanh"}, owner="page-7")
    r = store.get(rid)
    assert len(rid) == 32 and int(rid, 16) >= 0
    assert (r.name, r.status, r.sweep_id, r.point, r.notes, r.final, r.n_rows) == \
        ("first", "created", "sw1", {"quant.ste": "tanh"}, "", {}, 0)
    assert r.config.to_dict() == cfg.to_dict()
    assert r.created.tzinfo is dt.timezone.utc and abs(r.created.timestamp() - time.time()) < 60
    assert r.started is None and r.ended is None
    assert r.owner["host"] == socket.gethostname() and r.owner["pid"] == os.getpid() and r.owner["page"] == "page-7"
    assert r.provenance["numpy"] == np.__version__ and r.provenance["cpu"]
    assert store.create_run(cfg) != rid


def test_a_record_parses_its_config_only_when_asked(store):
    rid = store.create_run(tiny())
    conn = sqlite3.connect(store.path)
    stored = json.loads(conn.execute("SELECT config FROM runs WHERE id = ?", (rid,)).fetchone()[0])
    stored["quant"]["weight_bits"] = 99              # a value this qatlab no longer accepts
    with conn:
        conn.execute("UPDATE runs SET config = ? WHERE id = ?", (json.dumps(stored), rid))
    conn.close()
    record = store.runs()[0]
    assert "config" not in vars(record)              # listing runs parses no config
    assert record.config is None and record.config_dict["quant"]["weight_bits"] == 99


def test_create_refuses_bad_input(store):
    with pytest.raises(TypeError, match="config"):
        store.create_run("digits")
    with pytest.raises(ValueError, match="unknown field"):
        store.create_run({"nope": 1})
    with pytest.raises(TypeError, match="point"):
        store.create_run(tiny(), point=[1])
    assert store.runs() == []


def test_status_validated_and_times_stamped(store):
    rid = store.create_run(tiny())
    with pytest.raises(ValueError, match="status: expected one of"):
        store.set_status(rid, "done")
    store.set_status(rid, "running")
    started = store.get(rid).started
    assert started is not None and store.get(rid).ended is None
    store.set_status(rid, "paused")
    store.set_status(rid, "running")
    assert store.get(rid).started == started
    store.set_status(rid, "stopped", "by request")
    r = store.get(rid)
    assert (r.status, r.message) == ("stopped", "by request") and r.ended >= started
    with pytest.raises(KeyError, match="no run"):
        store.set_status("0" * 32, "running")
    assert set(STATUSES) == {"created", "running", "paused", "finished", "stopped", "diverged", "failed",
                             "interrupted", "pruned"}


def test_history_equals_metricslog_columns(store):
    rows = mixed_rows(500)
    log = MetricsLog()
    for row in rows:
        log.append(row)
    rid = store.create_run(tiny())
    for start in range(0, len(rows), 37):          # several batches, as a live run flushes them
        store.append_rows(rid, rows[start:start + 37])
    expected, got = log.columns(), store.history(rid)
    assert list(got) == list(expected)
    for key in expected:
        np.testing.assert_array_equal(got[key], expected[key], err_msg=key)
        assert got[key].dtype == np.float64
    store.finish(rid, RunResult(history={}, final={"test_accuracy": 0.5}))    # compacts its chunks
    for key, col in store.history(rid).items():
        np.testing.assert_array_equal(col, expected[key], err_msg=key)
    assert store.get(rid).n_rows == 500


def test_append_columns_roundtrip(store):
    log = MetricsLog()
    for row in mixed_rows(100, seed=3):
        log.append(row)
    rid = store.create_run(tiny())
    assert store.append_columns(rid, log.columns()) == 100
    for key, col in store.history(rid).items():
        np.testing.assert_array_equal(col, log.columns()[key], err_msg=key)


def test_bad_row_writes_nothing(store):
    rid = store.create_run(tiny())
    store.append_rows(rid, [{"step": 1, "loss": 0.5}])
    with pytest.raises(TypeError, match=r"rows\[1\]\['loss'\]: expected a real number"):
        store.append_rows(rid, [{"step": 2, "loss": 0.4}, {"step": 3, "loss": "x"}])
    with pytest.raises(TypeError, match="rows: expected a list"):
        store.append_rows(rid, {"step": 2})
    with pytest.raises(KeyError):
        store.append_rows("f" * 32, [{"step": 1}])
    assert store.get(rid).n_rows == 1 and list(store.history(rid)["step"]) == [1.0]


def test_rename_notes_delete(store):
    a, b = store.create_run(tiny(), name="a"), store.create_run(tiny(), name="b")
    store.append_rows(a, mixed_rows(20))
    store.finish(a, RunResult(history={}, final={}, model=build_model(tiny(), 16, 3)))
    store.rename(a, "renamed")
    store.set_notes(a, "lr too high")
    assert (store.get(a).name, store.get(a).notes) == ("renamed", "lr too high")
    with pytest.raises(ValueError, match="name"):
        store.rename(a, " ")
    store.delete(a)
    with pytest.raises(KeyError):
        store.get(a)
    with pytest.raises(KeyError):
        store.delete(a)
    assert [r.id for r in store.runs()] == [b]
    conn = sqlite3.connect(store.path)
    for table in ("row_chunks", "artifacts"):
        assert conn.execute(f"SELECT count(*) FROM {table} WHERE run_id = ?", (a,)).fetchone()[0] == 0


def test_a_running_run_cannot_be_deleted(store):
    rid = store.create_run(tiny())
    for status in ("running", "paused"):
        store.set_status(rid, status)
        with pytest.raises(ValueError, match=f"is {status}; stop it first"):
            store.delete(rid)
        assert store.get(rid).status == status
    store.set_status(rid, "stopped")
    store.delete(rid)
    assert store.runs() == []


@pytest.mark.parametrize("name", ["<img src=x onerror=alert(1)>", "line1\nline2", "x" * 81, "   ", "a\x00b"])
def test_names_are_checked_where_runs_are_made_and_renamed(store, name):
    with pytest.raises(ValueError, match="name: expected 1 to 80 printable"):
        store.create_run(tiny(), name=name)
    rid = store.create_run(tiny(), name="  fine  ")
    assert store.get(rid).name == "fine"
    with pytest.raises(ValueError, match="name: expected 1 to 80 printable"):
        store.rename(rid, name)
    assert store.get(rid).name == "fine"


def test_a_damaged_record_does_not_hide_the_others(store):
    good, bad = store.create_run(tiny(), name="good"), store.create_run(tiny(), name="bad")
    store.append_rows(good, mixed_rows(5))
    conn = sqlite3.connect(store.path, isolation_level=None)
    conn.execute("UPDATE runs SET config = '{not json', final = '[1', point = 'x', provenance = '' WHERE id = ?",
                 (bad,))
    records = {r.name: r for r in store.runs()}
    assert set(records) == {"good", "bad"} and records["good"].config is not None
    assert (records["bad"].config, records["bad"].final, records["bad"].point) == (None, {}, None)
    conn.execute("UPDATE row_chunks SET payload = x'0001' WHERE run_id = ?", (good,))
    with pytest.raises(StoreCorruptError, match=f"run '{good}': its stored rows are damaged"):
        store.history(good)


def test_a_damaged_model_is_a_store_error(store):
    rid = store.create_run(tiny())
    store.finish(rid, RunResult(history={}, final={}, model=build_model(tiny(), 16, 3)))
    sqlite3.connect(store.path, isolation_level=None).execute(
        "UPDATE artifacts SET data = x'504b0304' WHERE run_id = ?", (rid,))
    with pytest.raises(StoreCorruptError, match="its stored model is damaged"):
        store.load_model(rid)


@pytest.mark.skipif(not os.path.isdir("/sys/kernel"), reason="needs a directory no one can create files in (Linux /sys)")
def test_a_store_in_a_directory_it_cannot_write_is_a_clear_error():
    with pytest.raises(ValueError, match="cannot open the run store for writing"):
        RunStore("/sys/kernel/qatlab-test-runs.sqlite")


def test_when_unlocked_waits_for_the_lock_then_gives_up(tmp_path):
    path = tmp_path / "s.sqlite"
    s = RunStore(path, timeout=0.2)
    other = sqlite3.connect(path, isolation_level=None, check_same_thread=False)
    other.execute("BEGIN EXCLUSIVE")
    with pytest.raises(StoreLockedError):
        when_unlocked(lambda: s.create_run(tiny()), seconds=0.5)
    threading.Timer(0.6, lambda: other.execute("ROLLBACK")).start()
    rid = when_unlocked(lambda: s.create_run(tiny()), seconds=10)
    assert [r.id for r in s.runs()] == [rid]


def test_runs_filters(store):
    a = store.create_run(tiny(), sweep_id="s")
    b = store.create_run(tiny(), sweep_id="s")
    c = store.create_run(tiny())
    store.set_status(b, "failed", "boom")
    assert [r.id for r in store.runs()] == [a, b, c]
    assert [r.id for r in store.runs(status="failed")] == [b]
    assert [r.id for r in store.runs(status=["created", "failed"], sweep_id="s")] == [a, b]
    with pytest.raises(ValueError, match="status"):
        store.runs(status="bogus")
    assert store.find(a[:10]) == a


# ----------------------------------------------------------------------------- models

def trained_like(cfg: ql.ExperimentConfig):
    """A model of ``cfg`` whose parameters and quantizer state moved away from their initial values."""
    model = build_model(cfg, 16, 3)
    rng = np.random.default_rng(5)
    model.flat_params()[:] += rng.standard_normal(model.num_params).astype(np.float32) * 0.1
    model.forward(rng.standard_normal((8, 16)).astype(np.float32), model.scratch(8))   # observers see data
    return model


@pytest.mark.parametrize("quant", [dict(weights="ternary"), dict(weights="float"),
                                   dict(weights="fake", weight_bits=3, activations="fake"),
                                   dict(weights="fake", scale_mode="lsq", per_channel=True, symmetric=False)])
def test_model_roundtrip(store, quant):
    cfg = tiny(**quant)
    model = trained_like(cfg)
    rid = store.create_run(cfg)
    store.finish(rid, RunResult(history={}, final={}, model=model))
    loaded = store.load_model(rid)
    assert loaded is not model
    np.testing.assert_array_equal(loaded.flat_params(), model.flat_params())
    x = np.random.default_rng(9).standard_normal((5, 16)).astype(np.float32)
    np.testing.assert_array_equal(loaded.forward(x, loaded.scratch(5)), model.forward(x, model.scratch(5)))


@pytest.mark.parametrize("weights", ["ternary", "fake"])
def test_cnn_model_roundtrip(store, weights):
    cfg = ql.ExperimentConfig()
    cfg.data.dataset = "digits"
    cfg.model.architecture, cfg.model.conv_channels, cfg.model.kernel_size, cfg.model.pool = "cnn", [3], 3, 2
    cfg.model.hidden = [5]
    cfg.quant.weights = weights
    model = build_model(cfg, 64, 10, (1, 8, 8))
    rng = np.random.default_rng(5)
    model.flat_params()[:] += rng.standard_normal(model.num_params).astype(np.float32) * 0.1
    x = rng.standard_normal((4, 64)).astype(np.float32)
    expected = model.forward(x, model.scratch(4)).copy()
    rid = store.create_run(cfg)
    store.finish(rid, RunResult(history={}, final={}, model=model))
    loaded = store.load_model(rid)
    assert type(loaded) is type(model) and loaded.image_shape == model.image_shape
    np.testing.assert_array_equal(loaded.flat_params(), model.flat_params())
    np.testing.assert_array_equal(loaded.forward(x, loaded.scratch(4)), expected)


def test_ternary_model_keeps_packed_trits(store):
    from qatlab.nn.ternary_mlp import unpack_trits
    model = trained_like(tiny())
    files = np.load(__import__("io").BytesIO(artifacts.model_to_npz(model, tiny().to_dict())))
    trits, alpha = ql.ternary_quantize(model.weights(0))
    np.testing.assert_array_equal(unpack_trits(files["w0_trits"], trits.shape), trits)
    assert float(files["w0_alpha"]) == np.float32(alpha)


def test_load_model_without_one(store):
    rid = store.create_run(tiny())
    with pytest.raises(KeyError, match="no stored model"):
        store.load_model(rid)


def test_listing_is_raw_rows_newest_first_with_whether_a_model_is_stored(store):
    first, second = store.create_run(tiny(), name="a"), store.create_run(tiny(), name="b")
    store.finish(first, RunResult(history={}, final={"test_accuracy": 0.5}, model=trained_like(tiny())))
    rows = store.listing()
    columns = [*RunStore.LISTING_COLUMNS, "has_model"]
    by_name = {r[columns.index("name")]: dict(zip(columns, r)) for r in rows}
    assert [r[0] for r in rows] == [second, first]
    assert by_name["a"]["has_model"] == 1 and by_name["b"]["has_model"] == 0
    assert json.loads(by_name["a"]["final"]) == {"test_accuracy": 0.5} and by_name["a"]["status"] == "finished"
    assert json.loads(by_name["b"]["config"]) == tiny().to_dict()


def test_finish_needs_an_ended_status(store):
    rid = store.create_run(tiny())
    with pytest.raises(ValueError, match="result.status"):
        store.finish(rid, RunResult(history={}, final={}, status="running"))


# ----------------------------------------------------------------------------- files

def test_migrates_v0_file(tmp_path):
    path = tmp_path / "old.sqlite"
    conn = sqlite3.connect(path)
    conn.executescript(f"""
        CREATE TABLE runs (id TEXT PRIMARY KEY, name TEXT, status TEXT, config TEXT, created REAL, started REAL,
                           ended REAL, message TEXT, owner TEXT, final TEXT);
        CREATE TABLE metric_rows (run_id TEXT, seq INTEGER, row TEXT);
        CREATE TABLE artifacts (run_id TEXT, name TEXT, data BLOB);
        PRAGMA application_id = {APP_ID};""")
    cfg = json.dumps(tiny().to_dict())
    conn.execute("INSERT INTO runs VALUES (?,?,?,?,?,?,?,?,?,?)",
                 ("a" * 32, "old run", "finished", cfg, 1.7e9, 1.7e9 + 1, 1.7e9 + 9, "", 
                  json.dumps({"host": "h", "pid": 12, "page": "p"}), json.dumps({"test_accuracy": 0.75})))
    rows = mixed_rows(30)
    conn.executemany("INSERT INTO metric_rows VALUES (?,?,?)", [("a" * 32, i, json.dumps(r)) for i, r in enumerate(rows)])
    conn.execute("INSERT INTO artifacts VALUES (?,?,?)", ("a" * 32, "model", artifacts.model_to_npz(
        trained_like(tiny()), tiny().to_dict())))
    conn.commit()
    conn.close()

    s = RunStore(path)
    (r,) = s.runs()
    assert (r.id, r.name, r.status, r.final, r.owner["host"], r.owner["page"], r.n_rows) == \
        ("a" * 32, "old run", "finished", {"test_accuracy": 0.75}, "h", "p", 30)
    assert r.created == dt.datetime.fromtimestamp(1.7e9, dt.timezone.utc)
    log = MetricsLog()
    for row in rows:
        log.append(row)
    for key, col in s.history(r.id).items():
        np.testing.assert_array_equal(col, log.columns()[key], err_msg=key)
    s.load_model(r.id)
    conn = sqlite3.connect(path)
    assert conn.execute("PRAGMA user_version").fetchone()[0] == SCHEMA_VERSION
    assert conn.execute("SELECT count(*) FROM sqlite_master WHERE name = 'metric_rows'").fetchone()[0] == 0


def test_newer_schema_refused(tmp_path):
    RunStore(tmp_path / "s.sqlite").close()
    conn = sqlite3.connect(tmp_path / "s.sqlite")
    conn.execute(f"PRAGMA user_version = {SCHEMA_VERSION + 1}")
    conn.close()
    with pytest.raises(ValueError, match="newer qatlab"):
        RunStore(tmp_path / "s.sqlite")


def test_foreign_sqlite_refused(tmp_path):
    conn = sqlite3.connect(tmp_path / "other.sqlite")
    conn.execute("CREATE TABLE t (x)")
    conn.commit()
    conn.close()
    with pytest.raises(ValueError, match="another application"):
        RunStore(tmp_path / "other.sqlite")


def test_non_sqlite_file_refused(tmp_path):
    (tmp_path / "notes.txt").write_text("hello, not a database\n" * 100)
    with pytest.raises(ValueError, match="not an SQLite file"):
        RunStore(tmp_path / "notes.txt")
    with pytest.raises(ValueError, match="is a directory"):
        RunStore(tmp_path)


def test_corrupt_file_refused(tmp_path):
    path = tmp_path / "s.sqlite"
    with RunStore(path) as s:
        for _ in range(3):
            s.append_rows(s.create_run(tiny()), mixed_rows(2000))
    clean = path.read_bytes()
    page = int.from_bytes(clean[16:18], "big")
    noise = np.random.default_rng(0).integers(0, 256, len(clean), dtype=np.uint8).tobytes()
    # garbage after the 100-byte file header (the schema page), then only in the pages after the first
    for start in (100, page):
        path.write_bytes(clean[:start] + noise[start:])
        with pytest.raises(StoreCorruptError, match="corrupt"):
            s = RunStore(path)
            s.runs()
            for r in s.runs():
                s.history(r.id)


def test_locked_file_is_a_clear_error_within_the_timeout(tmp_path):
    path = tmp_path / "s.sqlite"
    s = RunStore(path, timeout=0.5)
    other = sqlite3.connect(path, isolation_level=None)
    other.execute("BEGIN EXCLUSIVE")
    try:
        t0 = time.monotonic()
        with pytest.raises(StoreLockedError, match="locked by another connection"):
            s.create_run(tiny())
        waited = time.monotonic() - t0
        assert 0.4 <= waited < 3.0
        assert s.runs() == []                 # readers do not wait for the writer (WAL)
    finally:
        other.execute("ROLLBACK")
    s.create_run(tiny())
    with pytest.raises(ValueError, match="timeout"):
        RunStore(path, timeout=-1)


# ----------------------------------------------------------------------------- processes

def test_a_stores_id_version_and_tables_are_read_in_one_statement(tmp_path):
    """One statement is one snapshot: read apart, a process could see another's new schema half
    (no application id yet, tables already there) and refuse the store as foreign."""
    from qatlab.store import schema
    RunStore(str(tmp_path / "s.sqlite")).create_run(tiny())
    conn = sqlite3.connect(str(tmp_path / "s.sqlite"))
    statements = []
    conn.set_trace_callback(statements.append)
    assert schema._version(conn) == (APP_ID, SCHEMA_VERSION, conn.execute(
        "SELECT count(*) FROM sqlite_master").fetchone()[0])
    top_level = [st for st in statements if not st.startswith("--")]   # ("--": SQLite's own, nested)
    assert len(top_level) == 2      # _version's one, and the count above
    conn.close()


def _writer(path: str, shared: str, tag: int, batches: int, ready, go) -> None:
    s = RunStore(path, timeout=20)
    own = s.create_run(tiny(), name=f"writer {tag}")
    ready.set()
    go.wait(30)
    for b in range(batches):
        rows = [{"step": b * 10 + i, "writer": tag, "loss": 0.1} for i in range(10)]
        s.append_rows(own, rows)
        s.append_rows(shared, rows)


def _opener(path: str, go) -> None:
    go.wait(30)
    RunStore(path, timeout=20).create_run(tiny())


@pytest.mark.slow
def test_processes_opening_a_new_store_at_once_all_get_it_in_wal(tmp_path):
    ctx = multiprocessing.get_context("spawn")
    for attempt in range(3):
        path, go = str(tmp_path / f"new{attempt}.sqlite"), ctx.Event()
        procs = [ctx.Process(target=_opener, args=(path, go)) for _ in range(3)]
        for p in procs:
            p.start()
        go.set()
        for p in procs:
            p.join(120)
        assert [p.exitcode for p in procs] == [0, 0, 0]
        conn = sqlite3.connect(path)
        assert conn.execute("PRAGMA journal_mode").fetchone()[0] == "wal"
        assert conn.execute("PRAGMA page_size").fetchone()[0] == 16384
        conn.close()
        assert len(RunStore(path).runs()) == 3


@pytest.mark.slow
def test_two_writer_processes_lose_no_rows(tmp_path):
    path = str(tmp_path / "s.sqlite")
    s = RunStore(path)
    shared = s.create_run(tiny(), name="shared")
    ctx = multiprocessing.get_context("spawn")
    go = ctx.Event()
    readies = [ctx.Event(), ctx.Event()]
    procs = [ctx.Process(target=_writer, args=(path, shared, tag, 150, readies[tag], go)) for tag in (0, 1)]
    for p in procs:
        p.start()
    for ready in readies:
        assert ready.wait(120)
    go.set()
    for p in procs:
        p.join(120)
        assert p.exitcode == 0
    own = {r.name: r.id for r in s.runs()}
    for tag in (0, 1):
        h = s.history(own[f"writer {tag}"])
        np.testing.assert_array_equal(h["step"], np.arange(1500))
        assert np.all(h["writer"] == tag)
    h = s.history(shared)
    assert len(h["step"]) == 3000
    for tag in (0, 1):          # each writer's rows arrive whole and in its order
        np.testing.assert_array_equal(h["step"][h["writer"] == tag], np.arange(1500))


_OWNER_SCRIPT = textwrap.dedent("""
    import sys, time
    import qatlab as ql
    from qatlab.store import RunStore
    s = RunStore(sys.argv[1])
    cfg = ql.ExperimentConfig()
    rid = s.create_run(cfg, name="owned")
    s.set_status(rid, "running")
    s.append_rows(rid, [{"step": i, "loss": 1.0 / (i + 1)} for i in range(25)])
    print(rid, flush=True)
    time.sleep(600)
""")


def _start_owner(path: str):
    proc = subprocess.Popen([sys.executable, "-c", _OWNER_SCRIPT, path], stdout=subprocess.PIPE, text=True, cwd=ROOT)
    return proc, proc.stdout.readline().strip()


@pytest.mark.slow
def test_killed_owner_marks_interrupted_but_a_live_one_does_not(tmp_path):
    path = str(tmp_path / "s.sqlite")
    dead, dead_id = _start_owner(path)
    live, live_id = _start_owner(path)
    try:
        assert len(dead_id) == 32 and len(live_id) == 32
        os.kill(dead.pid, signal.SIGKILL)
        dead.wait(30)
        s = RunStore(path)                     # opening marks runs whose owner died
        r = s.get(dead_id)
        assert r.status == "interrupted" and str(dead.pid) in r.message and r.ended is not None
        np.testing.assert_array_equal(s.history(dead_id)["step"], np.arange(25))
        assert s.get(live_id).status == "running"
        assert s.mark_interrupted() == []
    finally:
        live.kill()
        live.wait(30)
    assert RunStore(path).get(live_id).status == "interrupted"


def test_other_host_runs_go_by_heartbeat(store):
    rid = store.create_run(tiny(), owner={"host": "elsewhere.example", "pid": os.getpid()})
    store.set_status(rid, "running")
    assert store.mark_interrupted(stale_after=60) == []
    store.heartbeat([rid])
    with sqlite3.connect(store.path) as conn:
        conn.execute("UPDATE runs SET heartbeat = heartbeat - 120 WHERE id = ?", (rid,))
    assert store.mark_interrupted(stale_after=60) == [rid]
    r = store.get(rid)
    assert r.status == "interrupted" and "no heartbeat" in r.message and "elsewhere.example" in r.message


def test_owner_liveness_callback(store):
    rid = store.create_run(tiny())
    store.set_status(rid, "running")
    assert store.mark_interrupted(owner_is_alive=lambda owner: True) == []
    seen = []
    assert store.mark_interrupted(owner_is_alive=lambda owner: seen.append(owner) or False) == [rid]
    assert seen[0]["pid"] == os.getpid()
    with pytest.raises(TypeError, match="owner_is_alive"):
        store.mark_interrupted(owner_is_alive=3)


# ----------------------------------------------------------------------------- speed, record()

@pytest.mark.slow   # a speed test: writes 100k rows, then holds reads to a wall-clock bound
def test_history_of_100k_rows_reads_fast(store):
    rid = store.create_run(tiny())
    n, batch = 100_000, 500          # a live run flushing 500 rows at a time
    cols = [f"c{j}" for j in range(20)]
    for start in range(0, n, batch):
        rows = [{"step": i, **dict.fromkeys(cols, 0.5)} if i % 50 else
                {"step": i, "test_loss": 1.0, "test_accuracy": 0.5} for i in range(start, start + batch)]
        store.append_rows(rid, rows)
    timings = {}
    for label in ("live chunks", "compacted"):
        best = min(_timed(store.history, rid) for _ in range(3))
        timings[label] = best
        if label == "live chunks":
            store.finish(rid, RunResult(history={}, final={}))
    print(f"\nhistory(100k rows x 23 columns): " + ", ".join(f"{k} {v * 1e3:.1f} ms" for k, v in timings.items()))
    h = store.history(rid)
    assert len(h["step"]) == n and np.array_equal(h["step"], np.arange(n))
    assert np.isnan(h["c0"][::50]).all() and (h["c0"][1::50] == 0.5).all()
    assert max(timings.values()) < 0.5


def _timed(fn, *args) -> float:
    t0 = time.perf_counter()
    fn(*args)
    return time.perf_counter() - t0


@pytest.mark.slow
def test_record_a_real_run(store):
    cfg = tiny(weights="fake", weight_bits=4, activations="fake")
    res = ql.run_experiment(cfg)
    assert res.status == "finished"
    rid = record(res, store, name="notebook run")
    r = store.get(rid)
    assert (r.name, r.status, r.final["test_accuracy"]) == ("notebook run", "finished", res.final["test_accuracy"])
    assert r.ended - r.started == dt.timedelta(seconds=res.final["seconds"]) or \
        abs((r.ended - r.started).total_seconds() - res.final["seconds"]) < 1e-3
    h = store.history(rid)
    for key, col in res.history.items():
        np.testing.assert_array_equal(h[key], col, err_msg=key)
    model = store.load_model(rid)
    x = np.random.default_rng(1).standard_normal((4, 16)).astype(np.float32)
    np.testing.assert_array_equal(model.forward(x, model.scratch(4)), res.model.forward(x, res.model.scratch(4)))


def _append_in_child(store: RunStore, rid: str) -> None:
    store.append_rows(rid, [{"step": 100 + i} for i in range(5)])


@pytest.mark.skipif(sys.platform != "linux", reason="fork")
def test_a_forked_child_opens_its_own_connection(store):
    rid = store.create_run(tiny())
    store.append_rows(rid, [{"step": i} for i in range(5)])
    child = multiprocessing.get_context("fork").Process(target=_append_in_child, args=(store, rid))
    child.start()
    child.join(60)
    assert child.exitcode == 0
    store.append_rows(rid, [{"step": 200}])          # the parent's connection still works
    np.testing.assert_array_equal(store.history(rid)["step"], [0, 1, 2, 3, 4, 100, 101, 102, 103, 104, 200])


def test_compacting_merges_each_kinds_rows_into_full_chunks_in_order(store, monkeypatch):
    from qatlab.store import rows as R
    monkeypatch.setattr(R, "CHUNK_ROWS", 100)
    rows = [{"step": i, "loss": i / 7} if i % 9 else {"step": i, "test_accuracy": i / 11} for i in range(537)]
    rid = store.create_run(tiny())
    for start in range(0, len(rows), 37):          # several batches, as a live run flushes them
        store.append_rows(rid, rows[start:start + 37])
    before = store.history(rid)
    store.finish(rid, RunResult(history={}, final={}))
    with store._read() as conn:
        sizes = conn.execute("SELECT kind, n FROM row_chunks WHERE run_id = ? ORDER BY kind, first_seq",
                             (rid,)).fetchall()
    per_kind: dict = {}
    for kind, n in sizes:
        per_kind.setdefault(kind, []).append(n)
    n_steps = sum(1 for i in range(537) if i % 9)
    assert sorted(per_kind.values()) == sorted([[60], [100] * (n_steps // 100) + [n_steps % 100]])
    after = store.history(rid)
    assert list(after) == list(before)
    for key in before:
        np.testing.assert_array_equal(after[key], before[key], err_msg=key)


def test_compacting_holds_a_few_chunks_not_the_whole_history(store, monkeypatch):
    import tracemalloc
    from qatlab.store import rows as R
    monkeypatch.setattr(R, "CHUNK_ROWS", 2000)
    cols = [f"c{j}" for j in range(20)]
    rid = store.create_run(tiny())
    n = 40_000
    for start in range(0, n, 500):
        store.append_rows(rid, [{"step": i, **dict.fromkeys(cols, 0.5)} for i in range(start, start + 500)])
    history_bytes = n * (len(cols) + 1) * 8            # 6.7 MB of float64
    tracemalloc.start()
    try:
        store.finish(rid, RunResult(history={}, final={}))
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    assert peak < history_bytes / 4
    assert len(store.history(rid)["step"]) == n
