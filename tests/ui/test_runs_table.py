"""The Runs tab reads the run store: every stored run (this page's, other pages', other processes'),
filter, rename / notes / delete with ownership and confirmation, load config into the sidebar,
overlay of stored and live runs, CSV / JSON / model downloads, and a refresh that does nothing when
nothing changed. Runs are made directly in a temporary store (no Dask): a live run is a stand-in
with the attributes of a RemoteRun."""
from __future__ import annotations

import io
import json
import math
import os
import re
import sqlite3
import subprocess
import sys
import time

import numpy as np
import pytest

pn = pytest.importorskip("panel")

import qatlab as ql  # noqa: E402
from qatlab.metrics import MetricsLog  # noqa: E402
from qatlab.runs import RunResult  # noqa: E402
from qatlab.store import RunStore, artifacts  # noqa: E402
from qatlab.train.build import build_model  # noqa: E402
from qatlab.ui import ConfigPanel  # noqa: E402
from qatlab.ui import run_listing  # noqa: E402
from qatlab.ui.runs_table import COLUMNS, RunsTable, runs_csv, runs_json  # noqa: E402
from qatlab.ui.stored_run import StoredLog, StoredRun, public_config, scrub_paths  # noqa: E402

pytestmark = pytest.mark.filterwarnings("ignore:The inplace keyword")

OTHER_HOST = {"host": "elsewhere.example", "pid": 4242, "page": None}   # a notebook on another machine


def tiny(weights="ternary", ste="identity", dataset="synthetic", **quant) -> ql.ExperimentConfig:
    return ql.ExperimentConfig(
        data=ql.DataConfig(dataset=dataset, n_samples=200, n_features=16, n_classes=3, seed=1),
        model=ql.ModelConfig(hidden=[16]), quant=ql.QuantConfig(weights=weights, ste=ste, **quant),
        optim=ql.OptimConfig(epochs=4, batch_size=32, lr=0.05), metrics_every=1)


def rows(n: int, epochs_per_row: float = 0.1) -> list[dict]:
    """Per-step rows with an epoch row (test metrics) after every 5th step."""
    out = []
    for i in range(1, n + 1):
        out.append({"step": i, "epoch": i * epochs_per_row, "time": i * 0.01, "loss": 2.0 / i, "lr": 0.05})
        if i % 5 == 0:
            out.append({"step": i, "epoch": i * epochs_per_row, "time": i * 0.01, "test_loss": 1.0 / i,
                        "test_accuracy": min(1.0, i / 20), "train_accuracy": 0.5, "train_loss": 1.5})
    return out


def make_run(store, cfg=None, name="r", owner="page-a", status="finished", n=10, model=False, notes="",
             sweep_id=None) -> str:
    cfg = cfg if cfg is not None else tiny()
    rid = store.create_run(cfg, name=name, owner=owner, notes=notes, sweep_id=sweep_id)
    store.set_status(rid, "running")
    if n:
        store.append_rows(rid, rows(n))
    if status in ("running", "paused"):
        store.set_status(rid, status)
        return rid
    m = build_model(cfg, cfg.data.n_features, cfg.data.n_classes) if model else None
    store.finish(rid, RunResult(history={}, final={"steps": n, "seconds": 1.5, "test_accuracy": 0.5,
                                                   "train_loss": 0.25}, model=m, status=status))
    return rid


class LiveRun:
    """Stands in for a RemoteRun of this process (the attributes the Runs tab reads)."""

    def __init__(self, store, rid, config, owner):
        self.id, self.name, self.config, self.owner, self.store = rid, store.get(rid).name, config, owner, store
        self.status, self.message = "running", ""
        self.steps_done, self.total_steps, self.elapsed = 7, 40, 3.0
        self.log = MetricsLog()
        for row in rows(7):
            self.log.append(row)
        self.stopped = False

    @property
    def done(self):
        return self.status in ("finished", "stopped", "diverged", "failed")

    @property
    def progress(self):
        return self.steps_done / self.total_steps

    def stop(self):      # (a RemoteRun has stored its end when join() returns)
        self.stopped, self.status = True, "stopped"
        self.store.set_status(self.id, "stopped")

    def join(self, timeout=None):
        return self.done

    def result(self):
        return None


@pytest.fixture
def store(tmp_path):
    s = RunStore(tmp_path / "runs.sqlite")
    yield s
    s.close()


