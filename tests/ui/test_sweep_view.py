"""The Sweeps tab's view: form parsing and validation, rows from a store, selection shared by the table
and both charts, heatmap means, config diff, curves, and a live sweep on a LocalCluster."""
from __future__ import annotations

import math
import time

import numpy as np
import pytest

import qatlab as ql
from qatlab.runs import RunResult
from qatlab.sweep.runner import EndedRun
from qatlab.ui import sweep_charts as C
from qatlab.ui.sweep_form import axes_text, parse_axes, parse_seeds, ste_grid
from qatlab.ui.sweep_view import SweepView

pytestmark = pytest.mark.filterwarnings("ignore:The inplace keyword")  # bokeh + pandas 3.1, in Tabulator

STES = ("identity", "tanh")
BITS = (2, 4)
SEEDS = (0, 1)


def accuracy(ste: str, bits: int, seed: int) -> float:
    return 0.5 + bits / 10 + (0.05 if ste == "tanh" else 0.0) + seed / 100


def fill(store, name: str = "sw", fail: tuple | None = None) -> None:
    """A stored sweep of STES x BITS x SEEDS, finished (``fail``: the (ste, bits, seed) that failed)."""
    base = ql.ExperimentConfig()
    base.quant.weights = "fake"
    for seed in SEEDS:
        for ste in STES:
            for bits in BITS:
                c = base.copy()
                c.optim.seed, c.quant.ste, c.quant.weight_bits = seed, ste, bits
                rid = store.create_run(c, name=f"{ste}-{bits}-{seed}", sweep_id=name,
                                       point={"quant.ste": ste, "quant.weight_bits": bits, "seed": seed})
                store.set_status(rid, "running")
                store.append_rows(rid, [{"row_id": 0, "step": 1.0, "loss": 1.0},
                                        {"row_id": 1, "step": 2.0, "loss": 0.5, "test_accuracy": 0.6}])
                bad = fail == (ste, bits, seed)
                store.finish(rid, RunResult(history={}, final={} if bad else
                                            {"test_accuracy": accuracy(ste, bits, seed), "test_loss": 1.0},
                                            model=None, status="failed" if bad else "finished",
                                            message="boom" if bad else "", config=c.to_dict()))


@pytest.fixture
def store(tmp_path):
    with ql.RunStore(tmp_path / "runs.sqlite") as s:
        yield s


def tiny() -> ql.ExperimentConfig:
    cfg = ql.ExperimentConfig()
    cfg.optim.epochs, cfg.model.hidden = 1, [16]
    return cfg


def view_of(store, config=None, **kw) -> SweepView:
    view = SweepView(store=store, config_source=lambda: config, **kw)
    view.set_active(True)
    return view


def shown(store, **kw) -> SweepView:
    view = view_of(store, tiny(), **kw)
    view.show_sweep("sw")
    assert view.wait_loaded(30)
    return view


# ----------------------------------------------------------------------------- the form


def test_axes_text_reads_words_numbers_and_json_lists():
    grid = parse_axes("quant.ste = identity, hard_tanh\n# a comment\n\nquant.weight_bits = [2, 4]\n"
                      "model.hidden = [[16], [32, 16]]\noptim.lr = 0.01, 1e-3")
    assert grid == {"quant.ste": ["identity", "hard_tanh"], "quant.weight_bits": [2, 4],
                    "model.hidden": [[16], [32, 16]], "optim.lr": [0.01, 0.001]}
    assert parse_axes(axes_text(grid)) == grid
    assert parse_axes(axes_text(ste_grid())) == {"quant.ste": ["identity", "clipped_identity", "tanh", "hard_tanh"]}


@pytest.mark.parametrize("text, words", [("quant.ste", "line 1"), ("= 1, 2", "line 1"),
                                          ("a.b = 1\na.b = 2", "given twice"), ("quant.weight_bits = [2,", "JSON"),
                                          ("quant.ste = identity,,tanh", "empty value"),
                                          ("data.path = /etc/passwd", "line 1: data.path: the page never takes a server"),
                                          ("data.dataset = file\ndata.path = ['/tmp/x.csv']", "line 2: data.path")])
def test_bad_axes_text_names_the_line(text, words):
    with pytest.raises(ValueError, match=words):
        parse_axes(text)


