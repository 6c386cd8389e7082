"""The ``dashboard`` benchmark suite's structure, without a browser (quick).

The measuring functions that need chromium are replaced by canned results, so what is checked
here is the suite's own logic: tables, goal names and PASS/MISS decisions, labels of --quick,
JSON output, and the server-side inspector (run in this process on a tiny comparison).
"""
from __future__ import annotations

import io
import json
import math
import os
import subprocess
import sys
import time
import urllib.request

import pytest

from qatlab import bench

from qatlab.bench import browser, dashboard as bd, proc_cpu
from qatlab.bench.kit import BenchOptions, SuiteNotAvailable, load_suite

QUICK = BenchOptions(quick=True, repeats=1, warmup=0, min_time=0.0)


def test_suite_registered():
    assert load_suite("dashboard").fn is bd.run


def test_unavailable_without_chromium(monkeypatch):
    monkeypatch.setattr(browser, "CHROMIUM", "/nonexistent/chromium")
    assert "chromium not found" in browser.browser_unavailable()
    with pytest.raises(SuiteNotAvailable, match="chromium"):
        bd.run(QUICK)


# A child that uses 0.3 s of CPU, says so, and lives on until its stdin closes.
_BUSY_CHILD = ("import sys, time\nt = time.process_time()\nwhile time.process_time() - t < 0.3:\n    pass\n"
               "print('done', flush=True)\nsys.stdin.read()\n")


@pytest.mark.skipif(not os.path.isdir("/proc"), reason="reads Linux's /proc")
def test_used_since_counts_the_server_and_its_descendants():
    before = proc_cpu.process_cpu(os.getpid())           # this process plays the server
    child = subprocess.Popen([sys.executable, "-c", _BUSY_CHILD], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                             text=True)
    try:
        assert child.stdout.readline().strip() == "done"
        t = time.process_time()
        while time.process_time() - t < 0.2:
            pass
        used = proc_cpu.used_since(before, os.getpid())
    finally:
        child.stdin.close()
        child.wait(10)
    assert set(used) == set(proc_cpu.KINDS)
    assert used["workers"] >= 0.25 and used["server"] >= 0.15


@pytest.mark.skipif(not os.path.isdir("/proc"), reason="reads Linux's /proc")
def test_a_process_that_exits_inside_the_window_counts_nothing_not_minus_its_lifetime():
    child = subprocess.Popen([sys.executable, "-c", _BUSY_CHILD], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                             text=True)
    assert child.stdout.readline().strip() == "done"
    before = proc_cpu.process_cpu(os.getpid())
    assert before[child.pid][0] == "workers" and before[child.pid][1] >= 0.25
    child.stdin.close()
    child.wait(10)
    assert 0.0 <= proc_cpu.used_since(before, os.getpid())["workers"] < 0.1


def test_update_rates():
    rates = bd.update_rates({"a": [[0, 1], [100, 2], [200, 3], [1000, 4]], "b": [[5, 1]], "c": []})
    assert rates["a"] == pytest.approx(3.0)          # 3 changes after the first, over 1 s
    assert math.isnan(rates["b"]) and math.isnan(rates["c"])


def test_group_throughput_uses_first_start_and_last_finish():
    runs = [{"id": "r1", "steps_done": 100, "started_at": 10.0, "finished_at": 12.0, "status": "finished"},
            {"id": "r2", "steps_done": 300, "started_at": 10.5, "finished_at": 14.0, "status": "finished"}]
    g = bd._group_throughput(runs)
    assert g["steps"] == 400 and g["wall_s"] == pytest.approx(4.0) and g["steps_per_s"] == pytest.approx(100.0)
    assert g["statuses"] == ["finished"] and g["ids"] == ["r1", "r2"]


def test_without_ste_only_blanks_the_estimator():
    cfg = bd._config(7).to_dict()
    other = json.loads(json.dumps(cfg))
    other["quant"]["ste"] = "tanh"
    assert bd._without_ste(cfg) == bd._without_ste(other)
    other["optim"]["epochs"] = 8
    assert bd._without_ste(cfg) != bd._without_ste(other)


def _get(base: str, path: str, timeout: float = 10) -> dict:
    return json.loads(urllib.request.urlopen(f"{base}{path}", timeout=timeout).read())


