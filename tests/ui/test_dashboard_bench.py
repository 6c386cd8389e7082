"""The ``dashboard`` benchmark suite's structure, without a browser (quick).

The measuring functions that need chromium are replaced by canned results, so what is checked
here is the suite's own logic: tables, goal names and PASS/MISS decisions, labels of --quick,
JSON output, and the server-side inspector (run in this process on a tiny comparison).
"""
from __future__ import annotations

import io
import json
import math
import time
import urllib.request

import pytest

from qatlab import bench, bench_dashboard as bd
from qatlab.benchkit import BenchOptions, SuiteNotAvailable, load_suite

QUICK = BenchOptions(quick=True, repeats=1, warmup=0, min_time=0.0)


def test_suite_registered():
    assert load_suite("dashboard").fn is bd.run


def test_unavailable_without_chromium(monkeypatch):
    monkeypatch.setattr(bd, "CHROMIUM", "/nonexistent/chromium")
    assert "chromium not found" in bd.browser_unavailable()
    with pytest.raises(SuiteNotAvailable, match="chromium"):
        bd.run(QUICK)


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


def test_inspector_reports_runs_and_trains_headless():
    port = bd.free_port()
    bd.serve_inspector(port)
    base = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + 10
    while True:
        try:
            state = json.loads(urllib.request.urlopen(f"{base}/state", timeout=5).read())
            break
        except OSError:
            assert time.monotonic() < deadline, "inspector did not answer"
            time.sleep(0.1)
    assert {"time", "rss", "runs", "threads", "dashboards"} <= set(state)
    assert state["rss"] > 0 and "qatlab-inspector" in state["threads"] and state["loop_cpu_s"] > 0
    sample = json.loads(urllib.request.urlopen(f"{base}/sample?seconds=0.2", timeout=10).read())
    assert sample["samples"] > 5 and sample["inclusive"] and sample["leaf"]
    assert any("test_inspector_reports_runs" in name for name, _ in sample["inclusive"])   # this thread waits there
    out = json.loads(urllib.request.urlopen(f"{base}/headless?epochs=1", timeout=120).read())
    runs = out["runs"]
    assert len(runs) == 4 and {r["status"] for r in runs} == {"finished"}
    assert sorted(r["config"]["quant"]["ste"] for r in runs) == ["clipped_identity", "hard_tanh", "identity", "tanh"]
    assert all(r["steps_done"] == bd.STEPS_PER_EPOCH and r["owner"] == "bench-headless" for r in runs)
    ids = {r["id"] for r in json.loads(urllib.request.urlopen(f"{base}/state", timeout=5).read())["runs"]}
    assert {r["id"] for r in runs} <= ids
    two = sorted(r["id"] for r in runs)[:2]
    light = json.loads(urllib.request.urlopen(f"{base}/state?config=0&ids={','.join(two)}", timeout=5).read())
    assert sorted(r["id"] for r in light["runs"]) == two and all("config" not in r for r in light["runs"])


# ----------------------------------------------------------------------------- the whole suite, faked


class _FakeServer:
    url = "http://localhost:1/app"
    probe_url = "http://localhost:1/static/x.css"

    def __init__(self, *a, **k):
        pass

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


