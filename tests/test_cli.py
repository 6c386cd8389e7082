"""``python -m qatlab run|runs``: bad configs are one-line errors with exit code 2; a run lands in the store."""
from __future__ import annotations

import json
import os
import signal
import sqlite3
import subprocess
import sys
import time

import numpy as np
import pytest

import qatlab as ql
from qatlab.__main__ import main
from qatlab.runs import RunResult
from qatlab.store import RunStore

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
TINY = {"data": {"dataset": "synthetic", "n_samples": 200, "n_features": 16, "n_classes": 3, "seed": 1},
        "model": {"hidden": [16]}, "optim": {"epochs": 3, "batch_size": 32, "lr": 0.05}, "metrics_every": 1}


def write(tmp_path, text: str, name: str = "cfg.json") -> str:
    path = tmp_path / name
    path.write_text(text)
    return str(path)


def start_long_run(tmp_path, store: str) -> subprocess.Popen:
    """``python -m qatlab run`` of TINY for 100k epochs (stopped by the test), stderr piped."""
    long = {**TINY, "optim": {**TINY["optim"], "epochs": 100_000}}
    return subprocess.Popen([sys.executable, "-m", "qatlab", "run", write(tmp_path, json.dumps(long)), "--store", store],
                            stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True, cwd=ROOT)


def stored_rows(store: str) -> int:
    """Rows the store holds of its one run (0 before it exists)."""
    runs = RunStore(store, check_interrupted=False).runs() if os.path.exists(store) else []
    return runs[0].n_rows if runs else 0


def wait_rows(store: str, at_least: int, timeout: float = 120.0) -> int:
    deadline, seen = time.monotonic() + timeout, 0
    while seen < at_least and time.monotonic() < deadline:     # rows reach the store while it trains
        time.sleep(0.2)
        seen = stored_rows(store)
    assert seen >= at_least, "no rows reached the store"
    return seen


@pytest.mark.parametrize("text, message", [
    ("{not json", "not valid JSON (line 1, column 2"),
    ("[1, 2]", "expected a JSON object"),
    ('{"optim": {"lr": -1}}', "bad config:"),
    ('{"optim": {"epochs": "many"}}', "bad config:"),
    ('{"nope": 1}', "unknown field 'nope'"),
    ('{"data": {"dataset": "file"}}', "DataConfig.path: required"),
    ('{"data": {"dataset": "file", "path": "/nonexistent/x.npz"}}', "data.path: '/nonexistent/x.npz' is not a file"),
    ('{"metrics_every": true}', "metrics_every: expected a number, got True"),
])
def test_bad_config_is_one_line_and_exit_2(tmp_path, capsys, text, message):
    store = str(tmp_path / "s.sqlite")
    assert main(["run", write(tmp_path, text), "--store", store]) == 2
    err = capsys.readouterr().err
    assert err.startswith("error: ") and err.count("\n") == 1 and message in err
    assert not os.path.exists(store) or RunStore(store).runs() == []