def test_seeds_text():
    assert parse_seeds("0, 3, 5") == [0, 3, 5]
    assert parse_seeds("1-3") == [1, 2, 3]
    for bad in ("", "x", "0-z", "0-200", "3-0"):
        with pytest.raises(ValueError, match="seeds"):
            parse_seeds(bad)
    with pytest.raises(ValueError, match="range '3-0' is empty"):
        parse_seeds("3-0")
    t0 = time.perf_counter()
    with pytest.raises(ValueError, match="at most 100 seeds, got 1000000001"):
        parse_seeds("0-1000000000")          # refused before the range is built
    assert time.perf_counter() - t0 < 1.0


def test_an_invalid_sweep_is_named_on_the_page_and_nothing_starts(store):
    view = view_of(store, tiny())
    cases = [("quant.nope = 1", "0", "quant has no field 'nope'"),
             ("quant.ste = identity, bogus", "0", "'bogus'"),
             ("quant.ste = identity", "x", "seeds"),
             ("optim.seed = 1, 2", "0", "set by seeds="),
             ("model.hidden = [[0]]", "0", "hidden"),
             ("data.path = /etc/passwd", "0", "never takes a server file path")]
    assert view.message.renderer_options == view.diff.renderer_options == {"linkify": False}   # optim.lr: no link
    for axes, seeds, words in cases:
        view.axes_input.value, view.seeds_input.value = axes, seeds
        assert view.start_sweep() is None
        assert view.message.visible and words in view.message.object, (axes, view.message.object)
        assert view.handle is None and not view.busy
    assert store.runs() == []
    invalid_sidebar = view_of(store, None)
    assert invalid_sidebar.start_sweep() is None and "sidebar" in invalid_sidebar.message.object


# ----------------------------------------------------------------------------- a stored sweep


def test_a_stored_sweep_fills_the_table_and_both_charts(store):
    fill(store, fail=("tanh", 4, 1))
    view = shown(store)
    df = view.table.value
    assert len(df) == 8 and list(df["status"]).count("failed") == 1
    assert {"quant.ste", "quant.weight_bits", "seed", "test_accuracy", "run_id"} <= set(df.columns)
    assert view.axes == ["quant.ste", "quant.weight_bits", "seed"]
    assert view.metric_select.value == "test_accuracy"
    assert (view.heat_x.value, view.heat_y.value) == ("quant.ste", "quant.weight_bits")
    assert "8 runs" not in view.status.object and "7 finished" in view.status.object and "1 failed" in view.status.object
    # parallel coordinates: one polyline per run over 3 axes + the metric; the failed run has no metric point
    data = view.source.data
    assert len(data["ys"]) == 8 and all(len(ys) == 4 for ys in data["ys"])
    failed = list(df["status"]).index("failed")
    assert math.isnan(data["value"][failed]) and math.isnan(data["ys"][failed][-1])
    finished = [v for i, v in enumerate(data["value"]) if i != failed]
    assert (view.mapper.low, view.mapper.high) == (min(finished), max(finished))
    assert min(ys[-1] for i, ys in enumerate(data["ys"]) if i != failed) == 0.0


def test_heatmap_means_are_over_the_finished_seeds_with_their_spread(store):
    fill(store, fail=("tanh", 4, 1))
    view = shown(store)
    heat = view.heat_source.data
    cells = {(x, y): i for i, (x, y) in enumerate(zip(heat["x"], heat["y"]))}
    assert set(cells) == {(s, str(b)) for s in STES for b in BITS}
    for ste in STES:
        for bits in BITS:
            i = cells[(ste, str(bits))]
            vals = [accuracy(ste, bits, s) for s in SEEDS if (ste, bits, s) != ("tanh", 4, 1)]
            assert heat["mean"][i] == pytest.approx(np.mean(vals))
            assert heat["std"][i] == pytest.approx(np.std(vals, ddof=1) if len(vals) > 1 else 0.0)
            assert (heat["n"][i], heat["runs"][i]) == (len(vals), 2)
    summary = view.summary.value.set_index(["quant.ste", "quant.weight_bits"])
    tanh4 = summary.loc[("tanh", "4")]
    assert (tanh4["runs"], tanh4["finished"], tanh4["other statuses"], tanh4["n"]) == (2, 1, "failed", 1)
    assert tanh4["mean"] == pytest.approx(accuracy("tanh", 4, 0)) and tanh4["std"] == 0.0
    id2 = summary.loc[("identity", "2")]
    assert id2["mean"] == pytest.approx(np.mean([accuracy("identity", 2, s) for s in SEEDS]))
    assert id2["std"] == pytest.approx(np.std([accuracy("identity", 2, s) for s in SEEDS], ddof=1))
    view.heat_y.value = C.NONE_AXIS          # one row: each STE kind over both bits and seeds
    heat = view.heat_source.data
    assert heat["y"] == ["all", "all"]
    assert heat["mean"][heat["x"].index("identity")] == pytest.approx(
        np.mean([accuracy("identity", b, s) for b in BITS for s in SEEDS]))


