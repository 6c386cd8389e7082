"""Sweeps tab: define a sweep from the sidebar's config, run it on the Dask workers, compare its runs.

- Form: ``Axes`` (one ``field = values`` per line, :mod:`qatlab.ui.sweep_form`), ``Seeds``, ``Sweep
  name``; ``Start sweep`` checks every point first (a bad field or value is named in the alert
  ``qatlab-sweep-message`` and nothing starts); ``Stop sweep`` (only the page that started it);
  ``Compare STE kinds (sweep)``: one axis over the four STE kinds with ``STE seeds`` seeds.
- The cluster (:func:`qatlab.executor.connect`) is reached on a background thread at the first
  sweep, and stored sweeps are read on one too: the page never waits for either.
- ``qatlab-sweep-table`` (Tabulator, one row per run, filling as runs start and end),
  ``fig-sweep-parallel`` (runs across the axes, coloured by ``Metric``), ``fig-sweep-heatmap`` (mean
  metric over two axes, spread over seeds on hover) and ``qatlab-sweep-summary`` (per point, seeds
  pooled: runs by status, the metric's mean, std, min, max and count over the finished runs). The table and both charts share one selection: ticking rows highlights their
  lines and cells; tapping or box-selecting lines, points or cells ticks the rows.
- ``Open these runs`` overlays the selected runs' loss and accuracy from the store
  (``fig-sweep-loss``, ``fig-sweep-accuracy``); ``qatlab-sweep-diff`` shows how two selected runs'
  configs differ.

A finished sweep is read once; while runs are active the view refreshes from the periodic tick
(at most once a second) and rebuilds its sources only when a run started or ended.
"""
from __future__ import annotations

import logging
import math
import statistics
import threading
import time

import pandas as pd
import panel as pn
from bokeh.models import ColumnDataSource
from bokeh.plotting import figure

from ..sweep import Sweep, SweepResult, config_diff
from ..sweep.runner import EndedRun
from . import figures as F
from . import sweep_charts as C
from .base import NO_AUTOLINKS, LiveView, Throttle, bokeh_pane, in_server_session, one_message
from .sweep_form import axes_text, parse_axes, parse_seeds, ste_grid
from .tables import patch_and_stream

log = logging.getLogger(__name__)

REFRESH_SECONDS = 1.0
STORED_REFRESH_SECONDS = 5.0     # a sweep another process runs: re-read the store this often
MAX_CURVES = 10
RECORD_CACHE = 8
PREFERRED_METRICS = ("test_accuracy", "test_loss", "train_loss", "train_accuracy")
TABLE_METRICS = ("test_accuracy", "test_loss", "train_loss", "steps", "steps_per_second")
FIXED_COLUMNS = ["name", "status", "progress", "seed"]
TAIL_COLUMNS = ["seconds", "worker", "message", "run_id"]
# New rows wait this long after a table was made: Tabulator throws when data reaches a table it is still
# building (tabulator#4800, seen on a loaded machine); a new table carries its first rows itself.
TABLE_SETTLE_SECONDS = 3.0


def handle_rows(handle) -> list[dict]:
    """One row per run the handle started so far (as :attr:`SweepResult.table` rows, plus progress)."""
    rows = []
    for run in list(handle.runs):
        if run.id in (None, "starting"):
            continue
        point = dict(run.point or {})
        seed = point.pop("seed", None)
        if isinstance(run, EndedRun):
            final = dict(run.final)
        else:                     # a RemoteRun: its final metrics once its result arrived
            result = run.result()
            final = dict(result.final) if result is not None else {}
        rows.append({**point, "seed": seed, **final, "status": run.status, "message": run.message or "",
                     "seconds": final.get("seconds"), "run_id": run.id, "name": run.name, "worker": run.worker,
                     "progress": 1.0 if run.done else float(run.progress)})
    return rows