def table_for(store, owner="page-a", live=(), **kw) -> RunsTable:
    return RunsTable(store, live_runs=lambda: list(live), owner=owner, **kw)


def select(table, *ids) -> None:
    table.refresh(force=True)
    table.table.selection = [table._ids.index(i) for i in ids]


def by_id(table):
    return table.table.value.set_index("id")


# ----------------------------------------------------------------------------- listing

def test_lists_every_stored_run_newest_first_with_whose_it_is(store):
    mine = make_run(store, name="mine", owner="page-a", sweep_id="sweep1234567", notes="first try")
    other_page = make_run(store, name="theirs", owner="page-b")
    notebook = make_run(store, tiny("fake", weight_bits=3), name="nb",
                        owner=OTHER_HOST, status="running")
    table = table_for(store)
    df = table.table.value
    assert list(df.columns) == COLUMNS
    assert list(df["id"]) == [notebook, other_page, mine]                      # newest first
    t = by_id(table)
    assert t.loc[mine, "started by"] == "this page" and t.loc[other_page, "started by"] == "another page"
    assert t.loc[notebook, "started by"] == "notebook / CLI" and t.loc[notebook, "status"] == "running"
    assert t.loc[mine, "notes"] == "first try" and t.loc[mine, "sweep"] == "sweep123"
    assert t.loc[mine, "progress"] == 1.0 and t.loc[mine, "steps"] == 10 and t.loc[mine, "test_accuracy"] == 0.5
    assert t.loc[notebook, "bits"] == "3-bit" and t.loc[mine, "bits"] == "ternary"
    assert t.loc[mine, "per channel"] == "-" and t.loc[notebook, "per channel"] == "no"
    created = store.get(mine).created.strftime("%Y-%m-%dT%H:%MZ")
    assert t.loc[mine, "created"] == created and len(created) == len("2026-01-01T00:00Z")


def test_the_same_list_after_reopening_and_a_dead_owners_run_is_interrupted(store, tmp_path):
    done = make_run(store, name="kept")
    dead = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True, text=True)
    pid = int(dead.stdout)                      # a process of this host that has ended
    import socket
    orphan = make_run(store, name="orphan", owner={"host": socket.gethostname(), "pid": pid, "page": "old"},
                      status="running")
    table = table_for(RunStore(store.path, check_interrupted=False))   # (so the table's own check marks it)
    t = by_id(table)
    assert set(t.index) == {done, orphan} and t.loc[orphan, "status"] == "interrupted"
    again = table_for(RunStore(tmp_path / "runs.sqlite"), owner="a-new-page")
    assert list(again.table.value["id"]) == list(table.table.value["id"])
    assert by_id(again).loc[done, "started by"] == "another page"


def test_columns_are_the_same_with_and_without_runs_and_the_first_run_changes_none(store):
    # a Tabulator whose columns change while its tab is first drawn fails in the browser (COLUMNS)
    table = table_for(store)
    assert list(table.table.value.columns) == COLUMNS
    model = table.table.get_root()
    changes = []
    model.on_change("columns", lambda attr, old, new: changes.append(new))
    rid = make_run(store)
    table.refresh(force=True)
    assert rid in list(model.source.data["id"]) and changes == []


def test_quantization_columns_say_bits_only_for_fake_weights():
    def cfg(weights="ternary", bits=4, activations="off", per_channel=False, scale_mode="observer", batch=64):
        c = ql.ExperimentConfig()
        c.quant.weights, c.quant.weight_bits, c.quant.activations = weights, bits, activations
        c.quant.per_channel, c.quant.scale_mode, c.optim.batch_size = per_channel, scale_mode, batch
        return run_listing.config_columns(c.to_dict())
    cols = [cfg("ternary"), cfg("float", batch=32), cfg("fake", 3, "fake", True, "lsq", 128),
            cfg("ternary", activations="fake")]
    assert [c["bits"] for c in cols] == ["ternary", "float", "3-bit", "ternary"]
    assert [c["activations"] for c in cols] == ["off", "off", "8-bit", "8-bit"]
    assert [c["per channel"] for c in cols] == ["-", "-", "yes", "-"]
    assert [c["scale mode"] for c in cols] == ["-", "-", "lsq", "observer"]
    assert [c["batch"] for c in cols] == [64, 32, 128, 64]