def _fake_parts(monkeypatch, *, page_rate: float, rss_hi: int, probe_max: float, diverged: bool):
    pytest.importorskip("playwright.sync_api")
    import playwright.sync_api as pw_api

    monkeypatch.setattr(bd, "browser_unavailable", lambda: None)
    monkeypatch.setattr(pw_api, "sync_playwright", lambda: _FakePlaywright())
    monkeypatch.setattr(bd, "launch_chromium", lambda pw: _FakeBrowser())
    monkeypatch.setattr(bd, "AppServer", _FakeServer)
    head = {"steps": 5520, "wall_s": 2.0, "steps_per_s": 2760.0, "statuses": ["finished"], "ids": []}
    calls = []
    monkeypatch.setattr(bd, "_headless_four",
                        lambda server, epochs, kind="digits": calls.append(("headless", epochs, kind)) or dict(head))
    rates = {f"loss-source-run-000{i}": 8.0 + i for i in range(4)}

    def page_four(browser, server, epochs, timeout, kind="digits"):
        calls.append(("page", epochs, kind))
        rate = page_rate if kind == "digits" else page_rate / 2    # the CNN's rounds: a different ratio
        return {**head, "steps_per_s": rate, "wall_s": 5520 / rate, "rates": rates, "sources": 4,
                "page_status": "finished", "same_config": True, "console_errors": []}
    monkeypatch.setattr(bd, "_page_four", page_four)
    monkeypatch.setattr(bd, "_memory", lambda browser, server, lo, hi, timeout: {
        "points": {"lo": {"steps": lo, "rss": 300 * 2**20, "log_nbytes": 2**20},
                   "hi": {"steps": hi, "rss": rss_hi, "log_nbytes": 7 * 2**20}},
        "samples": [], "page_rows": 1200, "run": "run-0009", "status": "stopped", "log_rows": hi,
        "seconds": 1.0, "console_errors": []})
    none = {"dashboards": [], "threads": [], "active": []}
    monkeypatch.setattr(bd, "_sessions", lambda browser, server, n, epochs, timeout: {
        "n": n, "runs": 4 * n, "load_s": 3.0, "train_s": 2.0, "page_catchup_s": 4.0, "pages_finished": n,
        "page_status": ["finished"] * n, "run_statuses": ["finished"], "console_errors": [], "cleanup_s": 21.0,
        "left": none, "cleanup_ok": True, "midrun_stop_s": 21.5, "midrun_statuses": ["stopped"],
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


def test_suite_structure_all_pass(monkeypatch, tmp_path):
    calls = _fake_parts(monkeypatch, page_rate=2500.0, rss_hi=310 * 2**20, probe_max=0.5, diverged=True)
    result, payload, text = _run(tmp_path, QUICK)
    assert payload["suite"] == "dashboard"
    titles = [t["title"] for t in payload["tables"]]
    assert len(titles) == 5
    assert titles[0].startswith("(a) four STE runs") and "CNN" not in titles[0]
    assert titles[1].startswith("(a) four STE runs") and "default CNN on mnist (1 epochs; informational)" in titles[1]
    assert titles[2].startswith("(a) server memory")
    assert titles[3].startswith("(b) 4 concurrent sessions") and titles[4].startswith("(c) divergence")
    assert all("[quick]" in t for t in titles[:4])
    # the CNN rounds: after a warm-up, headless and page rounds of the page's default experiment; no goal
    assert calls.count(("headless", 1, "cnn")) == 2 and calls.count(("page", 1, "cnn")) == 1
    assert calls.count(("page", bd.QUICK["epochs"], "digits")) == 1
    cnn_note = next(n for n in payload["notes"] if "default CNN" in n)
    assert "not a goal" in cnn_note and "45.3%" in cnn_note and len(payload["extra"]["cnn_rounds"]) == 1
    goals = payload["goals"]
    assert len(goals) == 8
    assert all(g["status"] == "PASS" for g in goals), [g for g in goals if g["status"] != "PASS"]
    assert all("[quick]" in g["name"] for g in goals[:6])
    row = payload["tables"][0]["rows"][0]
    assert row["ratio"] == pytest.approx(2500 / 2760) and row["updates_min"] == pytest.approx(8.0)
    assert "PASS  four runs streaming to one page keep >= 80% of headless steps/s [quick]" in text
    assert payload["extra"]["params"] == bd.QUICK


def test_suite_reports_misses_honestly(monkeypatch, tmp_path):
    _fake_parts(monkeypatch, page_rate=1000.0, rss_hi=400 * 2**20, probe_max=9.0, diverged=False)
    result, payload, text = _run(tmp_path, BenchOptions(repeats=1, warmup=0, min_time=0.0))
    by = {g["name"].split(":")[0]: g for g in payload["goals"]}
    assert by["four runs streaming to one page keep >= 80% of headless steps/s"]["status"] == "MISS"
    assert "36.2%" in by["four runs streaming to one page keep >= 80% of headless steps/s"]["measured"]
    assert by["server memory flat within 10% from 10k to 100k logged steps"]["status"] == "MISS"
    probe = next(g for g in payload["goals"] if "answers every probe" in g["name"])
    assert probe["status"] == "MISS" and "runs training" in probe["measured"] and probe["name"].startswith("8 sessions")
    div = next(g for g in payload["goals"] if "diverging" in g["name"])
    assert div["status"] == "MISS"
    assert "[quick]" not in text
    assert len(payload["tables"][0]["rows"]) == bd.FULL["rounds"]
    assert len(payload["tables"][1]["rows"]) == bd.FULL["cnn_rounds"]


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
