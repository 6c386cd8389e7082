"""A cluster started from the ``dask scheduler`` / ``dask worker`` command lines, reached with ql.connect(address)."""
from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest

import qatlab as ql
from qatlab.executor import RemoteRun

DASK = Path(sys.executable).with_name("dask")
JOIN = 300.0


def _wait_for(predicate, timeout: float, what: str):
    deadline = time.monotonic() + timeout
    while not (value := predicate()):
        if time.monotonic() > deadline:
            pytest.fail(f"timed out after {timeout:.0f} s waiting for {what}")
        time.sleep(0.1)
    return value


def _address(path: Path):
    try:
        return json.loads(path.read_text())["address"]
    except (OSError, ValueError, KeyError):   # not written yet, or half written
        return None


def _end(proc: subprocess.Popen) -> None:
    if proc.poll() is None:
        proc.terminate()
        try:
            proc.wait(30)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait(10)


@pytest.fixture
def cli_cluster(tmp_path):
    """(scheduler address, log dir) of a scheduler and one 1-thread worker started as commands."""
    scheduler_file = tmp_path / "scheduler.json"
    env = {**os.environ, "DASK_DISTRIBUTED__SCHEDULER__ALLOWED_FAILURES": "0"}
    procs = []
    try:
        with open(tmp_path / "scheduler.log", "w") as out:
            procs.append(subprocess.Popen([str(DASK), "scheduler", "--host", "127.0.0.1", "--port", "0",
                                           "--no-dashboard", "--scheduler-file", str(scheduler_file)],
                                          env=env, stdout=out, stderr=subprocess.STDOUT))

        def ready():
            if procs[0].poll() is not None:
                pytest.fail(f"dask scheduler exited: {(tmp_path / 'scheduler.log').read_text()[-2000:]}")
            return _address(scheduler_file)
        address = _wait_for(ready, 120, "the scheduler file")
        with open(tmp_path / "worker.log", "w") as out:
            procs.append(subprocess.Popen([str(DASK), "worker", "--scheduler-file", str(scheduler_file),
                                           "--nthreads", "1", "--host", "127.0.0.1", "--no-dashboard"],
                                          env=env, stdout=out, stderr=subprocess.STDOUT))
        yield address
    finally:
        ql.shutdown()
        for proc in reversed(procs):
            _end(proc)


@pytest.mark.slow
def test_run_on_a_cluster_started_from_the_command_line(cli_cluster, tmp_path, monkeypatch):
    client = ql.connect(cli_cluster, warm=False)
    monkeypatch.setenv("QATLAB_SCHEDULER", cli_cluster)
    assert ql.connect() is client                      # the same cluster, the same client
    client.wait_for_workers(1, timeout=120)
    store = ql.RunStore(tmp_path / "runs.sqlite")
    cfg = ql.ExperimentConfig()
    cfg.optim.epochs = 20
    run = RemoteRun(cfg, store=store, client=client).start()
    assert run.join(JOIN) and run.status == "finished", run.message
    ref = ql.run_experiment(cfg)
    got = store.history(run.id)
    for key, column in ref.history.items():
        if key not in ("time", "steps_per_second"):
            assert np.array_equal(got[key], column, equal_nan=True), key
    assert store.get(run.id).worker == run.worker
    store.close()


def cli_run(tmp_path, address: str, epochs: int, *extra: str) -> tuple[list[str], ql.ExperimentConfig, Path]:
    """(``python -m qatlab run`` command of the default config at ``epochs`` on ``address``, the config,
    the store path)."""
    cfg = ql.ExperimentConfig()
    cfg.optim.epochs = epochs
    (tmp_path / "cfg.json").write_text(json.dumps(cfg.to_dict()))
    path = tmp_path / "runs.sqlite"
    return ([sys.executable, "-m", "qatlab", "run", str(tmp_path / "cfg.json"), "--store", str(path),
             "--scheduler", address, *extra], cfg, path)


@pytest.mark.slow
def test_the_cli_runs_a_config_on_that_cluster(cli_cluster, tmp_path):
    cmd, cfg, path = cli_run(tmp_path, cli_cluster, 3, "--notes", "from the CLI")
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=JOIN)
    assert done.returncode == 0, done.stderr
    store = ql.RunStore(path)
    (record,) = store.runs()
    assert record.status == "finished" and record.notes == "from the CLI" and record.name == "cfg"
    assert record.worker and record.worker in done.stderr and f"run {record.id[:8]} finished" in done.stderr
    ref = ql.run_experiment(cfg)
    assert np.array_equal(store.history(record.id)["loss"], ref.history["loss"], equal_nan=True)
    store.close()


@pytest.mark.slow
def test_ctrl_c_stops_a_cli_run_on_that_cluster(cli_cluster, tmp_path):
    cmd, _, path = cli_run(tmp_path, cli_cluster, 100_000)
    proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    try:
        def training():
            runs = ql.RunStore(path, check_interrupted=False).runs() if path.exists() else []
            return runs and runs[0].n_rows > 0
        _wait_for(training, JOIN, "rows of the CLI's run in the store")
        proc.send_signal(signal.SIGINT)
        _, err = proc.communicate(timeout=120)
    finally:
        _end(proc)
    assert proc.returncode == 130 and "Traceback" not in err, err
    (record,) = ql.RunStore(path).runs()
    assert record.status == "stopped"


@pytest.mark.slow
def test_the_cli_refuses_a_bad_scheduler_address(tmp_path):
    cfg_path = tmp_path / "cfg.json"
    cfg_path.write_text(json.dumps(ql.ExperimentConfig().to_dict()))
    done = subprocess.run([sys.executable, "-m", "qatlab", "run", str(cfg_path), "--store", str(tmp_path / "r.sqlite"),
                           "--scheduler", "not an address"], capture_output=True, text=True, timeout=120)
    assert done.returncode == 2 and done.stderr.startswith("error: --scheduler:"), done.stderr