def test_filter_hides_rows_that_do_not_match(store):
    a = make_run(store, tiny(ste="tanh"), name="alpha", notes="baseline")
    b = make_run(store, tiny("float"), name="beta", status="stopped")
    c = make_run(store, tiny(dataset="digits"), name="gamma", sweep_id="abcdef99")
    table = table_for(store)
    for text, expect in [("ALPHA", {a}), ("baseline", {a}), ("stopped", {b}), ("float", {b}), ("tanh", {a}),
                         ("digits", {c}), ("abcdef", {c}), ("", {a, b, c}), ("nothing like it", set())]:
        table.filter_input.value_input = text
        assert set(table.table.value["id"]) == expect, text
    table.filter_input.value_input = ""
    select(table, a, c)
    table.filter_input.value_input = "gamma"              # a selected run hidden by the filter leaves the selection
    assert table.selected_ids() == [c] and table.table.selection == [0]
    table.filter_input.param.update(value="beta", value_input="beta")     # Enter: both change at once
    assert set(table.table.value["id"]) == {b}


# ----------------------------------------------------------------------------- changing runs

def test_rename_and_notes_of_own_run_now_of_another_pages_ended_run_after_confirm(store):
    mine, theirs = make_run(store, name="mine"), make_run(store, name="theirs", owner="page-b")
    table = table_for(store)
    select(table, mine)
    assert not table.rename_button.disabled and not table.notes_button.disabled
    assert table.rename_selected("<script>") is False and "name: expected" in table.message.object
    assert table.rename_selected('<img src=x onerror="alert(1)">*y*') is False     # the refusal repeats the name
    assert re.search(r"(?<!\\)[<>*]", table.message.object) is None and r"\<img" in table.message.object
    assert table.message.renderer_options == {"linkify": False}                  # optim.lr is not a link
    assert table.rename_selected("  renamed ") is True and store.get(mine).name == "renamed"
    assert table.save_notes("lr too high\nnext: 0.01") is True and store.get(mine).notes == "lr too high\nnext: 0.01"
    assert by_id(table).loc[mine, "name"] == "renamed" and by_id(table).loc[mine, "notes"].startswith("lr too")
    assert table.save_notes("x" * 5000) is False and "notes: expected" in table.message.object
    select(table, theirs)
    assert table.notes_input.value == ""
    assert table.rename_selected("taken over") is False                       # asks first
    assert table.confirm_row.visible and theirs[:8] in table.confirm_text.object and store.get(theirs).name == "theirs"
    table.cancel()
    assert table.confirm() is False and store.get(theirs).name == "theirs"
    table.rename_selected("taken over")
    assert table.confirm() is True and store.get(theirs).name == "taken over"
    table.save_notes("seen")
    assert table.confirm() is True and store.get(theirs).notes == "seen"


def test_delete_asks_first_and_never_deletes_another_pages_active_run(store):
    ended = make_run(store, name="ended", owner="page-b")
    active = make_run(store, name="active", owner="page-b", status="running")
    cli = make_run(store, name="cli", owner=OTHER_HOST, status="running")
    table = table_for(store)
    select(table, active)
    assert table.delete_button.disabled and table.rename_button.disabled and table.stop_button.disabled
    table.delete_selected()                              # a press that gets through anyway is refused
    assert not table.confirm_row.visible and "read-only" in table.message.object and active[:8] in table.message.object
    assert table.rename_selected("mine now") is False and store.get(active).name == "active"
    assert table.stop_selected() == [] and "read-only" in table.message.object
    select(table, cli)
    assert by_id(table).loc[cli, "started by"] == "notebook / CLI" and table.delete_button.disabled
    select(table, ended)
    assert not table.delete_button.disabled
    table.delete_selected()
    assert table.confirm_row.visible and store.get(ended)                     # nothing deleted yet
    store.set_status(ended, "finished")   # (still ended when confirmed)
    assert table.confirm() is True
    with pytest.raises(KeyError):
        store.get(ended)
    assert ended not in list(table.table.value["id"]) and table.table.selection == [] and table.selected_ids() == []
    # the check is made again on confirm: a run that became active meanwhile is refused
    select(table, active)
    store.set_status(active, "stopped")
    table.refresh(force=True)
    table.delete_selected()
    store.set_status(active, "running")
    assert table.confirm() is False and store.get(active) and "read-only" in table.message.object