def test_selection_is_shared_by_table_lines_and_cells(store):
    fill(store)
    view = shown(store)
    rows = view.rows
    cell_of = {(x, y): i for i, (x, y) in enumerate(zip(view.heat_source.data["x"], view.heat_source.data["y"]))}

    def cell(i):
        return cell_of[(rows[i]["quant.ste"], str(rows[i]["quant.weight_bits"]))]

    view.table.selection = [0, 5]                          # ticking rows
    assert view.selected == [0, 5] and view.source.selected.indices == [0, 5]
    assert sorted(view.heat_source.selected.indices) == sorted({cell(0), cell(5)})
    view.source.selected.indices = [3]                     # tapping a line in the chart
    assert view.selected == [3] and view.table.selection == [3]
    assert view.heat_source.selected.indices == [cell(3)]
    view.heat_source.selected.indices = [cell(1)]          # tapping a cell: its runs (both seeds)
    members = sorted(i for i, r in enumerate(rows) if cell(i) == cell(1))
    assert len(members) == 2 and view.selected == members and view.table.selection == members
    assert view.source.selected.indices == members
    view.metric_select.value = "test_loss"                 # redrawn charts keep the selection
    assert view.source.selected.indices == members
    assert view.selected_ids() == [rows[i]["run_id"] for i in members]


def test_config_diff_of_two_selected_runs_and_their_curves(store):
    fill(store)
    view = shown(store)
    rows = view.rows
    a = next(i for i, r in enumerate(rows) if (r["quant.ste"], r["quant.weight_bits"], r["seed"]) == ("identity", 2, 0))
    b = next(i for i, r in enumerate(rows) if (r["quant.ste"], r["quant.weight_bits"], r["seed"]) == ("tanh", 2, 1))
    assert view.open_button.disabled
    view.select([a, b])
    text = view.diff.object
    assert "| quant.ste | identity | tanh |" in text and "| optim.seed | 0 | 1 |" in text
    assert "weight_bits" not in text
    view.select([a])
    assert "Select two runs" in view.diff.object
    view.select([a, b])
    assert not view.open_button.disabled
    assert view.open_runs() == [rows[a]["run_id"], rows[b]["run_id"]]
    loss = view.curves.objects[0][0].object
    assert loss.name == "fig-sweep-loss"
    assert [list(r.data_source.data["y"]) for r in loss.renderers] == [[1.0, 0.5], [1.0, 0.5]]


def test_refreshing_a_finished_sweep_reads_the_store_once(store, monkeypatch):
    fill(store)
    view = shown(store)
    calls = []
    real = store.runs
    monkeypatch.setattr(store, "runs", lambda *a, **k: calls.append(k) or real(*a, **k))
    source_data = view.source.data
    for _ in range(5):
        view.refresh(force=True)
    assert calls == [] and view.source.data is source_data    # nothing changed: nothing re-sent


def test_many_runs_select_fast_and_refreshes_add_no_models(store):
    from bokeh.document import Document

    from qatlab.ui.sweep_bench import fill_store
    name = fill_store(store, n=16, rows=5)
    view = view_of(store)
    doc = Document()
    doc.add_root(view.__panel__().get_root(doc))
    view.show_sweep(name)
    assert view.wait_loaded(60) and len(view.table.value) == 16
    for how in (lambda: setattr(view.table, "selection", [3, 9, 15]),
                lambda: setattr(view.source.selected, "indices", [5]),
                lambda: setattr(view.heat_source.selected, "indices", [2])):
        start = time.perf_counter()
        how()
        assert time.perf_counter() - start < 0.5
    models = len(doc.models)
    metrics = list(view.metric_select.options)
    for i in range(8):             # refreshes, metric switches and selections: the same Bokeh models, no new ones
        view.refresh(force=True)
        view.metric_select.value = metrics[i % len(metrics)]
        view.select([i % 16, (7 * i) % 16])
    assert len(doc.models) == models


# ----------------------------------------------------------------------------- a live sweep