def summary_frame(rows: list[dict], fields: list[str], metric: str) -> pd.DataFrame:
    """One row per point (its ``fields``; seeds pooled): runs by status and ``metric``'s mean, std
    (sample; 0 for one run), min, max and count over the FINISHED runs only."""
    groups: dict[tuple, list[dict]] = {}
    for r in rows:
        groups.setdefault(tuple(C.value_text(r.get(f)) for f in fields), []).append(r)
    out = []
    for key, members in groups.items():
        vals = [float(r[metric]) for r in members if r["status"] == "finished" and C.is_number(r.get(metric))]
        n = len(vals)
        row = dict(zip(fields, key))
        row.update({"runs": len(members), "finished": sum(r["status"] == "finished" for r in members),
                    "other statuses": ", ".join(sorted({r["status"] for r in members} - {"finished"})) or "-",
                    "metric": metric, "mean": statistics.fmean(vals) if n else math.nan,
                    "std": statistics.stdev(vals) if n > 1 else (0.0 if n else math.nan),
                    "min": min(vals) if n else math.nan, "max": max(vals) if n else math.nan, "n": n})
        out.append(row)
    return pd.DataFrame(out)


def result_rows(result: SweepResult) -> list[dict]:
    rows = result.table
    for r in rows:
        r["progress"] = 1.0 if r["status"] not in ("created", "running", "paused") else math.nan
    return rows


def list_sweeps(store) -> list[tuple[str, int]]:
    """(sweep id, runs) of every sweep in the store, in the order they were first run."""
    counts: dict[str, int] = {}
    for r in store.runs():
        if r.sweep_id:
            counts[r.sweep_id] = counts.get(r.sweep_id, 0) + 1
    return list(counts.items())