def test_live_run_of_this_page_shows_progress_is_stopped_and_deleted_once_ended(store):
    rid = make_run(store, name="live", owner="page-a", status="running")
    foreign = make_run(store, name="foreign", owner="page-b", status="running")
    run = LiveRun(store, rid, tiny(), "page-a")
    table = table_for(store, live=[run])
    row = by_id(table).loc[rid]
    assert row["steps"] == 7 and row["progress"] == round(7 / 40, 3) and row["seconds"] == 3.0
    run.steps_done = 20
    table.refresh(force=True)
    assert by_id(table).loc[rid, "progress"] == 0.5
    select(table, rid, foreign)
    assert not table.stop_button.disabled and table.delete_button.disabled      # (foreign is read-only)
    assert table.stop_selected() == [run] and run.stopped and "read-only" in table.message.object
    select(table, rid)
    run.status = "running"
    assert not table.delete_button.disabled
    table.delete_selected()
    assert table.confirm() is True and run.status == "stopped"          # stopped, deleted once ended
    assert rid not in list(table.table.value["id"])
    assert _wait(lambda: rid not in [r.id for r in store.runs()], 5)


def test_load_config_into_the_sidebar(store):
    cfg = tiny("fake", weight_bits=3, activations="fake")
    cfg.optim.lr, cfg.model.hidden, cfg.phase.prediction.momentum = 0.002, [24, 12], 0.7
    rid = make_run(store, cfg, name="to load", owner=OTHER_HOST)
    loaded = []
    table = table_for(store, on_load_config=loaded.append)
    assert table.load_button.disabled
    select(table, rid)
    assert not table.load_button.disabled and table.load_selected_config() is True
    assert loaded[0].to_dict() == cfg.to_dict()
    panel = ConfigPanel(ql.ExperimentConfig())
    panel.load_config(loaded[0])
    assert panel.config.to_dict() == cfg.to_dict() and panel.problems == []
    assert panel.fields["optim.lr"].widget.value == "0.002" and panel.fields["model.hidden"].widget.value == "24, 12"
    assert panel.fields["quant.weights"].widget.value == "fake" and panel.fields["quant.weight_bits"].visible
    assert not panel.start_button.disabled


def test_load_config_never_takes_a_server_path(tmp_path):
    data_dir = tmp_path / "data"
    data_dir.mkdir()
    x = np.random.default_rng(0).normal(size=(60, 4)).astype(np.float32)
    np.savez(data_dir / "mine.npz", X=x, y=np.arange(60) % 3)
    np.savez(tmp_path / "secret.npz", X=x, y=np.arange(60) % 3)
    cfg = tiny()
    cfg.data.dataset, cfg.model.architecture = "file", "mlp"
    panel = ConfigPanel(ql.ExperimentConfig(), data_dir=str(data_dir))
    cfg.data.path = str(data_dir / "mine.npz")
    panel.load_config(cfg)
    assert panel.config.data.path == os.path.realpath(data_dir / "mine.npz") and panel.problems == []
    assert panel.file_chooser.choice.value == "mine.npz"
    cfg.data.path = str(tmp_path / "secret.npz")        # a path outside what the page is offered
    panel.load_config(cfg)
    assert panel.config.data.path == "" and panel.start_button.disabled
    assert any("path" in p for p in panel.problems) and str(tmp_path) not in panel.error.object
    with pytest.raises(TypeError, match="cfg"):
        panel.load_config(cfg.to_dict())


# ----------------------------------------------------------------------------- overlay, show

def test_overlay_of_a_stored_run_and_of_a_live_run(store):
    stored = make_run(store, name="stored", n=30)
    live_id = make_run(store, name="live", status="running")
    run = LiveRun(store, live_id, tiny(), "page-a")
    shown = []
    table = table_for(store, live=[run], on_show=shown.append)
    select(table, stored, live_id)
    names = {r.name for fig in table.figures.values() for r in fig.renderers}
    assert {f"runs-loss-{stored}", f"runs-accuracy-{stored}", f"runs-loss-{live_id}"} <= names
    rs = table.hub.stream(table.run_like(stored))
    assert list(rs.loss.data["step"]) == list(range(1, 31)) and len(rs.eval.data["test_accuracy"]) == 6
    assert {r.id for r in table.shown_runs()} == {stored, live_id}
    table._show()                                  # the first selected in table order: the newer, live one
    select(table, stored)
    table._show()
    assert shown[0] is run and isinstance(shown[1], StoredRun) and shown[1].id == stored and shown[1].done
    select(table, live_id)
    assert stored not in table.hub                 # deselected: its history is let go


