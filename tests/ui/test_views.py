"""qatlab.ui views without a server: build, feed MetricsLog rows, pull once, check sources and figures."""
from __future__ import annotations

import math
import time

import numpy as np
import pytest

pn = pytest.importorskip("panel")

import qatlab as ql  # noqa: E402
from bokeh.models import LogScale, VStrip  # noqa: E402
from qatlab.ui.phase_view import history_text  # noqa: E402
from qatlab.ui import (ConfigPanel, Dashboard, PhaseView, QuantView, RunView,  # noqa: E402
                       SteCompareView, StreamHub)
from qatlab.store import RunStore  # noqa: E402
from qatlab.ui.base import short_message  # noqa: E402
from qatlab.ui.quant_view import histogram, level_bars  # noqa: E402
from qatlab.ui.run_view import RunStatus, format_seconds, group_status  # noqa: E402
from qatlab.ui.streaming import ema, train_columns  # noqa: E402
from qatlab.ui.ste_compare import summary_frame  # noqa: E402

pytestmark = pytest.mark.filterwarnings("ignore:The inplace keyword")  # bokeh + pandas 3.1, in Tabulator


def small_config(phase: bool = False, epochs: int = 2) -> ql.ExperimentConfig:
    cfg = ql.ExperimentConfig()
    cfg.model.hidden = [32]
    cfg.optim.epochs = epochs
    cfg.phase.enabled = phase
    return cfg


@pytest.fixture
def server_doc(monkeypatch):
    """``server_doc()`` from then on makes ``in_server_session()`` True and returns (doc, scheduled): a
    Document standing in for the session, whose ``add_next_tick_callback`` only records callbacks."""
    from bokeh.document import Document
    from qatlab.ui import base

    def enter():
        scheduled = []
        doc = Document()
        monkeypatch.setattr(doc, "add_next_tick_callback", scheduled.append)
        monkeypatch.setattr(base, "in_server_session", lambda: True)
        return doc, scheduled
    return enter


def comparison_view() -> SteCompareView:
    """An STE comparison view of four unstarted 1-epoch runs, built at once (no server session yet)."""
    cfg = ql.ExperimentConfig()
    cfg.optim.epochs = 1
    view = SteCompareView()
    view.runs = ql.start_ste_comparison(cfg, start=False)
    return view


def feed(run: ql.LocalRun, start: int, n: int, phases=(1, 1, 2, 2, 3), eval_every: int = 10) -> None:
    """Append n training rows (and an eval row every ``eval_every``) the way a trainer would."""
    n_layers = len(run.config.model.hidden) + 1
    for s in range(start, start + n):
        row = {"step": s, "epoch": s / 50, "time": 0.01 * s, "loss": 2.0 / (1 + 0.1 * s), "lr": 0.01,
               "steps_per_second": 100.0, "active_grad_fraction": 0.7}
        for i in range(n_layers):
            row.update({f"grad_norm_{i}": 1.0 + i, f"noise_mse_{i}": 0.01, f"sqnr_db_{i}": 20.0, f"scale_{i}": 0.1,
                        f"saturation_{i}": 0.0, f"frac_neg_{i}": 0.3, f"frac_zero_{i}": 0.4, f"frac_pos_{i}": 0.3})
        if run.config.phase.enabled:
            p = phases[s % len(phases)]
            row.update({"phase": p, "backward_passes": s // 2, "speedup_steps": 1.5, "speedup_wall": 1.3,
                        "pred_error": 0.2 if p == 3 else math.nan, "pred_cosine": 0.9 if p == 3 else math.nan,
                        "pred_gain": 0.8, "full_len": 10, "predict_len": 40})
        run.log.append(row)
        if s % eval_every == 0:
            run.log.append({"step": s, "epoch": s / 50, "time": 0.01 * s, "test_loss": 1.0 / s,
                            "test_accuracy": min(1.0, s / 100), "train_accuracy": 0.5, "train_loss": 0.5})


def names(fig) -> set[str]:
    return {r.name for r in fig.renderers if r.name}


# ---------------------------------------------------------------- streaming


def test_ema_matches_debiased_reference():
    x = np.array([1.0, 2.0, np.nan, 4.0, 3.0])
    out, state = ema(x, 0.5)
    ref, last, n = [], 0.0, 0
    for v in x:
        if np.isnan(v):
            ref.append(np.nan)
            continue
        last, n = 0.5 * last + 0.5 * v, n + 1
        ref.append(last / (1 - 0.5 ** n))
    np.testing.assert_allclose(out, ref)
    # continuing from the state equals smoothing everything at once
    a, st = ema(x[:2], 0.5)
    b, _ = ema(x[2:], 0.5, st)
    np.testing.assert_allclose(np.concatenate([a, b]), out)
    raw, _ = ema(x, 0.0)
    np.testing.assert_array_equal(raw, x)


def test_hub_pulls_only_the_runs_asked_for():
    a, b = ql.LocalRun(small_config()), ql.LocalRun(small_config())
    hub = StreamHub()
    ra, rb = hub.stream(a), hub.stream(b)
    feed(a, 1, 5, eval_every=10**9)
    feed(b, 1, 5, eval_every=10**9)
    assert hub.pull({a.id}) == 5
    assert len(ra.train.data["loss"]) == 5 and len(rb.train.data["loss"]) == 0
    assert hub.pull() == 5 and len(rb.train.data["loss"]) == 5   # b catches up later