class SweepView(LiveView):
    """The Sweeps tab (see the module doc).

    Args:
        config_source: returns the base ExperimentConfig of a new sweep, or None when it is invalid
            (the Dashboard passes its sidebar's ``validated``).
        owner: the page's owner id, stamped on its sweeps' runs.
        store: the RunStore (default ``RunStore()``, opened at first use: ``$QATLAB_STORE`` or the
            per-user default).
        client: a Dask client (default :func:`qatlab.executor.connect`, at the first sweep).
    """

    def __init__(self, hub=None, options=None, lazy: bool = False, config_source=None, owner=None, store=None,
                 client=None, **params):
        super().__init__(hub, options, lazy, **params)
        self.config_source = config_source
        self.owner = owner
        self._store, self.client = store, client
        self.handle = None                     # the sweep this page started (None before the first)
        self.shown: str | None = None          # the sweep id on display
        self.figures: dict = {}                # (no live time series: nothing for the range fitter)
        self.rows: list[dict] = []
        self.axes: list[str] = []
        self.selected: list[int] = []
        self.cell_members: list[list[int]] = []
        self._key = self._data_key = None
        self._chart_key = None
        self._table_made = -math.inf           # time.monotonic() of the last new Tabulator
        self._syncing = False
        self._choosing = False                 # the choices are being set: one redraw after, not one each
        self._throttle = Throttle(REFRESH_SECONDS)
        self._lock = threading.RLock()
        self._launching = None                 # (sweep, thread) while connecting and submitting
        self._launch_error: str | None = None
        self._stored: dict = {}                # sweep id -> rows read from the store
        self._stored_at: dict = {}             # sweep id -> when they were read (monotonic)
        self._loading: set = set()
        self._sweeps: list[tuple[str, int]] | None = None
        self._records: dict = {}               # run id -> RunRecord, the last RECORD_CACHE asked
        self._holder = pn.Column(sizing_mode="stretch_width")   # the tab's content, once built
        self._built = False
        if not lazy:
            self.build()

    def build(self) -> None:
        """Make the widgets and charts (a lazy view does it when first shown: opening a page stays cheap)."""
        if self._built:
            return
        self._built = True
        self._build_widgets()
        self._build_charts()
        self._holder.objects = [self._compose()]

    def set_active(self, active: bool) -> None:
        if active:
            self.build()
        super().set_active(active)

    # ------------------------------------------------------------------ widgets

    def _build_widgets(self) -> None:
        self.axes_input = pn.widgets.TextAreaInput(
            label="Axes", value="quant.ste = identity, hard_tanh", height=90, sizing_mode="stretch_width",
            placeholder="one per line: quant.ste = identity, hard_tanh\nquant.weight_bits = [2, 4, 8]")
        self.seeds_input = pn.widgets.TextInput(label="Seeds", value="0", width=120)
        self.name_input = pn.widgets.TextInput(label="Sweep name", placeholder="automatic", width=180)
        self.start_button = pn.widgets.Button(label="Start sweep", color="primary", align="end")
        self.stop_button = pn.widgets.Button(label="Stop sweep", color="danger", align="end", disabled=True)
        self.ste_seeds = pn.widgets.IntInput(label="STE seeds", value=1, start=1, end=20, width=90)
        self.ste_button = pn.widgets.Button(label="Compare STE kinds (sweep)", color="success", align="end")
        self.message = pn.pane.Alert("", alert_type="danger", visible=False, css_classes=["qatlab-sweep-message"],
                                     sizing_mode="stretch_width", margin=(5, 10), renderer_options=NO_AUTOLINKS)
        self.status = pn.pane.Markdown("No sweep yet.", css_classes=["qatlab-sweep-status"], margin=(0, 10))
        self.sweep_select = pn.widgets.Select(label="Sweep", options=[], width=260)
        self.metric_select = pn.widgets.Select(label="Metric", options=["test_accuracy"], value="test_accuracy",
                                               width=160)
        self.heat_x = pn.widgets.Select(label="Heatmap x", options=[], width=160)
        self.heat_y = pn.widgets.Select(label="Heatmap y", options=[C.NONE_AXIS], value=C.NONE_AXIS, width=160)
        self.table = self._new_table(FIXED_COLUMNS + TAIL_COLUMNS)
        self.table_box = pn.Column(self.table, sizing_mode="stretch_width")
        self.summary = self._new_summary(pd.DataFrame())
        self.summary_box = pn.Column(self.summary, sizing_mode="stretch_width")
        self.open_button = pn.widgets.Button(label="Open these runs", disabled=True)
        self.diff = pn.pane.Markdown("Select two runs to see how their configs differ.",
                                     css_classes=["qatlab-sweep-diff"], margin=(0, 10),
                                     renderer_options=NO_AUTOLINKS)
        self.curves = pn.Column(sizing_mode="stretch_width")
        self.start_button.on_click(lambda _: self.start_sweep())
        self.stop_button.on_click(lambda _: self.stop_sweep())
        self.ste_button.on_click(lambda _: self.compare_ste())
        self.open_button.on_click(lambda _: self.open_runs())
        self.sweep_select.param.watch(lambda e: e.new and self.show_sweep(e.new), "value")
        for w in (self.metric_select, self.heat_x, self.heat_y):
            w.param.watch(lambda _: self._choosing or self._redraw_charts(), "value")

    def _new_table(self, columns: list[str]) -> pn.widgets.Tabulator:
        table = pn.widgets.Tabulator(pd.DataFrame(columns=columns), css_classes=["qatlab-sweep-table"],
                                     selectable="checkbox", disabled=True, show_index=False, height=300,
                                     sizing_mode="stretch_width",
                                     formatters={"progress": {"type": "progress", "max": 1}})
        table.param.watch(self._on_table_selection, "selection")
        return table

    def _build_charts(self) -> None:
        self.source = ColumnDataSource({k: [] for k in ("run_id", "name", "status", "value", "xs", "ys", "mx", "my",
                                                        "label")}, name="sweep-runs")
        self.ticks = ColumnDataSource({"x": [], "y": [], "text": []}, name="sweep-ticks")
        self.heat_source = ColumnDataSource({k: [] for k in ("x", "y", "mean", "std", "min", "max", "n", "runs",
                                                             "text")}, name="sweep-heat")
        self.mapper = C.color_mapper(0.0, 1.0)
        self.heat_mapper = C.color_mapper(0.0, 1.0)
        self.source.selected.on_change("indices", self._on_chart_selection)
        self.heat_source.selected.on_change("indices", self._on_heat_selection)
        self.charts = pn.Row(sizing_mode="stretch_width")
        self._chart_shape = None

    def _compose(self):
        form = pn.Column(
            pn.pane.Markdown("Runs of the sidebar's config over the axes below, times the seeds, trained on the "
                             "Dask workers and kept in the run store.", margin=(5, 10)),
            self.axes_input,
            pn.Row(self.seeds_input, self.name_input, self.start_button, self.stop_button),
            pn.Row(self.ste_seeds, self.ste_button),
            self.message, sizing_mode="stretch_width")
        return pn.Column(form, pn.Row(self.sweep_select, self.metric_select, self.heat_x, self.heat_y),
                         self.status, self.table_box, self.charts, self.summary_box,
                         pn.Row(self.open_button), self.diff, self.curves, sizing_mode="stretch_width")

    def _panel(self):
        return self._holder

    # ------------------------------------------------------------------ store and cluster

    @property
    def store(self):
        with self._lock:              # (background readers may ask first: open it once)
            if self._store is None:
                from ..store import RunStore
                self._store = RunStore()
        return self._store

    def _say(self, text: str) -> None:
        self.message.object, self.message.visible = text, bool(text)

    # ------------------------------------------------------------------ starting and stopping

    def build_sweep(self) -> Sweep | None:
        """The Sweep the form describes, every point checked; None (and the reason in the alert) if not."""
        base = self.config_source() if self.config_source is not None else None
        if base is None:
            self._say("The sidebar's config is not valid (see the sidebar); fix it to start a sweep.")
            return None
        try:
            grid = parse_axes(self.axes_input.value or "")
            seeds = parse_seeds(self.seeds_input.value or "")
            name = (self.name_input.value or "").strip() or None
            sweep = Sweep(base, grid=grid or None, seeds=seeds, name=name)
        except (ValueError, TypeError) as exc:
            self._say(" ".join(str(exc).split()))
            return None
        self._say("")
        return sweep

    def start_sweep(self) -> Sweep | None:
        """``Start sweep``: check the form, then connect and submit on a background thread."""
        self.build()
        if self.busy:
            self._say("This page's sweep is still running: stop it or wait for it to end.")
            return None
        sweep = self.build_sweep()
        if sweep is None:
            return None
        thread = threading.Thread(target=self._launch, args=(sweep,), name=f"qatlab-sweep-launch-{sweep.name[:16]}",
                                  daemon=True)
        self._launching, self._launch_error = (sweep, thread), None
        self.shown = sweep.name
        self._sweeps = None
        thread.start()
        self.refresh(force=True)
        return sweep

    def compare_ste(self) -> Sweep | None:
        """``Compare STE kinds (sweep)``: one axis over the four STE kinds, ``STE seeds`` seeds."""
        self.build()
        self.axes_input.value = axes_text(ste_grid())
        n = self.ste_seeds.value or 1
        self.seeds_input.value = "0" if n == 1 else f"0-{n - 1}"
        self.name_input.value = ""
        return self.start_sweep()

    def _launch(self, sweep: Sweep) -> None:
        try:
            if self.client is None:
                from ..executor import connect
                self.client = connect()
            handle = sweep.submit(store=self.store, client=self.client, owner=self.owner)
            if handle.skipped:        # a resumed sweep: show the runs that had finished before too
                self._load_stored(sweep.name)
            self.handle = handle
        except Exception as exc:      # the cluster or the store failed: say so on the page
            log.exception("qatlab: starting sweep %s failed", sweep.name)
            self._launch_error = f"Starting the sweep failed: {' '.join(str(exc).split())}"
        finally:
            self._launching = None

    @property
    def busy(self) -> bool:
        """This page has a sweep starting or running."""
        return self._launching is not None or (self.handle is not None and not self.handle.done)

    def stop_sweep(self) -> bool:
        """``Stop sweep``: stop this page's sweep (no other page can: only this one has its handle)."""
        if self.handle is None or self.handle.done:
            return False
        self.handle.stop()
        self.refresh(force=True)
        return True

    def close(self, stop: bool = True) -> None:
        """The page closed: stop its sweep unless ``stop`` is False (keep-alive)."""
        if stop and self.handle is not None and not self.handle.done:
            self.handle.stop()

    # ------------------------------------------------------------------ showing a sweep

    def show_sweep(self, name: str) -> None:
        """Show the sweep ``name`` (this page's live one, or one read from the store in the background)."""
        self.build()
        if name == self.shown:
            return
        self.shown = name
        self._set_selection([])
        self.refresh(force=True)

    def wait_loaded(self, timeout: float = 60.0) -> bool:
        """Wait until the shown sweep's rows are read (tests and benches); True if they are."""
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            self.refresh(force=True)
            if self.shown in self._stored or self._live():
                return True
            time.sleep(0.05)
        return False

    def _live(self) -> bool:
        return self.handle is not None and self.handle.sweep.name == self.shown

    def _load_stored(self, name: str) -> None:
        """Read the sweep's runs from the store (on the calling thread)."""
        try:
            result = SweepResult.from_records(name, self.store.runs(sweep_id=name))
            rows = result_rows(result)
        except Exception:
            log.exception("qatlab: reading sweep %s from the store failed", name)
            rows = []
        with self._lock:
            self._stored[name], self._stored_at[name] = rows, time.monotonic()
            self._loading.discard(name)

    def _load_in_background(self, name: str) -> None:
        with self._lock:
            if name in self._loading:
                return
            self._loading.add(name)
        threading.Thread(target=self._load_stored, args=(name,), name="qatlab-sweep-read", daemon=True).start()

    def _load_sweep_list(self) -> None:
        try:
            self._sweeps = list_sweeps(self.store)
        except Exception:
            log.exception("qatlab: listing the store's sweeps failed")
            self._sweeps = []

    def _current_rows(self) -> list[dict] | None:
        """The shown sweep's rows now (None while they are being read)."""
        name = self.shown
        if name is None:
            return []
        if self._live():
            live = handle_rows(self.handle)
            before = self._stored.get(name, [])
            if before:              # resumed: the runs that finished before (read at its start), then this session's
                ids = {r["run_id"] for r in live}
                before = [r for r in before if r["status"] == "finished" and r["run_id"] not in ids]
            return before + live
        with self._lock:
            rows, at = self._stored.get(name), self._stored_at.get(name, 0.0)
        active = rows is not None and any(r["status"] in ("created", "running", "paused") for r in rows)
        if rows is None or (active and time.monotonic() - at >= STORED_REFRESH_SECONDS):
            self._load_in_background(name)
        return rows

    # ------------------------------------------------------------------ refresh

    def refresh(self, force: bool = False) -> None:
        """Pick up a started sweep, re-read the shown sweep's rows and apply them if they changed
        (at most once a second unless ``force``)."""
        if not self._built or not self._throttle.ready(force):
            return
        if self._launch_error:
            self._say(self._launch_error)
            self._launch_error = None
        if self._sweeps is None and self._active:
            self._sweeps = []
            threading.Thread(target=self._load_sweep_list, name="qatlab-sweep-list", daemon=True).start()
        self._update_select()
        rows = self._current_rows()
        self.stop_button.disabled = not (self.handle is not None and not self.handle.done)
        self.start_button.disabled = self.ste_button.disabled = self.busy
        self._update_status(rows)
        if rows is not None:
            self.apply_rows(rows)

    def _update_select(self) -> None:
        names = [name for name, _ in (self._sweeps or [])]
        for extra in (self.handle.sweep.name if self.handle is not None else None, self.shown):
            if extra and extra not in names:
                names.append(extra)
        if list(self.sweep_select.options) != names:
            self.sweep_select.options = names
        if self.shown is not None and self.sweep_select.value != self.shown:
            self.sweep_select.value = self.shown

    def _update_status(self, rows) -> None:
        if self._launching is not None:
            text = f"**{self._launching[0].name}**: connecting to the cluster and starting ..."
        elif self.shown is None:
            text = "No sweep yet: type the axes and seeds, then *Start sweep*."
        elif rows is None:
            text = f"**{self.shown}**: reading its runs from the store ..."
        else:
            counts: dict[str, int] = {}
            for r in rows:
                counts[r["status"]] = counts.get(r["status"], 0) + 1
            if self._live():
                queued = self.handle.counts().get("queued", 0)
                if queued:
                    counts["queued"] = queued
                state = "done" if self.handle.done else "running"
            else:
                state = "stored"
            shown = ", ".join(f"{n} {s}" for s, n in sorted(counts.items())) or "no runs yet"
            text = f"**{self.shown}** ({state}): {shown}"
        if self.status.object != text:
            self.status.object = text

    def apply_rows(self, rows: list[dict]) -> None:
        """Show ``rows`` in the table, the charts and the summary (only what changed)."""
        key = tuple((r["run_id"], r["status"], round(r.get("progress") or 0.0, 2), len(r)) for r in rows)
        if key == self._key or (in_server_session() and time.monotonic() - self._table_made < TABLE_SETTLE_SECONDS):
            return                                     # (a refresh later applies them)
        self._key = key
        self._data_key = tuple(k[:2] + k[3:] for k in key)     # what the charts draw: progress aside
        self.rows = rows
        axes = self._axes(rows)
        # the table's columns stay the same while a sweep runs (a new column means a new table)
        metrics = list(TABLE_METRICS) + [m for m in self._metrics(rows) if m not in TABLE_METRICS]
        columns = FIXED_COLUMNS + self._fields(rows) + metrics + TAIL_COLUMNS
        df = pd.DataFrame([{c: _cell(r.get(c)) for c in columns} for r in rows], columns=columns)
        self._update_table(df)
        self.axes = axes
        self._choosing = True
        try:
            self._update_choices(rows, axes)
        finally:
            self._choosing = False
        self._redraw_charts()

    def _fields(self, rows: list[dict]) -> list[str]:
        """The sweep's dotted fields (its plan's when it runs here, else those its runs carry)."""
        fields = list(self.handle.sweep.points[0].fields) if self._live() and self.handle.sweep.points else []
        for r in rows:
            fields += [k for k in r if k not in fields and k not in _NOT_AXES]
        return [f for f in fields if "." in f]

    def _axes(self, rows: list[dict]) -> list[str]:
        """The fields that vary between the runs (and ``seed`` when there are several seeds)."""
        fields = self._fields(rows)
        varying = [f for f in fields if len({C.value_text(r.get(f)) for r in rows}) > 1] or fields[:1]
        if len({r.get("seed") for r in rows}) > 1 or not varying:
            varying.append("seed")
        return varying

    @staticmethod
    def _metrics(rows: list[dict]) -> list[str]:
        found = []
        for r in rows:
            if r["status"] == "finished":
                found += [k for k, v in r.items() if k not in found and k not in _NOT_AXES and "." not in k
                          and k != "seed" and C.is_number(v)]
        return [m for m in PREFERRED_METRICS if m in found] + [m for m in found if m not in PREFERRED_METRICS]

    def _update_table(self, df: pd.DataFrame) -> None:
        old = self.table.value
        if list(old.columns) != list(df.columns):     # another sweep's columns: a new table
            selection = list(self.selected)
            self.table = self._new_table(list(df.columns))
            self._table_made = time.monotonic()
            self.table.value = df
            self.table_box.objects = [self.table]
            self._set_table_selection(selection)
            return
        n = len(old)
        if n and len(df) >= n and list(df["run_id"].iloc[:n]) == list(old["run_id"]):
            patch_and_stream(self.table, old, df)
        else:
            self.table.value = df
            self._set_table_selection(self.selected)

    def _update_summary(self, df: pd.DataFrame) -> None:
        if list(self.summary.value.columns) != list(df.columns):     # another sweep's fields: a new table
            self.summary = self._new_summary(df)
            self._table_made = time.monotonic()
            self.summary_box.objects = [self.summary]
        else:
            self.summary.value = df

    @staticmethod
    def _new_summary(df: pd.DataFrame) -> pn.widgets.Tabulator:
        return pn.widgets.Tabulator(df, css_classes=["qatlab-sweep-summary"], disabled=True, show_index=False,
                                    sizing_mode="stretch_width", height=160)

    def _update_choices(self, rows, axes) -> None:
        metrics = self._metrics(rows) or ["test_accuracy"]
        if list(self.metric_select.options) != metrics:
            value = self.metric_select.value if self.metric_select.value in metrics else metrics[0]
            self.metric_select.options = metrics
            self.metric_select.value = value
        if list(self.heat_x.options) != axes:
            self.heat_x.options = axes
            self.heat_x.value = axes[0]
        ys = [a for a in axes if a != self.heat_x.value] + [C.NONE_AXIS]
        if list(self.heat_y.options) != ys:
            self.heat_y.options = ys
            self.heat_y.value = ys[0] if len(axes) > 1 and ys[0] != "seed" else C.NONE_AXIS

    # ------------------------------------------------------------------ charts

    @one_message
    def _redraw_charts(self) -> None:
        rows, axes, metric = self.rows, self.axes, self.metric_select.value
        if not rows or not axes:
            self.charts.objects = []
            self.cell_members = []
            return
        x_axis = self.heat_x.value if self.heat_x.value in axes else axes[0]
        y_axis = self.heat_y.value if self.heat_y.value in axes and self.heat_y.value != x_axis else C.NONE_AXIS
        chart_key = (self._data_key, metric, x_axis, y_axis)
        if chart_key == self._chart_key:
            return
        self._chart_key = chart_key
        self._update_summary(summary_frame(rows, [a for a in axes if a != "seed"], metric))
        cols, ticks = C.parallel_columns(rows, axes, metric)
        cells, members, xf, yf = C.heat_cells(rows, x_axis, y_axis, metric)
        self.mapper.low, self.mapper.high = C.metric_range(cols["value"])
        self.heat_mapper.low, self.heat_mapper.high = C.metric_range(cells["mean"])
        self._syncing = True
        try:
            self.source.data = cols
            self.ticks.data = ticks
            self.heat_source.data = cells
            self.cell_members = members
            shape = (tuple(axes), x_axis, y_axis, tuple(xf), tuple(yf))
            if shape != self._chart_shape:     # new axes or factors: new figures on the same sources
                self._chart_shape = shape
                self.parallel = C.parallel_figure(self.source, self.ticks, axes + [metric], self.mapper)
                self.heatmap = C.heat_figure(self.heat_source, xf, yf, self.heat_mapper, x_axis, y_axis, metric)
                self.charts.objects = [bokeh_pane(self.parallel), bokeh_pane(self.heatmap)]
            else:                              # another metric: the same figures, new labels
                C.label_metric(self.parallel, self.heatmap, axes + [metric])
            self._apply_selection(self.selected, table=False)
        finally:
            self._syncing = False

    # ------------------------------------------------------------------ selection

    def select(self, indices) -> None:
        """Select runs by their row index: table ticks, chart highlights, diff (what a click does)."""
        self._set_selection(indices)

    def selected_ids(self) -> list[str]:
        return [self.rows[i]["run_id"] for i in self.selected if 0 <= i < len(self.rows)]

    def _on_table_selection(self, event) -> None:
        if not self._syncing:
            self._set_selection(event.new)

    def _on_chart_selection(self, attr, old, new) -> None:
        if not self._syncing:
            self._set_selection(new)

    def _on_heat_selection(self, attr, old, new) -> None:
        if not self._syncing:
            self._set_selection(sorted({i for c in new if 0 <= c < len(self.cell_members)
                                        for i in self.cell_members[c]}))

    @one_message
    def _set_selection(self, indices) -> None:
        indices = sorted({int(i) for i in indices if 0 <= int(i) < len(self.rows)})
        self._syncing = True
        try:
            self._apply_selection(indices, table=True)
        finally:
            self._syncing = False
        self.selected = indices
        self.open_button.disabled = not indices
        self._show_diff()

    def _set_table_selection(self, indices) -> None:
        self._syncing = True
        try:
            self.table.selection = list(indices)
        finally:
            self._syncing = False

    def _apply_selection(self, indices, table: bool) -> None:
        if table and list(self.table.selection) != list(indices):
            self.table.selection = list(indices)
        if list(self.source.selected.indices) != list(indices):
            self.source.selected.indices = list(indices)
        chosen = set(indices)
        cells = [c for c, members in enumerate(self.cell_members) if chosen & set(members)]
        if list(self.heat_source.selected.indices) != cells:
            self.heat_source.selected.indices = cells

    def _show_diff(self) -> None:
        ids = self.selected_ids()
        if len(ids) != 2:
            text = "Select two runs to see how their configs differ."
        else:
            try:
                a, b = (self._record(i) for i in ids)
                diff = config_diff(a.config_dict, b.config_dict)
            except KeyError:
                diff = None
            if diff is None:
                text = "One of the two runs is no longer in the store."
            elif not diff:
                text = f"**{a.name}** and **{b.name}** have the same config."
            else:
                lines = [f"| field | {_md(a.name)} | {_md(b.name)} |", "|---|---|---|"]
                lines += [f"| {f} | {_md(C.value_text(x))} | {_md(C.value_text(y))} |" for f, (x, y) in diff.items()]
                text = "\n".join(lines)
        if self.diff.object != text:
            self.diff.object = text

    def _record(self, run_id: str):
        """The store's record of a run, kept for the last few asked (a diff per click re-reads none)."""
        record = self._records.pop(run_id, None) or self.store.get(run_id)
        self._records[run_id] = record
        while len(self._records) > RECORD_CACHE:
            self._records.pop(next(iter(self._records)))
        return record

    # ------------------------------------------------------------------ curves

    def open_runs(self) -> list[str]:
        """``Open these runs``: overlay the selected runs' loss and test accuracy (from the store;
        at most :data:`MAX_CURVES`). Returns the ids shown."""
        ids = self.selected_ids()[:MAX_CURVES]
        if not ids:
            self.curves.objects = []
            return []
        loss = figure(title="Loss of the selected runs", name="fig-sweep-loss", height=260,
                      sizing_mode="stretch_width", tools=F.TOOLS, x_axis_label="step", y_axis_label="loss")
        acc = figure(title="Test accuracy of the selected runs", name="fig-sweep-accuracy", height=260,
                     sizing_mode="stretch_width", tools=F.TOOLS, x_axis_label="step", y_axis_label="accuracy")
        names = {r["run_id"]: r.get("name") or r["run_id"][:8] for r in self.rows}
        for i, rid in enumerate(ids):
            try:
                h = self.store.history(rid)
            except KeyError:
                continue
            color, label = F.run_color(i), names.get(rid, rid[:8])
            for fig, col in ((loss, "loss"), (acc, "test_accuracy")):
                if col in h and "step" in h:
                    keep = ~pd.isna(h[col])
                    src = ColumnDataSource({"step": h["step"][keep], "y": h[col][keep]}, name=f"sweep-{col}-{rid}")
                    fig.line("step", "y", source=src, color=color, line_width=2, legend_label=label)
        for fig in (loss, acc):
            F.style_text(fig)
            if fig.legend:
                fig.legend.label_text_font_size = "10px"
                fig.legend.click_policy = "hide"
        self.curves.objects = [pn.Row(bokeh_pane(loss), bokeh_pane(acc), sizing_mode="stretch_width")]
        return ids


_NOT_AXES = {"status", "message", "seconds", "run_id", "name", "worker", "progress", "seed"}


def _cell(value):
    """A table cell: lists as text (Tabulator shows scalars)."""
    return C.value_text(value) if isinstance(value, (list, tuple, dict)) else value


def _md(text) -> str:
    return str(text).replace("|", "\\|")