@pytest.fixture(scope="module")
def inspector():
    """The inspector served from this process; its base URL once it answers."""
    port = browser.free_port()
    bd.serve_inspector(port)
    base = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + 10
    while True:
        try:
            _get(base, "/state", timeout=5)
            return base
        except OSError:
            assert time.monotonic() < deadline, "inspector did not answer"
            time.sleep(0.1)


@pytest.mark.slow   # starts the inspector's HTTP server and its sampler in this process
def test_inspector_reports_state_and_samples(inspector):
    state = _get(inspector, "/state")
    assert {"time", "rss", "cpu_s", "runs", "threads", "dashboards"} <= set(state)
    assert state["rss"] > 0 and "qatlab-inspector" in state["threads"] and state["loop_cpu_s"] > 0
    assert state["cpu_s"] >= state["loop_cpu_s"] > 0            # the process's CPU includes its main thread's
    sample = _get(inspector, "/sample?seconds=0.2")
    assert sample["samples"] > 5 and sample["inclusive"] and sample["leaf"]
    assert any("test_inspector_reports_state" in name for name, _ in sample["inclusive"])   # this thread waits there
    kinds = dict(_get(inspector, "/objects?top=5000"))
    assert kinds["builtins.dict"] > 100 and kinds.get(f"{__name__}._Run", 0) == 0
    keep = [_Run(f"r{i}") for i in range(3)]                 # three more of a kind are counted
    assert dict(_get(inspector, "/objects?top=5000"))[f"{__name__}._Run"] == len(keep)


class _Run:
    """What the tracker reads of a RemoteRun: ids, progress, times, its MetricsLog, join()."""

    def __init__(self, rid, status="running"):
        import qatlab as ql
        self.id, self.name, self.owner, self.status, self.message, self.worker = rid, rid, "page", status, "", None
        self.steps_done, self.total_steps, self.started_at, self.finished_at = 5, 10, 1.0, None
        self.config = ql.ExperimentConfig()
        self.log = ql.MetricsLog()
        self.log.append({"step": 1, "loss": 0.5})
        self.ended = False

    def join(self, timeout=None):
        return self.ended


class _Dash:
    def __init__(self, live, current, comparison):
        self._live, self.current, self.comparison = live, current, comparison

    def live_runs(self):
        return list(self._live)


def test_run_tracker_follows_the_pages_runs_and_forgets_ended_objects(monkeypatch):
    import sys
    import types
    a, b, c, d = _Run("a"), _Run("b"), _Run("c"), _Run("d")
    stored = types.SimpleNamespace(id="stored-1")         # a stored run shown from the Runs tab: not tracked
    dash = _Dash([a], stored, {"identity": b, "tanh": c})
    ui = types.SimpleNamespace(DASHBOARDS=[dash])
    monkeypatch.setitem(sys.modules, "qatlab.ui.dashboard", ui)
    monkeypatch.setattr("qatlab.executor.remote.active_runs", lambda: [d])
    tracker = bd._RunTracker()
    runs = {r["id"]: r for r in tracker.dicts()}
    assert set(runs) == {"a", "b", "c", "d"}
    assert runs["a"]["log_rows"] == 1 and runs["a"]["config"]["optim"]["epochs"] == a.config.optim.epochs
    assert [r["id"] for r in tracker.dicts(ids={"b"}, config=False)] == ["b"]
    assert "config" not in tracker.dicts(ids={"b"}, config=False)[0]
    # a run ends and every page drops it: its last dict stays, the object is no longer held
    b.ended, b.status, b.finished_at = True, "finished", 2.0
    dash.comparison = {"identity": c}
    assert {r["id"]: r["status"] for r in tracker.dicts()}["b"] == "finished"
    assert "b" not in tracker._live and tracker._ended["b"]["finished_at"] == 2.0
    b.status = "changed after"                              # a frozen dict does not follow the object
    frozen = {r["id"]: r for r in tracker.dicts()}["b"]
    assert frozen["status"] == "finished" and frozen["config"] == b.config.to_dict()   # (kept as JSON text)
    assert "config" not in tracker.dicts(ids={"b"}, config=False)[0]