def test_stream_pull_grows_sources_and_splits_eval_rows():
    run = ql.LocalRun(small_config())
    hub = StreamHub(smoothing=0.0)
    rs = hub.stream(run)
    assert rs.loss.name == f"loss-source-{run.id}" and rs.train.name == f"train-source-{run.id}"
    assert rs.eval.name == f"eval-source-{run.id}"
    assert set(train_columns(run.config)) <= set(rs.train.data)
    feed(run, 1, 30)
    assert hub.pull() == 33
    assert len(rs.train.data["loss"]) == 30
    np.testing.assert_array_equal(rs.loss.data["loss"], rs.train.data["loss"])
    assert len(rs.eval.data["test_loss"]) == 3
    np.testing.assert_allclose(rs.train.data["loss_s"], rs.train.data["loss"])  # smoothing 0 = raw
    assert hub.pull() == 0  # nothing new: nothing streamed
    feed(run, 31, 5)
    hub.pull()
    assert len(rs.train.data["loss"]) == 35 and rs.train.data["step"][-1] == 35


def test_loss_streams_every_tick_the_rest_every_detail_tick():
    """The periodic tick streams loss rows at once; training and eval rows wait for the next full
    tick (every DETAIL_EVERY-th: 1 Hz) and then arrive all together, phase segments included; once
    the run is done, any tick streams them."""
    from qatlab.ui.streaming import DETAIL_EVERY
    assert DETAIL_EVERY == 10
    run = ql.LocalRun(small_config(phase=True))
    hub = StreamHub()
    rs = hub.stream(run)
    ticks = []
    for t in range(DETAIL_EVERY + 1):
        for s in range(1 + 5 * t, 6 + 5 * t):
            run.log.append({"step": s, "time": 0.1 * s, "loss": 1.0 / s, "phase": 1 + (s > 7)})
        run.log.append({"step": 5 + 5 * t, "test_loss": 0.5, "test_accuracy": 0.9})
        full = hub.tick_is_full()
        hub.pull(every_metric=full)
        ticks.append((full, len(rs.loss.data["k"]), len(rs.train.data["k"]), len(rs.eval.data["step"]),
                      len(rs.phases.data["left"])))
    n = 5 * (DETAIL_EVERY + 1)
    assert ticks == ([(True, 5, 5, 1, 1)] + [(False, 5 * (t + 1), 5, 1, 1) for t in range(1, DETAIL_EVERY)]
                     + [(True, n, n, DETAIL_EVERY + 1, 2)])
    np.testing.assert_array_equal(rs.train.data["k"], np.arange(n))
    np.testing.assert_array_equal(rs.loss.data["loss_s"], rs.train.data["loss_s"])
    run.log.append({"step": n + 1, "test_loss": 0.4, "test_accuracy": 0.95})
    from types import SimpleNamespace
    rs.run = SimpleNamespace(done=True, log=run.log, config=run.config, id=run.id)   # the run ends
    run.log.append({"step": n + 1, "time": 0.1 * (n + 1), "loss": 0.1, "phase": 2})
    hub.pull(every_metric=False)             # a done run's rows all go at once: its curves are complete
    assert rs.exhausted and len(rs.train.data["k"]) == n + 1 and len(rs.eval.data["step"]) == DETAIL_EVERY + 2


def test_a_tick_streams_every_metric_with_rows_that_arrive_not_on_its_own():
    # Rows come in batches several ticks apart: a tick that streamed the training and eval rows
    # without a batch would make the browser repaint on its own, between two loss updates.
    from qatlab.ui.streaming import DETAIL_EVERY
    run = ql.LocalRun(small_config())
    hub = StreamHub()
    rs = hub.stream(run)
    step = iter(range(1, 10_000))

    def tick(rows: int) -> tuple:
        for _ in range(rows):
            run.log.append({"step": next(step), "loss": 1.0})
        due = hub.tick_is_full()
        hub.tick()
        return due, len(rs.loss.data["k"]), len(rs.train.data["k"])

    assert tick(2) == (True, 2, 2)                               # due, with rows: everything goes
    assert [tick(1)[2] for _ in range(DETAIL_EVERY - 1)] == [2] * (DETAIL_EVERY - 1)   # loss rows only
    assert tick(0) == (True, 11, 2)                              # due, but no rows: waits ...
    assert tick(1) == (True, 12, 12)                             # ... for the next batch
    for _ in range(2 * DETAIL_EVERY - 1):
        tick(0)
    run.log.append({"step": next(step), "loss": 1.0})
    hub.pull(every_metric=False)                                 # read, held for the training source
    assert len(rs.train.data["k"]) == 12 and tick(0) == (True, 13, 13)   # overdue: goes without a batch


def test_the_sidebar_text_changes_on_ticks_that_stream_rows(tmp_path, monkeypatch):
    from qatlab.ui import Dashboard
    from qatlab.ui.dashboard import TEXT_QUIET_S
    dash = Dashboard(period=0, store=ql.RunStore(tmp_path / "runs.sqlite"))
    try:
        rows, refreshed = [], []
        monkeypatch.setattr(dash.hub, "tick", lambda run_ids=None: rows.pop())
        monkeypatch.setattr(dash, "refresh", lambda force=False: refreshed.append(True))

        def tick(n: int) -> bool:
            rows.append(n)
            before = len(refreshed)
            dash.pull()
            return len(refreshed) > before

        assert [tick(3), tick(0), tick(0), tick(2), tick(0)] == [True, False, False, True, False]
        dash._rows_at -= TEXT_QUIET_S + 0.01                     # no rows for a while: paused or ended
        assert tick(0) and tick(0)
    finally:
        dash.close(join_timeout=5)


def test_stream_decimates_long_histories():
    run = ql.LocalRun(small_config())
    hub = StreamHub(cap=100)
    rs = hub.stream(run)
    feed(run, 1, 1000, eval_every=10**9)
    hub.pull()
    k = np.asarray(rs.train.data["k"])
    assert len(k) <= 100 and rs.stride >= 8
    assert np.all(k % rs.stride == 0) and k[0] == 0  # the beginning of the curve is kept
    feed(run, 1001, 500, eval_every=10**9)
    hub.pull()
    assert len(rs.train.data["k"]) <= 100
    assert rs.train.data["step"][-1] >= 1500 - rs.stride