def test_stored_run_reads_like_a_run(store):
    cfg = tiny()
    finished = make_run(store, cfg, name="f", n=20)
    stopped = make_run(store, cfg, name="s", n=10, status="stopped")
    store.set_status(stopped, "stopped", "stopped at /home/someone/secret/place.npz step 10")
    run = StoredRun(store, finished)
    assert (run.status, run.steps_done, run.total_steps, run.progress) == ("finished", 20, 20, 1.0)
    assert run.keep_alive is False and run.weight_snapshot() is None and run.join() and run.done
    assert run.owner == "page-a" and run.log.meta["total_steps"] == 20 and run.elapsed >= 0
    assert run.result().final["test_accuracy"] == 0.5 and run.config.to_dict() == cfg.to_dict()
    s = StoredRun(store, stopped)
    assert s.steps_done == 10 and s.total_steps == 40          # 1.0 epoch reached of 4 planned
    assert s.message == "stopped at place.npz step 10"
    with pytest.raises(KeyError):
        StoredRun(store, "0" * 32)


def test_stored_log_reads_like_the_metrics_log_it_came_from():
    ref = MetricsLog()
    for row in rows(23):
        ref.append(row)
    log = StoredLog(ref.columns())
    assert len(log) == len(ref) and log.total_rows == ref.total_rows and log.keys == ref.keys
    for cursor in (0, 5, 27, log.total_rows):
        (a, na), (b, nb) = log.since(cursor), ref.since(cursor)
        assert na == nb and a.keys() == b.keys()
        for k in a:
            np.testing.assert_array_equal(a[k], b[k])
    assert log.last("test_accuracy") == ref.last("test_accuracy") and math.isnan(log.last("nope"))
    with pytest.raises(TypeError, match="read-only"):
        log.append({"step": 1})
    with pytest.raises(ValueError, match="row_id"):
        StoredLog({"step": np.arange(3.0)})


# ----------------------------------------------------------------------------- downloads

def test_csv_json_and_model_downloads_come_from_the_store(store):
    cfg = tiny("fake", weight_bits=4)
    cfg.data.dataset, cfg.data.path = "file", "/srv/private/users/x/data.npz"
    a = make_run(store, cfg, name="a", n=12, model=True)
    b = make_run(store, tiny(), name="b", n=3)
    table = table_for(store)
    text = table._csv_file().getvalue()                 # nothing selected: every shown run
    lines = text.splitlines()
    assert lines[0].split(",")[:4] == ["run_id", "name", "row_id", "step"]
    assert sum(line.startswith(a) for line in lines) == store.get(a).n_rows
    assert sum(line.startswith(b) for line in lines) == store.get(b).n_rows
    assert f"{a},a,0,1," in text                        # counts as integers
    configs = json.loads(table._json_file().getvalue())
    assert set(configs) == {a, b} and configs[a]["config"]["data"]["path"] == "data.npz"
    assert "/srv" not in table._json_file().getvalue() and configs[a]["name"] == "a"
    select(table, b)
    assert table.model_download.disabled                 # no stored model
    assert set(json.loads(table._json_file().getvalue())) == {b}
    assert {line.split(",")[0] for line in table._csv_file().getvalue().splitlines()[1:]} == {b}
    select(table, a)
    assert not table.model_download.disabled and table.model_download.filename.endswith(f"{a[:8]}.npz")
    data = table._model_file().getvalue()
    assert b"/srv/private" not in data
    model, stored = artifacts.load_model(data), store.load_model(a)
    x = np.random.default_rng(1).normal(size=(5, 16)).astype(np.float32)
    np.testing.assert_array_equal(model.forward(x, model.scratch(5)), stored.forward(x, stored.scratch(5)))
    files = np.load(io.BytesIO(data), allow_pickle=False)
    assert json.loads(str(files["meta"]))["format"] == artifacts.FORMAT
    assert json.loads(str(files["config"])) == public_config(store.get(a).config_dict)