@pytest.mark.slow
def test_inspector_trains_a_headless_comparison_on_the_cluster(inspector, client2, monkeypatch):
    """``/headless``: four RemoteRuns (one per STE kind) on the Dask client, no page; tracked afterwards."""
    import qatlab.executor
    monkeypatch.setattr(qatlab.executor, "connect", lambda: client2)
    runs = _get(inspector, "/headless?epochs=1", timeout=180)["runs"]
    assert len(runs) == 4 and {r["status"] for r in runs} == {"finished"}
    assert sorted(r["config"]["quant"]["ste"] for r in runs) == ["clipped_identity", "hard_tanh", "identity", "tanh"]
    assert all(r["steps_done"] == bd.STEPS_PER_EPOCH and r["owner"] == "bench-headless" for r in runs)
    assert all(r["worker"] and r["finished_at"] > r["started_at"] for r in runs)
    ids = {r["id"] for r in _get(inspector, "/state")["runs"]}
    assert {r["id"] for r in runs} <= ids
    two = sorted(r["id"] for r in runs)[:2]
    light = _get(inspector, f"/state?config=0&ids={','.join(two)}")
    assert sorted(r["id"] for r in light["runs"]) == two and all("config" not in r for r in light["runs"])


# ----------------------------------------------------------------------------- the whole suite, faked


class _FakeServer:
    url = "http://localhost:1/app"
    probe_url = "http://localhost:1/static/x.css"
    env: dict = {}

    def __init__(self, *a, **k):
        _FakeServer.env = dict(k.get("env") or {})

    def start(self):
        return self

    def stop(self):
        pass

    def log_tail(self, lines=40):
        return ""


class _FakePlaywright:
    def __enter__(self):
        return self

    def __exit__(self, *exc):
        return False


class _FakeBrowser:
    def close(self):
        pass


def _fake_parts(monkeypatch, *, page_rate: float, rss_hi: int, probe_max: float, diverged: bool,
                cpu: float = 0.1, click: float = 0.2, stop: float = 0.4, runs_growth_mib: float = 2.0,
                hi_status: str = "running"):
    pytest.importorskip("playwright.sync_api")
    import playwright.sync_api as pw_api

    monkeypatch.setattr(bd, "browser_unavailable", lambda: None)
    monkeypatch.setattr(pw_api, "sync_playwright", lambda: _FakePlaywright())
    monkeypatch.setattr(bd, "launch_chromium", lambda pw: _FakeBrowser())
    monkeypatch.setattr(bd, "AppServer", _FakeServer)
    head = {"steps": 5520, "wall_s": 2.0, "steps_per_s": 2760.0, "statuses": ["finished"], "ids": [],
            "cpu_by_kind": {"workers": 13.0, "server": 0.7, "renderer": 0.0, "browser": 0.01}}
    calls = []
    monkeypatch.setattr(bd, "_headless_four",
                        lambda server, epochs, kind="digits": calls.append(("headless", epochs, kind)) or dict(head))
    rates = {f"loss-source-run-000{i}": 8.0 + i for i in range(4)}

    def page_four(browser, server, epochs, timeout, kind="digits"):
        calls.append(("page", epochs, kind))
        rate = page_rate if kind == "digits" else page_rate / 2    # the CNN's rounds: a different ratio
        return {**head, "steps_per_s": rate, "wall_s": 5520 / rate, "rates": rates, "sources": 4,
                "page_status": "finished", "same_config": True, "console_errors": [], "loop_cpu_s": 0.1,
                "cpu_s": cpu * 2.0, "cpu_wall_s": 2.0,
                "cpu_by_kind": {"workers": 13.2, "server": 1.4, "renderer": 2.0, "browser": 0.31}}
    monkeypatch.setattr(bd, "_page_four", page_four)
    monkeypatch.setattr(bd, "_memory", lambda browser, server, lo, hi, timeout: {
        "points": {"lo": {"steps": lo, "rss": 300 * 2**20, "log_nbytes": 2**20, "status": "running"},
                   "hi": {"steps": hi, "rss": rss_hi, "log_nbytes": 7 * 2**20, "status": hi_status}},
        "samples": [], "page_rows": 1200, "run": "run-0009", "status": "stopped", "log_rows": hi,
        "seconds": 1.0, "console_errors": []})
    monkeypatch.setattr(bd, "_finished_runs_memory", lambda browser, server, n, warm, timeout: {
        "n": n, "warm": warm, "statuses": {"finished": n + warm}, "seconds": 60.0, "rss_before": 500 * 2**20,
        "rss_after": int((500 + runs_growth_mib) * 2**20), "console_errors": []})
    none = {"dashboards": [], "threads": [], "active": []}
    monkeypatch.setattr(bd, "_sessions", lambda browser, server, n, epochs, timeout: {
        "n": n, "runs": 4 * n, "load_s": 3.0, "train_s": 2.0, "page_catchup_s": 4.0, "pages_finished": n,
        "page_status": ["finished"] * n, "run_statuses": ["finished"], "console_errors": [], "cleanup_s": 21.0,
        "left": none, "cleanup_ok": True, "midrun_stop_s": stop, "midrun_cleanup_s": stop + 0.3,
        "midrun_statuses": ["stopped"], "click_response_s": [click / 2] * (n - 1) + [click],
        "click_response_max_s": click,
        "midrun_left": none, "midrun_ok": True, "probes": 100, "probes_failed": 0, "probe_max_s": probe_max,
        "probe_p50_s": 0.01, "slow_probes": [{"phase": "runs training"}] if probe_max >= 2 else [],
        "phases_s": {}})
    mse = {"run": "run-0002", "server_status": "diverged" if diverged else "finished",
           "page_status": "diverged" if diverged else "finished", "alert": "x", "message": ""}
    monkeypatch.setattr(bd, "_divergence", lambda browser, server: {
        "ce": {"run": "run-0001", "server_status": "finished", "page_status": "finished"}, "mse": mse,
        "after": {"run": "run-0003", "server_status": "finished", "page_status": "finished"},
        "http_after": 200, "traceback_in_page": False, "console_errors": []})
    return calls