def test_stream_plans_its_stride_from_the_planned_rows():
    run = ql.LocalRun(small_config())
    run.config.metrics_every = 2
    run.log.meta["total_steps"] = 2000            # as the trainer sets it before its first row
    hub = StreamHub(cap=100)
    rs = hub.stream(run)
    columns = rs.train.data["k"], rs.loss.data["k"]
    for start in range(1, 1001, 100):            # 1000 rows arrive over ten ticks
        feed(run, start, 100, eval_every=10**9)
        hub.pull()
    assert rs.stride == 11 == -(-(2000 // 2 + 1) // 100)
    for k in (rs.train.data["k"], rs.loss.data["k"]):
        np.testing.assert_array_equal(k, np.arange(0, 1000, 11))   # every 11th row from the first tick
    assert rs.train.data["k"] is columns[0] and rs.loss.data["k"] is columns[1]   # extended, never resent


def test_phase_segments_are_run_length_encoded():
    run = ql.LocalRun(small_config(phase=True))
    hub = StreamHub()
    rs = hub.stream(run)
    for s, p in enumerate([1, 1, 2, 2, 3], start=1):
        run.log.append({"step": s, "time": 0.1 * s, "loss": 1.0, "phase": p})
    hub.pull()
    assert list(rs.phases.data["label"]) == ["FULL", "PREDICT", "CORRECT"]
    np.testing.assert_array_equal(rs.phases.data["left"], [0, 2, 4])
    np.testing.assert_array_equal(rs.phases.data["right"], [2, 4, 5])
    run.log.append({"step": 6, "time": 0.6, "loss": 1.0, "phase": 3})   # extends the open segment (patch)
    run.log.append({"step": 7, "time": 0.7, "loss": 1.0, "phase": 1})   # opens a new one (stream)
    hub.pull()
    np.testing.assert_array_equal(rs.phases.data["right"], [2, 4, 6, 7])
    assert rs.phases.data["label"][-1] == "FULL"


def test_smoothing_change_recomputes_smoothed_columns():
    run = ql.LocalRun(small_config())
    hub = StreamHub(smoothing=0.0)
    rs = hub.stream(run)
    feed(run, 1, 50)
    hub.pull()
    hub.set_smoothing(0.9)
    expected, _ = ema(np.asarray(rs.train.data["loss"]), 0.9)
    np.testing.assert_allclose(rs.train.data["loss_s"], expected)


# ---------------------------------------------------------------- views


def test_run_view_renderers_log_scale_and_time_axis():
    run = ql.LocalRun(small_config(phase=True))
    view = RunView(run)
    feed(run, 1, 40)
    view.pull()
    rs = view.hub.stream(run)
    assert len(rs.train.data["loss"]) == 40 and len(rs.phases.data["left"]) > 0
    loss = view.figures["loss"]
    assert loss.name == "fig-loss"
    assert {f"loss-{run.id}", f"loss-raw-{run.id}", f"test-loss-{run.id}", f"phase-bands-{run.id}-FULL",
            f"phase-bands-{run.id}-CORRECT"} <= names(loss)
    assert {f"speedup-steps-{run.id}", f"speedup-wall-{run.id}"} <= names(view.figures["speedup"])
    assert view.figures["loss"].x_range is view.figures["accuracy"].x_range  # linked x
    legend = loss.legend[0]
    assert legend.click_policy == "hide"
    labels = [item.label["value"] for item in legend.items]
    assert labels[:4] == ["WARMUP", "FULL", "PREDICT", "CORRECT"] and "train (EMA)" in labels
    # legend entries are look-alike proxies (one NaN row) whose click toggles the real renderers by id
    item = legend.items[labels.index("train (EMA)")]
    proxy = item.renderers[0]
    assert all(math.isnan(v) for v in proxy.data_source.data["x"])   # draws nothing
    real = next(r for r in loss.renderers if r.name == f"loss-{run.id}")
    assert proxy.js_property_callbacks["change:visible"][0].args["ids"] == [real.id]
    assert "running" not in view.alert.object and "created" in view.alert.object

    view.options.log_y = True
    assert isinstance(view.figures["loss"].y_scale, LogScale)
    view.options.x_axis = "time"
    loss = view.figures["loss"]
    glyphs = {r.name: r.glyph for r in loss.renderers}
    assert glyphs[f"loss-{run.id}"].x == "time"
    band = glyphs[f"phase-bands-{run.id}-FULL"]
    assert isinstance(band, VStrip) and band.x0 == "left_t"
    assert view.figures["loss"].xaxis[0].axis_label == "wall time (s)"


@pytest.mark.parametrize("phase", [False, True])
def test_a_new_run_reuses_the_run_views_figures_and_lets_go_of_the_last_one(phase):
    import gc
    import weakref

    first = ql.LocalRun(small_config(phase=phase), name="first")
    view = RunView(first)
    feed(first, 1, 30)
    view.pull()
    figures = dict(view.figures)
    y0 = (figures["loss"].y_range.start, figures["loss"].y_range.end)
    old = view.hub.stream(first)
    old_sources = [weakref.ref(getattr(old, a)) for a in ("loss", "train", "eval", "phases")]
    del old
    second = ql.LocalRun(small_config(phase=phase), name="second")
    feed(second, 300, 30)                            # other steps and losses: the ranges must follow them
    view.run = second
    view.hub.drop(first.id)
    view.pull()
    assert view.figures == figures                   # the same figure objects
    rs = view.hub.stream(second)
    ours = {id(getattr(rs, a)) for a in ("loss", "train", "eval", "phases")}
    drawn = [r for fig in figures.values() for r in fig.renderers if r.name and second.id in r.name]
    assert {f"loss-{second.id}", f"loss-raw-{second.id}", f"test-loss-{second.id}"} <= names(figures["loss"])
    assert phase == (f"phase-bands-{second.id}-FULL" in names(figures["loss"]))
    assert not any(first.id in n for fig in figures.values() for n in names(fig))
    assert drawn and all(id(r.data_source) in ours for r in drawn)
    assert figures["loss"].title.text == "Loss · second"
    assert (figures["loss"].y_range.start, figures["loss"].y_range.end) != y0
    del drawn
    gc.collect()
    assert all(ref() is None for ref in old_sources)  # nothing holds the first run's data
    view.options.log_y = True                        # other plot options: new figures
    assert view.figures["loss"] is not figures["loss"]
    assert f"loss-{second.id}" in names(view.figures["loss"])


def test_run_view_without_phases_has_no_speedup_figure():
    run = ql.LocalRun(small_config())
    view = RunView(run)
    assert "speedup" not in view.figures
    assert all(not n.startswith("phase-bands") for n in names(view.figures["loss"]))


def test_failed_run_message_shows_no_traceback():
    run = ql.LocalRun(small_config())
    run.status = "failed"
    run.message = 'Traceback (most recent call last):\n  File "x.py", line 1\nValueError: data: bad file'
    view = RunView(run)
    assert "Traceback" not in view.alert.object
    assert "ValueError: data: bad file" in view.alert.object
    assert view.alert.alert_type == "danger"
    assert short_message(run.message) == "ValueError: data: bad file"


def test_diverged_run_shows_status_and_message():
    run = ql.LocalRun(small_config())
    run.status, run.message = "diverged", "loss became inf at step 12 (epoch 1); try a lower learning rate"
    view = RunView(run)
    status = RunStatus(runs=[run])
    status.refresh()
    assert view.alert.alert_type == "danger" and "diverged" in view.alert.object
    assert "loss became inf at step 12" in view.alert.object
    assert "diverged" in status.status.object and "loss became inf" in status.status.object


def test_run_status_progress_text():
    run = ql.LocalRun(small_config())
    status = RunStatus(runs=[run])
    run.steps_done, run.total_steps = 0, 0
    status.refresh()
    assert "Status:** created" in status.status.object
    assert format_seconds(75) == "1:15" and format_seconds(float("nan")) == "–"
    other = ql.LocalRun(small_config())
    other.status = "finished"
    assert group_status([run, other]) == "finished (1 created, 1 finished)"


def test_ste_compare_view_small_multiples_and_ranking():
    runs = {kind: ql.LocalRun(small_config(), name=kind.value) for kind in ql.SteKind}
    view = SteCompareView(runs)
    for i, run in enumerate(runs.values()):
        feed(run, 1, 20)
        run.log.append({"step": 21, "epoch": 1, "time": 1.0 + i, "test_loss": 0.5, "test_accuracy": 0.5 + 0.1 * i})
    view.hub.pull()
    view.refresh(force=True)
    assert {f.name for f in view.figures.values()} == {"fig-ste-loss", "fig-ste-accuracy"}
    assert view.detail.collapsed and view.detail.objects == []     # the small multiples wait for the card
    loss = view.figures["loss"]
    view.detail.collapsed = False
    assert {f"fig-ste-{c}" for c in ("loss", "accuracy", "grad_norm", "noise_mse", "sqnr_db",
                                      "active_grad_fraction")} == {f.name for f in view.figures.values()}
    assert view.figures["loss"] is loss and len(view.detail.objects) == 2
    view.detail.collapsed = True                     # closed again: built once, kept
    view.detail.collapsed = False
    assert view.figures["loss"] is loss and len(view.detail.objects) == 2
    assert len(names(view.figures["loss"])) == 4
    run0 = next(iter(runs.values()))
    assert {f"ste-grad_norm_0-{run0.id}", f"ste-grad_norm_1-{run0.id}"} <= names(view.figures["grad_norm"])
    assert len(names(view.figures["sqnr_db"])) == 8   # 2 layers x 4 kinds
    first = next(iter(runs.values()))
    assert len(view.hub.stream(first).train.data["loss"]) == 20
    table = view.summary
    assert list(table["rank"]) == [1, 2, 3, 4]
    assert list(table["ste"]) == ["hard_tanh", "tanh", "clipped_identity", "identity"]  # best accuracy first
    assert view.table.object.index("hard_tanh") < view.table.object.index("clipped_identity")
    assert summary_frame({}).empty


def test_the_overlays_exist_before_a_comparison_and_the_first_one_draws_on_them(monkeypatch):
    from bokeh.document import Document
    from bokeh.layouts import column

    none = {f"ste-loss-none-{k.value}" for k in ql.SteKind}
    view = SteCompareView()                          # built at once (not lazy): lines on empty sources
    figures = dict(view.figures)
    assert sorted(figures) == ["accuracy", "loss"] and names(figures["loss"]) == none
    assert all(len(r.data_source.data["step"]) == 0 for r in figures["loss"].renderers if r.name in none)
    assert "Press **Compare STE kinds**" in view.intro.object and not view.table.visible
    doc = Document()
    doc.add_root(column(*figures.values()))
    walks = []
    recompute = doc.models.recompute
    monkeypatch.setattr(doc.models, "recompute", lambda: (walks.append(1), recompute()))
    runs = {kind: ql.LocalRun(small_config(), name=kind.value) for kind in ql.SteKind}
    view.runs = runs
    assert view.figures == figures and len(walks) == 1           # rebound in one walk, nothing built
    assert names(view.figures["loss"]) == {f"ste-loss-{r.id}" for r in runs.values()}
    assert view.table.visible
    view.detail.collapsed = False                     # the small multiples of these runs
    assert "grad_norm" in view.figures
    view.runs = {}                                    # no comparison: the small multiples go, the overlays stay
    assert view.figures == figures and names(view.figures["loss"]) == none and view.detail.objects == []
    assert "Press **Compare STE kinds**" in view.intro.object
    deeper = small_config()
    deeper.model.hidden = [32, 16]
    view.runs = {kind: ql.LocalRun(deeper, name=kind.value) for kind in ql.SteKind}   # card still open
    assert view.figures["loss"] is figures["loss"] and len(names(view.figures["sqnr_db"])) == 12   # 3 layers x 4


def test_a_hidden_comparison_view_builds_its_overlays_when_prepared(server_doc):
    import asyncio

    from panel.io.state import set_curdoc

    view = SteCompareView(lazy=True)                 # a hidden tab builds nothing by itself
    assert view.figures == {}
    view.prepare()                                   # outside a server session: at once
    loss = view.figures["loss"]
    view.prepare()                                   # figures exist: nothing to do
    assert view.figures["loss"] is loss
    assert Dashboard(period=0).ste.figures          # a Dashboard outside a session prepares at once

    hidden = SteCompareView(lazy=True)
    doc, scheduled = server_doc()
    with set_curdoc(doc):
        hidden.prepare()                             # in a session: in pieces, from the next tick
    assert hidden.figures == {} and len(scheduled) == 1
    asyncio.run(scheduled[0]())
    assert sorted(hidden.figures) == ["accuracy", "loss"]


def test_a_served_dashboard_enables_compare_once_the_comparison_figures_are_built(server_doc):
    import asyncio

    from panel.io.state import set_curdoc

    dash = Dashboard(period=0)
    dash.ste.figures = {}                            # as a served page has them before its onload
    doc, scheduled = server_doc()
    with set_curdoc(doc):
        dash._prepare_comparison()                   # (pn.state.onload calls it once the page has connected)
    assert len(scheduled) == 1 and dash.config_panel.compare_button.disabled
    asyncio.run(scheduled[0]())                      # the build, in pieces; then Compare on the next tick
    assert sorted(dash.ste.figures) == ["accuracy", "loss"] and len(scheduled) == 2
    assert dash.config_panel.compare_button.disabled
    scheduled[1]()
    assert not dash.config_panel.compare_button.disabled


def test_a_second_comparison_reuses_the_figures_and_lets_go_of_the_first_runs():
    import gc
    import weakref

    from bokeh.models import GlyphRenderer

    def comparison(tag):
        runs = {kind: ql.LocalRun(small_config(), name=f"{tag} {kind.value}") for kind in ql.SteKind}
        for run in runs.values():
            feed(run, 1, 20)
        return runs

    view = SteCompareView(comparison("a"))
    view.hub.pull()
    view.fit_ranges()
    figures, first = dict(view.figures), dict(view.runs)
    y0 = (view.figures["loss"].y_range.start, view.figures["loss"].y_range.end)
    old_sources = [weakref.ref(getattr(view.hub.stream(run), attr)) for run in first.values()
                   for attr in ("loss", "eval", "train")]
    second = comparison("b")
    for run in second.values():                      # other losses: the y range must follow them
        for i in range(20):
            run.log.append({"step": 100 + i, "loss": 50.0 + i})
    view.runs = second
    for run in first.values():
        view.hub.drop(run.id)
    view.hub.pull()
    view.fit_ranges()
    assert view.figures == figures                   # the same figure objects, lines pointing at the new runs
    renderers = [r for fig in view.figures.values() for r in fig.renderers
                 if isinstance(r, GlyphRenderer) and r.name and r.name.startswith("ste-")]
    ids = {run.id for run in second.values()}
    assert renderers and all(any(r.name.endswith(f"-{i}") for i in ids) for r in renderers)
    assert all(r.data_source in {s for run in second.values() for s in
                                 (view.hub.stream(run).loss, view.hub.stream(run).eval, view.hub.stream(run).train)}
               for r in renderers)
    assert (view.figures["loss"].y_range.start, view.figures["loss"].y_range.end) != y0
    assert "b identity" in view.intro.object and set(view.summary["run"]) == ids
    del renderers
    gc.collect()
    assert all(ref() is None for ref in old_sources)  # nothing (no range callback) holds the first runs' data


def test_a_second_comparison_in_a_document_walks_its_models_once(monkeypatch):
    # Bokeh re-walks a document's whole model graph after each change of a model reference; moving
    # 48 lines to new sources one by one walked a page's whole dashboard 48 times.
    from bokeh.document import Document
    from bokeh.layouts import column

    def comparison(tag):
        return {kind: ql.LocalRun(small_config(), name=f"{tag} {kind.value}") for kind in ql.SteKind}

    view = SteCompareView(comparison("a"))
    doc = Document()
    doc.add_root(column(*view.figures.values()))
    walks = []
    recompute = doc.models.recompute
    monkeypatch.setattr(doc.models, "recompute", lambda: (walks.append(1), recompute()))
    figures = dict(view.figures)
    second = comparison("b")
    view.runs = second
    assert view.figures == figures                   # rebound, not rebuilt
    assert len(walks) == 1
    ids = {f"ste-loss-{run.id}" for run in second.values()}
    assert ids <= {r.name for r in doc.models if getattr(r, "name", None)}   # the walk saw the new names


def test_quant_view_histograms_follow_weight_snapshot():
    run = ql.LocalRun(small_config())
    view = QuantView(run)
    rng = np.random.default_rng(0)
    latent = rng.normal(size=(32, 64)).astype(np.float32)
    alpha = float(np.mean(np.abs(latent)))
    quantized = (np.clip(np.rint(latent / alpha), -1, 1) * alpha).astype(np.float32)
    run._publish_weights({"layer0": (latent, quantized), "layer1": (rng.normal(size=(10, 32)), np.zeros((10, 32)))})
    feed(run, 1, 10)
    view.pull()
    lat = view.hist_sources["latent-0"].data
    qnt = view.hist_sources["quant-0"].data
    assert view.hist_sources["latent-0"].name == "hist-latent-layer0"
    assert lat["count"].sum() == latent.size and len(lat["count"]) == 60
    assert len(qnt["count"]) == 3 and qnt["count"].sum() == latent.size  # ternary: three bars
    assert {f"frac-neg-0-{run.id}", f"frac-zero-1-{run.id}"} <= names(view.figures["fractions"])
    assert f"scale-1-{run.id}" in names(view.figures["scale"])
    assert level_bars(np.zeros(0))["count"].size == 0 and histogram(np.ones(5))["count"].sum() == 5


def test_phase_view_figures_and_placeholder():
    off = PhaseView(ql.LocalRun(small_config()))
    assert off.figures == {} and "off" in off.intro.object
    run = ql.LocalRun(small_config(phase=True))
    view = PhaseView(run)
    feed(run, 1, 25)
    view.pull()
    assert {"fig-phase-timeline", "fig-phase-backward", "fig-phase-pred", "fig-phase-lengths"} == \
        {f.name for f in view.figures.values()}
    assert {f"pred-error-{run.id}", f"pred-gain-{run.id}"} <= names(view.figures["pred"])
    assert len(view.hub.stream(run).train.data["pred_error"]) == 25
    assert "trend history **float32**" in view.intro.object and view.memory.object == ""   # no meta yet
    run.log.meta["phase_history"] = {"storage": "ternary", "bytes": 20_840, "float32_bytes": 332_800}
    view.pull()
    assert view.memory.object == "Trend history: **ternary**, 20.8 kB (float32 rows would take 332.8 kB)"
    assert history_text({"storage": "float32", "bytes": 2_400_000, "float32_bytes": 2_400_000}) == \
        "Trend history: **float32**, 2.40 MB"


def test_config_panel_refuses_invalid_config_without_traceback():
    panel = ConfigPanel(ql.ExperimentConfig())
    panel.config.data.dataset = "file"   # needs a path
    assert panel.validated() is None
    assert panel.error.visible and "path" in panel.error.object and "Traceback" not in panel.error.object
    panel.config.data.dataset = "digits"
    assert isinstance(panel.validated(), ql.ExperimentConfig) and not panel.error.visible
    labels = {panel.start_button.name, panel.stop_button.name, panel.compare_button.name}
    assert labels == {"Start", "Stop", "Compare STE kinds"}
    assert panel.keep_alive.name == "Keep running after this page closes"


def test_dashboard_invalid_start_creates_no_run(tmp_path):
    dash = Dashboard(period=0, store=RunStore(tmp_path / "runs.sqlite"))
    dash.config_panel.config.data.dataset = "file"
    assert dash.start_run() is None and dash.compare_ste() is None
    assert dash.store.runs() == [] and dash._client is None        # nothing stored, no cluster needed


@pytest.mark.slow
def test_dashboard_trains_on_workers_streams_and_closes(tmp_path, client2):
    store = RunStore(tmp_path / "runs.sqlite")
    dash = Dashboard(config=small_config(epochs=2), period=0, client=client2, store=store)
    run = dash.start_run()
    assert isinstance(run, ql.Run) and run.owner == dash.owner and dash.overview.run is run
    assert run.join(60)
    dash.pull()
    dash.status.refresh(force=True)   # text is throttled to about 2 Hz
    rs = dash.hub.stream(run)
    assert run.status == "finished", run.message
    assert run.worker in client2.scheduler_info()["workers"]                 # trained on a worker ...
    assert len(rs.train.data["loss"]) > 0 and len(rs.eval.data["test_accuracy"]) == 2
    assert store.get(run.id).status == "finished" and len(store.history(run.id)["step"]) == len(run.log)  # ... kept
    assert "Status:** finished" in dash.status.status.object
    dash.tabs.active = 2   # Quantization: built lazily when shown, histograms from the last snapshot
    assert dash.quant.figures and dash.quant.hist_sources["latent-0"].data["count"].sum() > 0
    assert run.result().model is None and store.load_model(run.id) is not None   # the server keeps no model

    dash.config_panel.config.optim.epochs = 10_000   # long runs: still training when the session closes
    runs = dash.compare_ste()
    assert len(runs) == 4 and dash.ste.runs == runs and dash.tabs.active == 1
    assert all(r.owner == dash.owner and not r.keep_alive for r in runs.values())
    assert run.id in dash.hub
    dash.current = None                              # no view shows the first run now: its stream goes
    assert run.id not in dash.hub and all(r.id in dash.hub for r in runs.values())
    survivor = ql.Run(dash.config_panel.config, owner=dash.owner, keep_alive=True, store=store, client=client2).start()
    stopped = dash.close(join_timeout=60)
    assert set(stopped) == set(runs.values())
    assert all(r.status == "stopped" and r.join(0) and r.result().model is None for r in runs.values())
    assert survivor.status in ("created", "running")   # keep-alive runs outlive the session
    survivor.stop()
    assert survivor.join(60)


@pytest.mark.slow
def test_keep_alive_checkbox_applies_to_live_runs(tmp_path, client2):
    dash = Dashboard(config=small_config(epochs=10_000), period=0, client=client2, store=RunStore(tmp_path / "r.sqlite"))
    run = dash.start_run()
    dash.config_panel.keep_alive.value = True
    assert run.keep_alive
    assert dash.close(join_timeout=30) == [] and not run.done
    run.stop()
    assert run.join(60)


@pytest.mark.parametrize("connections, ticks", [(0, 0), (1, 1), (None, 1)])
def test_streaming_tick_skips_a_server_session_whose_page_is_gone(connections, ticks):
    """A server session with no browser connection (page closed or reloaded, not yet destroyed by
    Bokeh) is not pulled for; one with a connection, or no server session (notebook), is."""
    from types import SimpleNamespace

    from bokeh.document import Document
    from panel.io.state import set_curdoc
    from qatlab.ui.base import page_disconnected, streaming_tick
    doc = Document()
    if connections is not None:
        doc._session_context = lambda: SimpleNamespace(_session=SimpleNamespace(connection_count=connections))
    pulls = []
    with set_curdoc(doc):
        assert page_disconnected() is (connections == 0)
        streaming_tick(lambda: pulls.append(1), None)
    assert len(pulls) == ticks


def test_ste_rebuild_runs_in_pieces_and_a_newer_request_abandons_an_older_one(server_doc):
    """In a server session the STE view builds one figure per event-loop turn (the loop answers
    other sessions in between) and shows them in two steps; the pieces give the same figures as a
    rebuild at once."""
    import asyncio

    from panel.io.state import set_curdoc
    view = comparison_view()                                 # no server session: built at once
    view.detail.collapsed = False                            # (the small multiples too)
    at_once = sorted(view.figures)
    assert len(at_once) == 6
    view._shape = None                   # (else a comparison of the same shape reuses the figures)
    shown = []
    for _ in view.rebuild_steps():        # the shown layout changes twice: the overlays, then the rest
        shown.append((tuple(map(id, view._plots.objects)), len(view.detail.objects)))
    assert len(shown) >= len(at_once) and sorted(view.figures) == at_once
    layouts = [s[0] for s in shown]
    overlays = layouts.index(layouts[-1])                    # the piece that showed the loss and accuracy row
    assert len(set(layouts)) == 2 and 0 < overlays < len(shown) - 1
    assert all(s[1] == 0 for s in shown[overlays:]) and len(view.detail.objects) == 2   # the rest at the end

    doc, scheduled = server_doc()
    with set_curdoc(doc):
        view.request_rebuild()
        view.request_rebuild()                               # supersedes the first
    assert len(scheduled) == 2
    built = []
    view.when_built(lambda: built.append(sorted(view.figures)))   # waits for the pending build
    view.figures = {}
    asyncio.run(scheduled[0]())                              # abandoned before its first piece
    assert view.figures == {} and built == []
    asyncio.run(scheduled[1]())
    assert sorted(view.figures) == at_once and built == [at_once]
    view.when_built(lambda: built.append("now"))             # nothing pending: called at once
    assert built[-1] == "now"


def test_summary_frame_ranks_by_accuracy_then_time_with_unknown_last():
    from types import SimpleNamespace

    def run(acc, seconds, rid):
        log = SimpleNamespace(last=lambda col, default=math.nan: {"test_accuracy": acc, "test_loss": 0.5}[col])
        return SimpleNamespace(log=log, status="running", elapsed=seconds, steps_per_second=10.0, steps_done=5,
                               id=rid)
    df = summary_frame({"tanh": run(0.9, 3.0, "a"), "identity": run(math.nan, 1.0, "b"),
                        "hard_tanh": run(0.95, 9.0, "c"), "clipped_identity": run(0.9, 2.0, "d")})
    assert list(df["run"]) == ["c", "d", "a", "b"] and list(df["rank"]) == [1, 2, 3, 4]
    assert list(df.columns)[:3] == ["rank", "ste", "status"]


def test_stream_batches_serialize_inline_and_extend_list_columns_in_place():
    """Bokeh encodes an InlineList as its inline ndarray form (base64 of a gzip stream, what BokehJS
    decodes); string columns stay plain lists; a stream extends the source's list column in place."""
    import base64
    import gzip

    from bokeh.core.serialization import Serializer
    from bokeh.models import ColumnDataSource
    from qatlab.ui.streaming import InlineList, _empty, _payload
    payload = _payload({"x": np.array([1.0, np.nan, 3.0], np.float32), "label": ["a", "b", "c"]})
    assert type(payload["x"]) is InlineList and type(payload["label"]) is list
    rep = Serializer().encode(payload["x"])
    assert rep["type"] == "ndarray" and rep["dtype"] == "float64" and rep["shape"] == [3]
    back = np.frombuffer(gzip.decompress(base64.b64decode(rep["array"]["data"])), dtype=np.float64)
    np.testing.assert_array_equal(back, [1.0, np.nan, 3.0])
    src = ColumnDataSource(_empty(["x", "label"]))
    column = src.data["x"]
    src.stream(payload)
    src.stream(_payload({"x": np.array([4.0]), "label": ["d"]}))
    assert src.data["x"] is column and len(column) == 4 and src.data["label"] == ["a", "b", "c", "d"]


def test_rebuild_pieces_rest_only_while_another_session_builds(monkeypatch, server_doc):
    """A lone rebuild runs its pieces back to back; two at once take turns and rest after each
    piece (the loop keeps half its time for requests)."""
    import asyncio
    import threading

    from panel.io.state import set_curdoc
    from qatlab.ui import base
    views = [comparison_view(), comparison_view()]
    real_sleep, rests, me = asyncio.sleep, [], threading.get_ident()

    async def sleep(delay, *args):
        if threading.get_ident() != me:          # (asyncio is patched for every thread: a Dask client's loop too)
            return await real_sleep(delay, *args)
        if delay:
            rests.append(delay)
        await real_sleep(0)
    monkeypatch.setattr(base.asyncio, "sleep", sleep)
    doc, scheduled = server_doc()
    with set_curdoc(doc):
        views[0]._shape = None               # (else a rebuild of the same shape reuses the figures)
        views[0].request_rebuild()
    asyncio.run(scheduled[0]())
    assert rests == [] and base._active_builds == 0
    with set_curdoc(doc):
        for view in views:
            view._shape = None
            view.request_rebuild()

    async def both():
        await asyncio.gather(scheduled[1](), scheduled[2]())
    asyncio.run(both())
    assert len(rests) >= 4 and all(0 < r <= base.MAX_PIECE_REST for r in rests) and base._active_builds == 0


def test_rebuild_pieces_wait_until_button_presses_are_quiet(monkeypatch, server_doc):
    """No piece is built within PRESS_QUIET_S of a button press (on any page): with several pages
    pressing Compare at once, each press is answered before figures are built."""
    import asyncio
    import threading

    from panel.io.state import set_curdoc
    from qatlab.ui import base
    view = comparison_view()
    real_sleep, events, me = asyncio.sleep, [], threading.get_ident()

    async def sleep(delay, *args):
        if threading.get_ident() == me and delay:
            events.append(("rest", delay))
        await real_sleep(delay, *args)
    monkeypatch.setattr(base.asyncio, "sleep", sleep)
    steps = view.rebuild_steps

    def counted_steps():
        for piece in steps():
            events.append(("piece", time.monotonic()))
            yield piece
    monkeypatch.setattr(view, "rebuild_steps", counted_steps)
    doc, scheduled = server_doc()
    with set_curdoc(doc):
        view._shape = None
        view.request_rebuild()
    base.note_press()
    pressed = time.monotonic()
    asyncio.run(scheduled[0]())
    pieces = [t for kind, t in events if kind == "piece"]
    assert events[0][0] == "rest" and 0 < events[0][1] <= base.PRESS_QUIET_S
    assert len(pieces) >= 2 and pieces[0] - pressed >= base.PRESS_QUIET_S - 0.01


def test_every_sidebar_button_press_is_noted_for_the_rebuilds(monkeypatch):
    from qatlab.ui import config_panel
    presses = []
    monkeypatch.setattr(config_panel, "note_press", lambda: presses.append(1))
    dash = Dashboard(period=0)
    dash.config_panel.stop_button.clicks += 1
    dash.config_panel.pause_button.clicks += 1
    assert len(presses) == 2


def test_tabs_are_all_in_the_page_so_a_switch_sends_one_property():
    """A dynamic Tabs would render the shown tab on the server at each switch."""
    dash = Dashboard(period=0)
    assert dash.tabs.dynamic is False and len(dash.tabs) == len(dash.views)


def test_a_press_on_one_page_changes_nothing_in_another_pages_document():
    """Panel's template busy indicator follows one process-wide flag: every event of any page would
    update every open page's spinner. The app's template has none."""
    from bokeh.document import Document
    from bokeh.events import ButtonClick
    from panel.io.state import set_curdoc
    from qatlab.ui import template_kwargs
    pages = []
    for _ in range(2):
        doc = Document()
        with set_curdoc(doc):
            dash = Dashboard(period=0)
            pn.template.FastListTemplate(sidebar=[dash.sidebar], main=[dash.main], **template_kwargs()).server_doc(doc)
        pages.append((doc, dash))
    (doc_a, dash_a), (doc_b, _) = pages
    changed = []
    doc_b.on_change(lambda event: changed.append(event))
    button = dash_a.config_panel.stop_button
    model = next(iter(button._models.values()))[0]
    button._process_bokeh_event(doc_a, ButtonClick(model))
    assert button.clicks == 1 and changed == []


def test_a_run_refused_by_the_memory_estimate_is_not_kept_and_the_page_says_why(monkeypatch):
    monkeypatch.setenv("QATLAB_MEMORY_BUDGET", "1K")
    dash = Dashboard(period=0)
    assert dash.start_run() is None and dash.compare_ste() is None
    assert dash.owned_runs() == [] and dash.status.runs == []
    assert dash.config_panel.error.visible and "over the budget" in dash.config_panel.error.object


def test_a_model_that_left_the_document_before_any_patch_is_let_go():
    """Bokeh keeps a model added to a document and removed before any patch sent it among the
    document's new models for good; the streaming tick lets go of it (a run's earlier figures)."""
    import gc
    import weakref

    from bokeh.document import Document
    from bokeh.models import ColumnDataSource, Column as BkColumn

    from qatlab.ui.base import forget_detached_models
    doc = Document()
    root = BkColumn()
    doc.add_root(root)
    doc.models.flush_synced()                          # (as once the page has it)
    source = ColumnDataSource({"x": [1.0, 2.0]})
    held = BkColumn(tags=[source])
    root.children = [held]                             # joins the document ...
    root.children = []                                 # ... and leaves before any patch
    gone = weakref.ref(source)
    del source, held
    gc.collect()
    assert gone() is not None                          # Bokeh still holds it
    forget_detached_models(doc)
    gc.collect()
    assert gone() is None
    assert root in doc.models.synced_references        # what the page has stays


def test_a_view_shown_on_its_own_streams_until_stopped():
    view = RunView(None)                 # no hub given: the view owns one and streams while displayed
    view.__panel__()
    callback = view._periodic
    assert callback is not None and callback.running
    view.__panel__()                     # shown again: still the one callback
    assert view._periodic is callback
    view.stop_streaming()
    assert view._periodic is None and not callback.running