def test_missing_config_and_bad_store(tmp_path, capsys):
    assert main(["run", str(tmp_path / "missing.json")]) == 2
    assert "cannot read the config" in capsys.readouterr().err
    (tmp_path / "junk").write_text("not sqlite" * 10)
    assert main(["runs", "--store", str(tmp_path / "junk")]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "not an SQLite file" in err
    assert main(["runs", "--store", str(tmp_path / "s.sqlite"), "--status", "nope"]) == 2


def test_config_that_is_not_utf8(tmp_path, capsys):
    path = tmp_path / "binary.json"
    path.write_bytes(b"\xff\xfe\x00{")
    assert main(["run", str(path), "--store", str(tmp_path / "s.sqlite")]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "not a UTF-8 text file" in err


def test_runs_lists_the_store(tmp_path, capsys):
    path = str(tmp_path / "s.sqlite")
    assert main(["runs", "--store", path]) == 2           # a mistyped path is not made into a new store
    assert "no run store at" in capsys.readouterr().out and not os.path.exists(path)
    store = RunStore(path)
    assert main(["runs", "--store", path]) == 0
    assert "no runs in" in capsys.readouterr().out
    a = store.create_run(ql.ExperimentConfig.from_dict(TINY), name="alpha")
    store.set_status(a, "running")
    store.finish(a, RunResult(history={}, final={"test_accuracy": 0.8125}))
    b = store.create_run(ql.ExperimentConfig.from_dict(TINY), name="beta")
    assert main(["runs", "--store", path]) == 0
    lines = capsys.readouterr().out.splitlines()
    assert lines[0].split()[:3] == ["id", "name", "status"]
    assert lines[1].split()[:3] == [a[:8], "alpha", "finished"] and lines[1].endswith("0.8125")
    assert lines[2].split()[:3] == [b[:8], "beta", "created"] and lines[2].endswith("-")
    assert main(["runs", "--store", path, "--status", "finished"]) == 0
    assert len(capsys.readouterr().out.splitlines()) == 2


def test_help_says_where_runs_train(capsys):
    with pytest.raises(SystemExit):
        main(["run", "--help"])
    text = " ".join(capsys.readouterr().out.split())
    assert "in this process, or on the Dask cluster at --scheduler" in text and "--scheduler ADDR" in text


@pytest.mark.slow
def test_run_end_to_end(tmp_path):
    cfg = write(tmp_path, json.dumps(TINY), "tiny.json")
    store = str(tmp_path / "s.sqlite")
    env = {**os.environ, "QATLAB_STORE": str(tmp_path / "not-this.sqlite")}
    proc = subprocess.run([sys.executable, "-m", "qatlab", "run", cfg, "--store", store, "--name", "cli run"],
                          capture_output=True, text=True, cwd=ROOT, env=env, timeout=600)
    assert proc.returncode == 0, proc.stderr
    assert "100%" in proc.stderr and "finished: test accuracy" in proc.stderr
    (r,) = RunStore(store).runs()
    assert (r.name, r.status, r.config.to_dict()) == ("cli run", "finished", ql.ExperimentConfig.from_dict(TINY).to_dict())
    assert r.final["test_accuracy"] > 0.5 and r.started <= r.ended
    reference = ql.run_experiment(ql.ExperimentConfig.from_dict(TINY))
    h = RunStore(store).history(r.id)
    assert list(h) == list(reference.history)
    for key, col in reference.history.items():       # the same rows as in-process (time columns aside)
        if key not in ("time", "steps_per_second"):
            np.testing.assert_array_equal(h[key], col, err_msg=key)
    model = RunStore(store).load_model(r.id)
    np.testing.assert_array_equal(model.flat_params(), reference.model.flat_params())
    listing = subprocess.run([sys.executable, "-m", "qatlab", "runs"], capture_output=True, text=True, cwd=ROOT,
                             env={**os.environ, "QATLAB_STORE": store}, timeout=300)
    assert listing.returncode == 0 and r.id[:8] in listing.stdout and "cli run" in listing.stdout
    assert not os.path.exists(tmp_path / "not-this.sqlite")


@pytest.mark.slow
def test_killed_cli_run_is_interrupted_with_its_rows(tmp_path):
    store = str(tmp_path / "s.sqlite")
    proc = start_long_run(tmp_path, store)
    try:
        seen = wait_rows(store, 50)
    finally:
        proc.kill()
        proc.communicate(timeout=30)
    (r,) = RunStore(store).runs()
    assert r.status == "interrupted" and r.n_rows >= seen
    h = RunStore(store).history(r.id)
    np.testing.assert_array_equal(h["row_id"], np.arange(r.n_rows))
    assert np.all(np.diff(h["step"]) >= 0)


@pytest.mark.slow
def test_ctrl_c_stops_the_run_and_keeps_it(tmp_path):
    store = str(tmp_path / "s.sqlite")
    proc = start_long_run(tmp_path, store)
    try:
        seen = wait_rows(store, 1)
        proc.send_signal(signal.SIGINT)
        _, err = proc.communicate(timeout=60)
    finally:
        proc.kill()
    assert proc.returncode == 130, err
    (r,) = RunStore(store).runs()
    assert r.status == "stopped" and "stopped by request" in r.message and r.n_rows >= seen > 0
    assert len(RunStore(store).history(r.id)["step"]) == r.n_rows


def test_run_on_a_locked_store_is_one_line(tmp_path, capsys):
    path = str(tmp_path / "s.sqlite")
    RunStore(path).close()
    other = sqlite3.connect(path, isolation_level=None)
    other.execute("BEGIN EXCLUSIVE")
    try:
        assert main(["run", write(tmp_path, json.dumps(TINY)), "--store", path]) == 2
    finally:
        other.execute("ROLLBACK")
    err = capsys.readouterr().err
    assert err.startswith("error: ") and err.count("\n") == 1 and "locked by another connection" in err


def test_a_failed_run_keeps_a_one_line_message(tmp_path, capsys):
    bad = tmp_path / "data.csv"
    bad.write_text("these,are\nnot,numbers\n")
    cfg = {**TINY, "data": {"dataset": "file", "path": str(bad)}}
    store = str(tmp_path / "s.sqlite")
    assert main(["run", write(tmp_path, json.dumps(cfg)), "--store", store]) == 1
    (r,) = RunStore(store).runs()
    assert r.status == "failed" and r.message and "\n" not in r.message and "Traceback" not in r.message
    assert "Traceback" in capsys.readouterr().err        # (the whole story goes to the terminal)


@pytest.mark.parametrize("columns", [120, 40])
def test_progress_line_fits_and_clears_the_last_one(monkeypatch, columns):
    import io
    from qatlab.__main__ import _Progress

    class Tty(io.StringIO):
        def isatty(self):
            return True
    monkeypatch.setattr("shutil.get_terminal_size", lambda *a: os.terminal_size((columns, 24)))
    out = Tty()
    progress = _Progress(out)
    progress.draw(5, 10, 0.00001234, final=True)
    progress.draw(10, 10, 0.5, final=True)
    lines = [line.removeprefix("\r") for line in out.getvalue().split("\n") if line]
    assert len(lines) == 2 and all(line.endswith("\x1b[K") for line in lines)   # the rest of a longer line is cleared
    shown = [line.removesuffix("\x1b[K") for line in lines]
    assert all(line.startswith("[") == (columns == 120) for line in shown)      # no bar where it does not fit
    assert all(len(line) <= columns for line in shown) or columns == 40


@pytest.mark.slow
def test_a_lock_while_training_does_not_end_the_run(tmp_path):
    store = str(tmp_path / "s.sqlite")
    proc = start_long_run(tmp_path, store)
    try:
        wait_rows(store, 1)
        other = sqlite3.connect(store, isolation_level=None)
        other.execute("BEGIN EXCLUSIVE")           # longer than the store's 5 s busy timeout
        time.sleep(8)
        other.execute("ROLLBACK")
        before = stored_rows(store)
        time.sleep(3)
        assert proc.poll() is None and stored_rows(store) > before       # still training, rows stored again
        proc.send_signal(signal.SIGINT)
        _, err = proc.communicate(timeout=60)
    finally:
        proc.kill()
    assert proc.returncode == 130 and "locked by another writer" in err, err
    (r,) = RunStore(store).runs()
    assert r.status == "stopped"