def _run(tmp_path, opts):
    out = tmp_path / "dashboard.json"
    stream = io.StringIO()
    result = bench.run_suite("dashboard", opts, out, stream=stream)
    return result, json.loads(out.read_text()), stream.getvalue()


# Each goal of the suite, found by words of its name: the tests compare verdicts, not report text.
GOALS = {"throughput": "headless steps/s", "updates": "updates/s", "server_cpu": "CPU",
         "memory": "logged steps", "runs_memory": "finished runs", "probes": "every probe",
         "finish": "sees its runs finish", "cleanup": "nothing left running", "click": "click-to-response",
         "closed": "closed mid-comparison", "divergence": "diverging"}


def _verdicts(result) -> dict:
    """``{key of GOALS: the Goal's passed flag}``; every goal has exactly one key."""
    out = {}
    for key, words in GOALS.items():
        (goal,) = [g for g in result.goals if words in g.name]
        out[key] = goal.passed
    assert len(result.goals) == len(GOALS)
    return out


TABLE_KINDS = {"ratio": "throughput", "renderer": "cpu", "rss_mib": "memory", "per_run_kib": "runs_memory",
               "midrun_stop_s": "sessions", "server_status": "divergence"}


def _kind(table: dict) -> str:
    """What a table of the suite holds, known by a column key of its rows (not by its title)."""
    (kind,) = [v for k, v in TABLE_KINDS.items() if k in {c["key"] for c in table["columns"]}]
    return kind


def _tables(payload) -> dict:
    """``{kind: [tables of that kind, in order]}``."""
    out = {}
    for t in payload["tables"]:
        out.setdefault(_kind(t), []).append(t)
    return out


