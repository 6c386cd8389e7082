"""kill -9 of the server mid-run, then a new server on the same store (issue #22), in a real browser.

A page of ``panel serve app/`` (on a temporary ``QATLAB_STORE``) starts a long run of the page's
default experiment; once its rows reach the store the server is killed with SIGKILL (no shutdown
hook runs). Its Dask worker processes (children of the server: the local cluster's workers and
multiprocessing's resource tracker) must be gone within a few seconds, not keep training for
nobody. A new server on the same store lists the run as ``interrupted`` in its Runs tab, and the
store keeps its rows up to about the last second before the kill.
"""
from __future__ import annotations

import os
import re
import time
from pathlib import Path

import numpy as np
import pytest

from qatlab.bench.browser import ROOT, AppServer, DashboardPage, wait_for
from qatlab.store import RunStore

pytestmark = [pytest.mark.browser, pytest.mark.slow]

ROWS_BEFORE_KILL = 20          # rows in the store before the kill (the default CNN logs every 5 steps)
ORPHAN_SECONDS = 10.0          # the killed server's worker processes have exited by then
# rows reach the store at least every 0.5 s (RemoteRun's flush) after leaving the worker every 0.25 s
LAST_ROW_GAP_S = 2.5


def descendants(pid: int) -> set[int]:
    """Every process below ``pid`` (children of each of its threads, recursively), from /proc."""
    found, todo = set(), [pid]
    while todo:
        parent = todo.pop()
        for children in Path(f"/proc/{parent}/task").glob("*/children"):
            try:
                kids = {int(k) for k in children.read_text().split()}
            except OSError:          # the thread or process ended meanwhile
                continue
            todo += sorted(kids - found)
            found |= kids
    return found


def running(pid: int) -> bool:
    """The process exists and is not a zombie (an exited orphan waits for init to reap it)."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return False
    return stat.rsplit(")", 1)[1].split()[0] not in ("Z", "X")


def _tab(dash: DashboardPage, name: str) -> None:
    dash.page.locator(".bk-tab").filter(has_text=re.compile(f"^{name}$")).first.click()
    wait_for(lambda: " ".join(dash.page.locator(".bk-tab.bk-active").first.inner_text().split()) == name,
             10, f"tab {name} active")


def _server(store_path: Path) -> AppServer:
    server = AppServer(root=ROOT, env={"QATLAB_STORE": str(store_path)})
    try:
        return server.start()
    except RuntimeError as exc:
        pytest.fail(str(exc))


def test_kill_9_mid_run_then_restart_lists_the_run_interrupted_with_its_rows(chromium, tmp_path):
    path = tmp_path / "runs.sqlite"
    first = _server(path)
    context = chromium.new_context(viewport={"width": 1400, "height": 900})
    try:
        dash = DashboardPage(context.new_page(), first.url).open(timeout=90)
        dash.set_input("Epochs", 2000)
        dash.click("Start")
        dash.wait_status(lambda s: s.startswith("running"), 90, "running")
        reader = RunStore(path, check_interrupted=False)
        run = wait_for(lambda: next(iter(reader.runs()), None), 30, "the run in the store")
        wait_for(lambda: reader.get(run.id).n_rows >= ROWS_BEFORE_KILL, 120, f"{ROWS_BEFORE_KILL} stored rows")
        workers = descendants(first.proc.pid)
        assert len(workers) >= 2, f"expected the server's Dask worker processes below it, found {workers}"
        killed_at = time.time()
        first.kill()
    finally:
        context.close()
        first.stop()

    # the killed server's workers exit on their own (their parent is gone), so nobody trains the run on
    left = set(workers)
    deadline = time.monotonic() + ORPHAN_SECONDS
    while left and time.monotonic() < deadline:
        left = {pid for pid in left if running(pid)}
        time.sleep(0.1)
    assert not left, f"processes of the killed server still running after {ORPHAN_SECONDS:.0f} s: {sorted(left)}"
    print(f"restart: the killed server's {len(workers)} child processes were gone {time.time() - killed_at:.2f} s "
          "after the kill")
    reader.close()

    second = _server(path)
    context = chromium.new_context(viewport={"width": 1400, "height": 900})
    try:
        dash = DashboardPage(context.new_page(), second.url).open(timeout=90)
        _tab(dash, "Runs")
        row = dash.page.locator(".qatlab-runs-table .tabulator-row").filter(has_text=run.name)
        wait_for(lambda: row.count() == 1 and "interrupted" in row.first.inner_text(), 30,
                 f"run {run.name} listed 'interrupted' in the Runs tab")
        assert dash.console_errors == []
    finally:
        context.close()
        second.stop()

    store = RunStore(path)
    record = store.get(run.id)
    assert record.status == "interrupted", record
    assert f"owner process {first.proc.pid}" in record.message
    history = store.history(run.id)
    n = len(history["row_id"])
    assert n >= ROWS_BEFORE_KILL and record.n_rows == n
    assert list(history["row_id"]) == list(range(n))               # no row missing up to the last one
    last_row_at = record.started.timestamp() + np.nanmax(history["time"])   # the worker's clock starts with the run
    print(f"restart: {n} rows kept; the last row trained {killed_at - last_row_at:.2f} s before the kill")
    assert killed_at - last_row_at < LAST_ROW_GAP_S, (killed_at, last_row_at)
    store.close()
    assert not os.path.exists(f"/proc/{first.proc.pid}")           # (reaped by AppServer.kill)


def test_a_server_whose_port_was_taken_starts_on_another(tmp_path, monkeypatch):
    """A port picked free can be taken before the server binds it (a Dask process got one, once)."""
    import socket
    from qatlab.bench import browser
    taken = socket.socket()
    taken.bind(("127.0.0.1", 0))
    taken.listen()
    ports = iter([taken.getsockname()[1]])
    real = browser.free_port
    monkeypatch.setattr(browser, "free_port", lambda: next(ports, None) or real())
    server = AppServer(root=ROOT, env={"QATLAB_STORE": str(tmp_path / "runs.sqlite")})
    try:
        assert server.port == taken.getsockname()[1]
        server.start()
        assert server.port != taken.getsockname()[1] and browser.http_status(server.url) == 200
    finally:
        server.stop()
        taken.close()
