"""Issue #21's page rough edges: paused time outside the ETA, Start keeping the current tab, the
STE summary rows refreshed with the curves, and the Runs table's quantization columns and CSV."""
from __future__ import annotations

import math
import time

import pytest

import qatlab as ql
from qatlab import progress as progress_mod
from qatlab.progress import RunProgress


class Clock:
    def __init__(self, now: float):
        self.now = now

    def __call__(self) -> float:
        return self.now


class Progress(RunProgress):
    def __init__(self, started_at=None, finished_at=None, steps_done=0, total_steps=100):
        self.started_at, self.finished_at = started_at, finished_at
        self.steps_done, self.total_steps = steps_done, total_steps


@pytest.fixture
def clock(monkeypatch):
    c = Clock(100.0)
    monkeypatch.setattr(progress_mod.time, "time", c)
    return c


def test_paused_time_is_not_elapsed_and_the_eta_holds_still(clock):
    p = Progress(started_at=100.0, steps_done=10)
    clock.now = 110.0
    assert p.elapsed == pytest.approx(10.0) and p.eta == pytest.approx(90 * 10 / 10)
    p._pause_began()
    clock.now = 500.0                               # paused for a long time
    assert p.elapsed == pytest.approx(10.0) and p.eta == pytest.approx(90.0)
    p._pause_began()                                # a second pause call keeps the first time
    p._pause_ended()
    assert p.paused_seconds == pytest.approx(390.0) and p.paused_since is None
    p._pause_ended()                                # resume without pause: no change
    clock.now = 505.0
    p.steps_done = 15
    assert p.elapsed == pytest.approx(15.0) and p.steps_per_second == pytest.approx(1.0)
    assert p.eta == pytest.approx(85.0)


def test_a_run_ending_while_paused_counts_up_to_the_pause(clock):
    p = Progress(started_at=100.0, steps_done=5)
    clock.now = 120.0
    p._pause_began()
    p.finished_at = 200.0                           # stopped while paused
    clock.now = 900.0
    assert p.elapsed == pytest.approx(20.0)


def test_no_pause_calls_means_no_paused_time(clock):
    p = Progress(started_at=100.0, finished_at=130.0, steps_done=30, total_steps=30)
    assert p.paused_seconds == 0.0 and p.elapsed == pytest.approx(30.0) and p.eta == 0.0
    assert math.isnan(Progress(started_at=None).eta) and Progress().elapsed == 0.0


def _wait_for(pred, timeout=20.0, what="condition"):
    end = time.monotonic() + timeout
    while not pred():
        assert time.monotonic() < end, f"timed out waiting for {what}"
        time.sleep(0.005)


@pytest.mark.slow
def test_a_paused_run_does_not_age():
    cfg = ql.ExperimentConfig(data=ql.DataConfig(dataset="digits"), model=ql.ModelConfig(hidden=[32]),
                              optim=ql.OptimConfig(epochs=100_000, batch_size=32), metrics_every=5)
    run = ql.LocalRun(cfg, register=False).start()
    try:
        _wait_for(lambda: run.steps_done > 3, what="steps")
        run.pause()
        assert run.paused_since is not None
        frozen = run.elapsed
        t0 = time.time()
        _wait_for(lambda: time.time() - t0 > 0.3, what="time to pass")
        assert run.elapsed == pytest.approx(frozen, abs=1e-6)   # a pause is not running time
        run.resume()
        assert run.paused_since is None and run.paused_seconds >= 0.3
        _wait_for(lambda: run.elapsed > frozen + 0.05, what="elapsed to grow after resume")
    finally:
        run.stop()
        run.join(20)


# ----------------------------------------------------------------------------- Start keeps the tab

@pytest.mark.slow
@pytest.mark.filterwarnings("ignore:The inplace keyword")
@pytest.mark.parametrize("tab", [0, 2, 3, 4])
def test_start_keeps_the_current_tab(tab, client2):
    pytest.importorskip("panel")
    from qatlab.ui import Dashboard
    cfg = ql.ExperimentConfig()
    cfg.model.hidden = [32]
    cfg.optim.epochs = 10_000
    dash = Dashboard(config=cfg, period=0, client=client2)
    dash.tabs.active = tab
    try:
        run = dash.start_run()
        assert run is not None and dash.tabs.active == tab and dash.overview.run is run
    finally:
        dash.close(join_timeout=30)


# ----------------------------------------------------------------------------- STE summary rows

def _feed(run, start: int, n: int) -> None:
    for s in range(start, start + n):
        run.log.append({"step": s, "epoch": s / 50, "time": 0.01 * s, "loss": 1.0, "lr": 0.01,
                        "steps_per_second": 100.0, "active_grad_fraction": 0.7})