def test_suite_structure_all_pass(monkeypatch, tmp_path):
    calls = _fake_parts(monkeypatch, page_rate=2500.0, rss_hi=310 * 2**20, probe_max=0.5, diverged=True)
    result, payload, text = _run(tmp_path, QUICK)
    assert payload["suite"] == "dashboard" and payload["extra"]["params"] == bd.QUICK
    # the server keeps the bench's runs in a temporary store, never the user's
    assert "qatlab-bench-dashboard-" in _FakeServer.env["QATLAB_STORE"]
    assert [_kind(t) for t in payload["tables"]] == ["throughput", "cpu", "throughput", "cpu", "memory",
                                                     "runs_memory", "sessions", "divergence"]
    assert all("[quick]" in t["title"] for t in payload["tables"][:7])          # --quick results are labelled
    tables = _tables(payload)

    # (a) throughput, the digits MLP: 2500 steps/s with the page vs 2760 headless
    digits, cnn = tables["throughput"]
    (row,) = digits["rows"]
    assert row["ratio"] == pytest.approx(2500 / 2760) and row["updates_min"] == pytest.approx(8.0)
    assert row["updates_median"] == pytest.approx(9.5) and row["server_cpu"] == pytest.approx(0.1)
    assert row["page_wall_s"] == pytest.approx(5520 / 2500) and row["headless_wall_s"] == pytest.approx(2.0)
    assert row["loop_cpu_pct"] == pytest.approx(100 * 0.1 / (5520 / 2500))
    # where the CPU went: the page's extra = its server's growth + the renderer + the rest of the browser
    (cpu_row,) = tables["cpu"][0]["rows"]
    assert (cpu_row["workers_h"], cpu_row["workers_p"], cpu_row["renderer"]) == pytest.approx((13.0, 13.2, 2.0))
    assert cpu_row["extra"] == pytest.approx((1.4 - 0.7) + 2.0 + (0.31 - 0.01))
    # the CNN rounds: after a warm-up, headless and page rounds of the page's default experiment; no goal
    assert calls.count(("headless", 1, "cnn")) == 2 and calls.count(("page", 1, "cnn")) == 1
    assert calls.count(("page", bd.QUICK["epochs"], "digits")) == 1
    (cnn_row,) = cnn["rows"]
    assert cnn_row["ratio"] == pytest.approx(1250 / 2760) and cnn_row["ratio"] < bd.GOAL_RATIO   # no goal counts it
    assert payload["extra"]["cnn_rounds"] == cnn["rows"]
    # (a) memory: 300 -> 310 MiB over the logged steps (+3.3%); 2.0 MiB growth over the finished runs
    mem = {r["point"]: r for r in tables["memory"][0]["rows"]}
    assert (mem["lo"]["logged_steps"], mem["hi"]["logged_steps"]) == (bd.QUICK["mem_lo"], bd.QUICK["mem_hi"])
    assert (mem["lo"]["rss_mib"], mem["hi"]["rss_mib"]) == pytest.approx((300.0, 310.0))
    (runs_mem,) = tables["runs_memory"][0]["rows"]
    assert runs_mem["runs"] == bd.QUICK["runs_n"] and runs_mem["growth"] == pytest.approx(2.0)
    assert runs_mem["per_run_kib"] == pytest.approx(1024 * 2.0 / bd.QUICK["runs_n"])
    # (b) sessions and (c) divergence
    (ses,) = tables["sessions"][0]["rows"]
    assert (ses["n"], ses["runs"], ses["left_n"]) == (bd.QUICK["sessions"], 4 * bd.QUICK["sessions"], 0)
    assert (ses["probe_max_s"], ses["click_response_max_s"], ses["midrun_stop_s"]) == pytest.approx((0.5, 0.2, 0.4))
    assert [r["server_status"] for r in tables["divergence"][0]["rows"]] == ["finished", "diverged", "finished"]

    assert _verdicts(result) == dict.fromkeys(GOALS, True)
    assert [g["passed"] for g in payload["goals"]] == [g.passed for g in result.goals]
    assert all("[quick]" in g.name for g in result.goals[:9])
    assert all(g.name in text for g in result.goals)                 # the report lists every goal


def test_suite_reports_misses_honestly(monkeypatch, tmp_path):
    _fake_parts(monkeypatch, page_rate=1000.0, rss_hi=400 * 2**20, probe_max=9.0, diverged=False,
                cpu=0.4, click=0.8, stop=1.5, runs_growth_mib=30.0)
    result, payload, text = _run(tmp_path, BenchOptions(repeats=1, warmup=0, min_time=0.0))
    tables = _tables(payload)
    digits, cnn = tables["throughput"]
    assert len(digits["rows"]) == bd.FULL["rounds"] and len(cnn["rows"]) == bd.FULL["cnn_rounds"]
    assert all(r["ratio"] == pytest.approx(1000 / 2760) for r in digits["rows"])        # 36% of headless
    assert all(r["server_cpu"] == pytest.approx(0.4) for r in digits["rows"])
    mem = {r["point"]: r for r in tables["memory"][0]["rows"]}
    assert mem["hi"]["rss_mib"] / mem["lo"]["rss_mib"] == pytest.approx(400 / 300)      # +33%
    assert tables["runs_memory"][0]["rows"][0]["growth"] == pytest.approx(30.0)
    (ses,) = tables["sessions"][0]["rows"]
    assert ses["n"] == bd.FULL["sessions"] and ses["probes_failed"] == 0 and ses["probe_max_s"] == pytest.approx(9.0)
    assert [p["phase"] for p in ses["slow_probes"]] == ["runs training"]              # when the slow probes came
    assert (ses["click_response_max_s"], ses["midrun_stop_s"]) == pytest.approx((0.8, 1.5))
    assert tables["divergence"][0]["rows"][1]["server_status"] == "finished"          # mse run did not diverge
    # every goal whose number is past its threshold is a MISS, the others still PASS
    assert _verdicts(result) == {**dict.fromkeys(GOALS, False), "updates": True, "finish": True, "cleanup": True}
    assert [g["status"] for g in payload["goals"]] == [g.status for g in result.goals]
    assert "[quick]" not in text                                   # a full run is not labelled quick