def wait_for(predicate, timeout: float, what: str):
    deadline = time.monotonic() + timeout
    while not predicate():
        if time.monotonic() > deadline:
            pytest.fail(f"timed out after {timeout:.0f} s waiting for {what}")
        time.sleep(0.1)


@pytest.mark.slow
def test_a_live_ste_sweep_fills_the_table_and_only_its_page_stops_it(store, client2):
    view = view_of(store, tiny(), client=client2, owner="page-a")
    view.ste_seeds.value = 2
    sweep = view.compare_ste()
    assert sweep is not None and len(sweep) == 8
    assert view.seeds_input.value == "0-1" and view.axes_input.value.startswith("quant.ste = identity")
    wait_for(lambda: view.refresh(force=True) or (view.handle is not None and view.handle.done), 300, "the sweep")
    view.refresh(force=True)
    assert all(isinstance(r, EndedRun) for r in view.handle.runs)    # no rows or models kept per run
    df = view.table.value
    assert len(df) == 8 and set(df["status"]) == {"finished"}
    assert set(df["quant.ste"]) == {"identity", "clipped_identity", "tanh", "hard_tanh"}
    assert view.axes == ["quant.ste", "seed"] and view.heat_y.value == C.NONE_AXIS
    heat = view.heat_source.data
    assert heat["n"] == [2, 2, 2, 2]            # mean and spread over the two seeds of each kind
    records = store.runs(sweep_id=sweep.name)
    assert {r.owner["page"] for r in records} == {"page-a"}
    for x, mean in zip(heat["x"], heat["mean"]):
        accs = [r.final["test_accuracy"] for r in records if r.point["quant.ste"] == x]
        assert mean == pytest.approx(np.mean(accs))
    other = view_of(store, tiny(), client=client2, owner="page-b")   # another page sees it, cannot stop it
    other.show_sweep(sweep.name)
    assert other.wait_loaded(30) and len(other.table.value) == 8
    assert other.stop_button.disabled and not other.stop_sweep()


@pytest.mark.slow
def test_stop_sweep_stops_the_running_and_queued_runs(store, client2):
    cfg = tiny()
    cfg.optim.epochs = 20_000     # minutes of training: the stop, not the end of a run, ends the sweep
    view = view_of(store, cfg, client=client2)
    view.axes_input.value, view.seeds_input.value = "quant.ste = identity, tanh, hard_tanh", "0-1"
    assert view.start_sweep() is not None
    wait_for(lambda: view.refresh(force=True) or any(r["status"] == "running" for r in view.rows), 120,
             "a running run in the table")
    assert not view.stop_button.disabled and view.start_button.disabled
    assert view.stop_sweep()
    wait_for(lambda: view.handle.done, 120, "the stopped sweep")
    view.refresh(force=True)
    statuses = list(view.table.value["status"])     # (a run may have finished just before the stop)
    assert "stopped" in statuses and set(statuses) <= {"stopped", "finished"} and len(statuses) < 6, statuses
    assert "stopped" in view.status.object and not view.busy


class _Handle:
    """Stands in for a running SweepHandle: records stop()."""

    def __init__(self):
        self.done, self.stopped = False, False

    def stop(self):
        self.stopped = True


@pytest.mark.parametrize("keep_alive", [False, True])
def test_the_dashboard_sweeps_tab_starts_from_the_sidebar_and_a_closing_page_stops_its_sweep(store, keep_alive):
    from qatlab.ui.dashboard import TAB_NAMES, Dashboard
    dash = Dashboard(config=tiny(), period=0)
    assert TAB_NAMES[-1] == "Sweeps" and dash.views[-1] is dash.sweeps and dash.sweeps.owner == dash.owner
    cfg = dash.sweeps.config_source()            # the sidebar's validated config
    assert (cfg.optim.epochs, cfg.model.hidden) == (1, [16])
    assert not dash.sweeps._built                # a hidden tab builds its widgets when first shown
    dash.tabs.active = TAB_NAMES.index("Sweeps")
    assert dash.sweeps._built
    dash.sweeps._store = store
    dash.sweeps.axes_input.value = "quant.nope = 1"
    assert dash.sweeps.start_sweep() is None and "nope" in dash.sweeps.message.object
    dash.config_panel.keep_alive.value = keep_alive
    dash.sweeps.handle = handle = _Handle()
    dash.close(join_timeout=1)
    assert handle.stopped is not keep_alive