@pytest.mark.filterwarnings("ignore:The inplace keyword")
def test_ste_table_follows_the_curves_on_the_same_tick():
    pytest.importorskip("panel")
    from qatlab.ui import SteCompareView
    cfg = ql.ExperimentConfig()
    cfg.model.hidden = [32]
    runs = {kind: ql.LocalRun(cfg, name=kind.value, register=False) for kind in ql.SteKind}
    view = SteCompareView(runs)
    for run in runs.values():
        run.status = "running"
    view.refresh(force=True)                    # empty curves: 0 steps, no accuracy
    assert list(view.summary["steps"]) == [0, 0, 0, 0] and "running" in view.table.object
    for run in runs.values():                   # well within the table's throttle period
        _feed(run, 1, 12)
        run.steps_done = 12
    view.hub.pull()
    view.refresh()                              # the tick that draws the first points
    assert all(len(view.hub.stream(r).loss.data["step"]) == 12 for r in runs.values())
    assert list(view.summary["steps"]) == [12, 12, 12, 12]
    for i, run in enumerate(runs.values()):
        run.log.append({"step": 12, "epoch": 0.2, "time": 0.12, "test_loss": 0.5, "test_accuracy": 0.5 + 0.1 * i})
    view.hub.pull()
    view.refresh()                              # the first eval point: accuracy and ranking at once
    assert view.summary["test_accuracy"].notna().all() and view.summary["ste"].iloc[0] == list(runs)[-1].value
    for run in runs.values():
        run.steps_done = 13                     # no new curve point: the throttle holds
    view.refresh()
    assert list(view.summary["steps"]) == [12, 12, 12, 12]
    for run in runs.values():
        run.status = "finished"                 # a status change shows on the same tick
    view.refresh()
    assert set(view.summary["status"]) == {"finished"} and list(view.summary["steps"]) == [13, 13, 13, 13]


# ----------------------------------------------------------------------------- Runs table

def _quant(weights="ternary", bits=4, activations="off", per_channel=False, scale_mode="observer", batch=64):
    cfg = ql.ExperimentConfig()
    cfg.quant.weights, cfg.quant.weight_bits, cfg.quant.activations = weights, bits, activations
    cfg.quant.per_channel, cfg.quant.scale_mode, cfg.optim.batch_size = per_channel, scale_mode, batch
    return cfg


def test_runs_csv_writes_counts_as_integers():
    pytest.importorskip("panel")
    from qatlab.ui.runs_table import runs_csv
    a, b = ql.LocalRun(_quant(), name="a", register=False), ql.LocalRun(_quant(), name="b", register=False)
    for s in (1, 2):
        a.log.append({"step": s, "epoch": s / 4, "loss": 1.0, "phase": 2})
    b.log.append({"step": 3, "epoch": 1.0, "loss": 0.5, "phase": float("inf")})
    lines = runs_csv([a, b]).splitlines()
    assert lines[0] == "run_id,name,row_id,step,epoch,loss,phase"
    assert lines[1] == f"{a.id},a,0,1,0.25,1.0,2"
    assert lines[3] == f"{b.id},b,0,3,1.0,0.5,inf"


def test_runs_legend_says_name_weights_bits_and_ste():
    pytest.importorskip("panel")
    from qatlab.ui.runs_table import run_label
    fake = _quant("fake", 3, "fake")
    fake.quant.ste = "tanh"
    assert run_label(ql.LocalRun(fake, name="mine", register=False)) == "mine: fake 3-bit, act 8-bit, STE tanh"
    assert run_label(ql.LocalRun(_quant("ternary"), name="t", register=False)) == "t: ternary, STE identity"


# ----------------------------------------------------------------------------- in the browser

def _tab(dash, name: str) -> None:
    import re
    dash.page.locator(".bk-tab").filter(has_text=re.compile(f"^{name}$")).first.click()
    _wait_for(lambda: _active_tab(dash) == name, 10, f"tab {name} active")


def _active_tab(dash) -> str:
    return " ".join(dash.page.locator(".bk-tab.bk-active").first.inner_text().split())


@pytest.mark.browser
@pytest.mark.slow
def test_runs_tab_first_visited_after_a_run_and_start_keeping_the_tab(chromium, app_server):
    from qatlab.bench.browser import DashboardPage
    context = chromium.new_context(viewport={"width": 1400, "height": 900})
    try:
        dash = DashboardPage(context.new_page(), app_server.url)
        warnings = []
        dash.page.on("console", lambda m: warnings.append(m.text) if m.type == "warning" else None)
        dash.open(timeout=90)
        dash.click("Start")
        dash.wait_status(lambda s: s.startswith(("finished", "stopped", "diverged", "failed")), 120, "ended")
        _tab(dash, "Runs")                          # first visit, after the table got its first row
        rows = dash.page.locator(".qatlab-runs-table .tabulator-row")
        _wait_for(lambda: rows.count() >= 1, 20, "a row in the Runs table")
        _tab(dash, "Phases")
        dash.click("Start")
        dash.wait_status(lambda s: s.startswith("running") or s.startswith("finished"), 60, "the second run")
        assert _active_tab(dash) == "Phases"        # Start keeps the current tab
        dash.click("Stop")
        assert dash.console_errors == [] and warnings == []
    finally:
        context.close()