def test_run_like_helpers_keep_working(store):
    rid = make_run(store, name="x", n=4)
    run = StoredRun(store, rid)
    assert runs_csv([]).startswith("run_id,name") and json.loads(runs_json([])) == {}
    assert runs_csv([run]).count(rid) == store.get(rid).n_rows
    assert json.loads(runs_json([run]))[rid]["status"] == "finished"


def test_scrub_paths_and_public_config():
    assert scrub_paths("no such file /home/u/x.npz; see /tmp/a/") == "no such file x.npz; see a"
    kept = "tcp://127.0.0.1:8786 at 300 steps/s, 1/2 done"        # a URL, a rate, a fraction: no paths
    assert scrub_paths(kept) == kept
    cfg = {"data": {"dataset": "file", "path": "/a/b/c.csv"}}
    assert public_config(cfg)["data"]["path"] == "c.csv" and cfg["data"]["path"] == "/a/b/c.csv"


# ----------------------------------------------------------------------------- refresh cost

def test_refresh_reads_the_listing_and_leaves_the_table_alone_when_nothing_changed(store, monkeypatch):
    ids = [make_run(store, name=f"r{i}", n=0) for i in range(30)]
    table = table_for(store)
    assert len(table.table.value) == 30
    calls = []
    monkeypatch.setattr(type(store), "runs", lambda *a, **k: calls.append("runs") or [])   # never the slow list
    monkeypatch.setattr(run_listing.Listed, "from_row", classmethod(lambda cls, row: calls.append("parse")))
    sent = []
    table.table.param.watch(lambda e: sent.append(e.name), ["value"])
    monkeypatch.setattr(table.table, "patch", lambda *a, **k: sent.append("patch"))
    monkeypatch.setattr(table.table, "stream", lambda *a, **k: sent.append("stream"))
    table.refresh()                                    # within the period: nothing at all
    table.refresh(force=True)                          # read, nothing changed: the table is not touched
    assert calls == [] and sent == []
    monkeypatch.undo()
    store.rename(ids[3], "changed")
    sent = []
    table.table.param.watch(lambda e: sent.append(e.name), ["value"])
    table.refresh(force=True)
    assert by_id(table).loc[ids[3], "name"] == "changed" and sent == []       # patched, not replaced


def test_bad_arguments_are_refused(store):
    with pytest.raises(TypeError, match="store"):
        RunsTable("runs.sqlite")
    with pytest.raises(TypeError, match="live_runs"):
        RunsTable(store, live_runs=[])


def _wait(predicate, timeout: float) -> bool:
    end = time.monotonic() + timeout
    while time.monotonic() < end:
        if predicate():
            return True
        time.sleep(0.02)
    return predicate()


def test_a_store_that_cannot_be_read_is_said_without_its_path_and_recovers(store, monkeypatch):
    from qatlab.store import RunStore, StoreLockedError
    rid = make_run(store, name="x")
    table = table_for(store)

    def locked(_store):
        raise StoreLockedError(f"{store.path}: the run store is locked by another connection (waited 5 s)")
    monkeypatch.setattr(RunStore, "listing", locked)
    table.refresh(force=True)
    assert table.message.visible and "locked" in table.message.object and str(store.path) not in table.message.object
    assert list(table.table.value["id"]) == [rid]          # the last list stays
    monkeypatch.undo()
    table.refresh(force=True)
    assert not table.message.visible


def test_a_store_error_is_shown_literally(store, monkeypatch):
    from qatlab.store import RunStore
    table = table_for(store)

    def broken(_store):
        raise ValueError("table runs has no column named <b>*x*</b>")
    monkeypatch.setattr(RunStore, "listing", broken)
    table.refresh(force=True)
    text = table.message.object
    assert re.search(r"(?<!\\)[<>*]", text) is None and r"\<b\>\*x\*" in text


def test_names_from_notebooks_are_shown_literally_in_questions(store):
    rid = make_run(store, name="n", owner=OTHER_HOST)
    with sqlite3.connect(store.path) as conn:       # (a name the store refuses now: an older store's, or another tool's)
        conn.execute("UPDATE runs SET name = ? WHERE id = ?", ("<img src=x onerror=alert(1)> *bold*", rid))
    table = table_for(store)
    select(table, rid)
    table.delete_selected()
    text = table.confirm_text.object
    assert re.search(r"(?<!\\)[<>*]", text) is None and r"\<img" in text and r"\*bold\*" in text