def test_memory_read_after_the_run_ended_has_no_verdict(monkeypatch, tmp_path):
    # a run that ends merges its stored rows (a transient the size of its history): not what the goal measures
    _fake_parts(monkeypatch, page_rate=2500.0, rss_hi=400 * 2**20, probe_max=0.5, diverged=True, hi_status="finished")
    result, _, _ = _run(tmp_path, QUICK)
    (goal,) = [g for g in result.goals if GOALS["memory"] in g.name]
    assert goal.passed is None and "ended" in goal.measured


def test_a_page_that_never_responded_is_a_miss(monkeypatch, tmp_path):
    _fake_parts(monkeypatch, page_rate=2500.0, rss_hi=310 * 2**20, probe_max=0.5, diverged=True)
    sessions = bd._sessions

    def one_page_silent(browser, server, n, epochs, timeout):
        out = sessions(browser, server, n, epochs, timeout)
        return {**out, "click_response_s": [0.1] * (n - 1) + [None], "click_response_max_s": math.nan}
    monkeypatch.setattr(bd, "_sessions", one_page_silent)
    result, payload, text = _run(tmp_path, QUICK)
    clicks = payload["extra"]["sessions"]["click_response_s"]
    assert len(clicks) == bd.QUICK["sessions"] and sum(c is not None for c in clicks) == 3
    assert max(c for c in clicks if c is not None) < bd.GOAL_CLICK_S      # the three that answered were quick
    assert _verdicts(result) == {**dict.fromkeys(GOALS, True), "click": False}


def test_bench_config_kinds():
    digits, cnn = bd.bench_config(7), bd.bench_config(3, kind="cnn")
    assert digits.to_dict() == bd._config(7).to_dict()
    assert (digits.data.dataset, digits.model.architecture, digits.optim.epochs) == ("digits", "mlp", 7)
    assert (cnn.data.dataset, cnn.model.architecture, cnn.optim.epochs) == ("mnist", "cnn", 3)
    assert bd.bench_config(2, metrics_every=1).metrics_every == 1
    with pytest.raises(ValueError, match="kind"):
        bd.bench_config(1, kind="resnet")


class _RecordingPage:
    def __init__(self):
        self.done = []

    def select(self, label, option):
        self.done.append((label, str(option)))

    def set_input(self, label, value):
        self.done.append((label, str(value)))


def test_set_page_config_types_the_bench_config():
    """The page's default is the mnist CNN: the bench types every field where the digits MLP differs."""
    import qatlab as ql

    page = _RecordingPage()
    bd.set_page_config(page, 12)
    typed = dict(page.done)
    cfg, default = bd.bench_config(12), ql.dashboard_config()
    assert typed == {"Dataset": "digits", "Architecture": "mlp", "Hidden sizes (list)": "256",
                     "Metrics every (steps)": "10", "Epochs": "12"}
    diff = {k for k, v in cfg.to_dict().items() if v != default.to_dict()[k]}
    assert diff == {"data", "model", "optim", "metrics_every"}   # each of them typed above
    page = _RecordingPage()
    bd.set_page_config(page, 2, kind="cnn")
    assert dict(page.done) == {"Dataset": "mnist", "Architecture": "cnn", "Metrics every (steps)": "5", "Epochs": "2"}