def test_dashboard_shows_a_stored_run_in_overview_and_loads_its_config(store):
    from qatlab.ui import Dashboard
    cfg = tiny()
    cfg.optim.lr = 0.003
    rid = make_run(store, cfg, name="old run", n=30, owner=OTHER_HOST, model=True)
    dash = Dashboard(period=0, store=store)
    try:
        dash.tabs.active = 4                               # Runs: built and read when first shown
        assert list(dash.runs.table.value["name"]) == ["old run"]
        dash.runs.table.selection = [0]
        dash.runs.show_button.clicks += 1
        assert dash.tabs.active == 0 and isinstance(dash.overview.run, StoredRun) and dash.overview.run.id == rid
        assert "old run" in dash.overview.alert.object and "step 30 / 30" in dash.overview.stats.object
        dash.tabs.active = 4
        dash.runs.load_button.clicks += 1
        panel = dash.config_panel
        assert panel.config.optim.lr == 0.003 and panel.fields["optim.lr"].widget.value == "0.003"
    finally:
        dash.close(join_timeout=5)


# ----------------------------------------------------------------------------- in the browser

@pytest.mark.browser
@pytest.mark.slow
def test_browser_runs_tab_lists_filters_and_overlays_the_store_and_a_reload_shows_the_same(open_app, tmp_path):
    import re as _re

    from qatlab.bench.browser import wait_for
    path = tmp_path / "runs.sqlite"
    with RunStore(path) as s:     # runs of an earlier process: a notebook's, one with notes and a model
        alpha = make_run(s, tiny(ste="tanh"), name="alpha run", n=30, notes="baseline", owner=OTHER_HOST, model=True)
        beta = make_run(s, tiny("float"), name="beta run", n=20, owner=OTHER_HOST, status="stopped")   # no progress
    _, dash = open_app(QATLAB_STORE=str(path))

    def runs_tab():
        dash.page.locator(".bk-tab").filter(has_text=_re.compile("^Runs$")).first.click()
        rows = dash.page.locator(".qatlab-runs-table .tabulator-row")
        wait_for(lambda: rows.count() == 2, 30, "the two stored runs in the Runs tab")
        return rows
    rows = runs_tab()
    assert "beta run" in rows.nth(0).inner_text() and "alpha run" in rows.nth(1).inner_text()   # newest first
    assert "notebook / CLI" in rows.nth(1).inner_text() and "baseline" in rows.nth(1).inner_text()
    dash.set_input("Filter", "baseline")
    wait_for(lambda: rows.count() == 1, 10, "the filter leaves one run")
    rows.nth(0).locator("input[type=checkbox]").click()
    wait_for(lambda: f"runs-loss-{alpha}" in dash.model_names("runs-loss-"), 20, "the stored run overlaid")
    assert dash.button("Download model").is_enabled() and f"runs-loss-{beta}" not in dash.model_names("runs-loss-")
    assert str(tmp_path) not in dash.body_text()
    dash.page.reload()
    dash.wait_ready(90)
    runs_tab()                                       # the same list after a reload
    assert dash.console_errors == [], dash.console_errors


def test_a_deleted_run_that_does_not_stop_stays_in_the_store_and_shows_again(store, monkeypatch):
    from qatlab.ui import runs_table
    monkeypatch.setattr(runs_table, "DELETE_JOIN_SECONDS", 0.2)
    rid = make_run(store, name="stuck", status="running")
    run = LiveRun(store, rid, tiny(), "page-a")
    run.stop = lambda: None                      # asked to stop, never ends
    run.join = lambda timeout=None: time.sleep(timeout) or False
    table = table_for(store, live=[run])
    select(table, rid)
    table.delete_selected()
    assert table.confirm() is True and rid not in list(table.table.value["id"])   # hidden while it stops
    assert _wait(lambda: rid not in table._deleting, 5)
    table.refresh(force=True)
    assert rid in list(table.table.value["id"]) and store.get(rid).status == "running"


def test_a_lazy_tab_builds_its_widgets_and_reads_the_store_when_first_shown(store):
    rid = make_run(store)
    table = table_for(store, lazy=True)
    assert not hasattr(table, "table") and table.__panel__().objects == []   # a page opens without them
    table.refresh(force=True)
    table.set_active(True)
    assert list(table.table.value["id"]) == [rid] and table.__panel__().objects == [table._layout]
