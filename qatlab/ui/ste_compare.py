"""STE comparison tab: one run per SteKind, overlaid and as small multiples, plus a ranking.

Figures (x linked), each with one line per kind named ``<metric>-<run id>`` and
coloured by :data:`qatlab.ui.figures.STE_COLORS`:

- ``fig-ste-loss`` (EMA train loss, ``ste-loss-<run id>``) and ``fig-ste-accuracy``
  (``ste-accuracy-<run id>``), overlaid, with click-to-hide legends;
- small multiples ``fig-ste-grad_norm``, ``fig-ste-noise_mse``, ``fig-ste-sqnr_db`` (one line per
  layer and kind, ``ste-<metric>_<i>-<run id>``, dash style = layer) and
  ``fig-ste-active_grad_fraction`` (``ste-active_grad_fraction-<run id>``); no legends there
  (the colour key sits above them), since each legend is re-rendered on every streamed tick.
  They sit in the **Per-layer detail** card (CSS class ``qatlab-ste-detail``), closed at first: they
  are built when it is first opened and keep their place while it stays open (closed, the browser
  draws the two overlays alone, which is what keeps four streaming runs' page cheap).

The summary table (an HTML pane, CSS class ``qatlab-ste-summary``; the DataFrame behind it is
``SteCompareView.summary``) ranks the kinds by latest test accuracy (descending), then wall time
(ascending).
"""
from __future__ import annotations

import math
import time
from types import SimpleNamespace

import pandas as pd
import panel as pn
import param
from bokeh.models import ColumnDataSource

from ..metrics import EPOCH_COLUMNS
from ..quant import SteKind

from . import figures as F
from .base import LiveView, bokeh_pane, frozen, one_message, rebind, stream_bindings
from .streaming import LOSS_COLUMNS, _empty, n_layers_of

SUMMARY_COLUMNS = ["rank", "ste", "status", "test_accuracy", "test_loss", "seconds", "steps_per_second", "steps",
                   "run"]

INTRO = ("Press **Compare STE kinds** in the sidebar: the current config is trained once per "
         "straight-through estimator (same seed and data, concurrently).")
DETAIL_TITLE = "Per-layer detail: gradient norm, quantization noise, SQNR, active-gradient fraction"
TABLE_PERIOD = 1.0  # seconds between summary-table refreshes

# (metric, title, y label, log-scale allowed); per-layer metrics draw one line per layer and kind
SMALL = [("grad_norm", "Gradient norm per layer", "‖∇W‖", True),
         ("noise_mse", "Quantization noise MSE per layer", "MSE", True),
         ("sqnr_db", "SQNR per layer", "dB", False),
         ("active_grad_fraction", "Active-gradient fraction", "fraction", False)]
SMALL_KEYS = {metric for metric, *_ in SMALL}
PER_LAYER = {"grad_norm", "noise_mse", "sqnr_db"}
_DASH_TEXT = {"solid": "───", "dashed": "‒ ‒", "dotted": "···", "dotdash": "·‒·", "dashdot": "‒·‒"}


class _NoRun:
    """What the overlays' lines of one kind draw from while no comparison is shown: empty sources
    (the attributes :func:`~qatlab.ui.base.stream_bindings` looks for on a RunStream)."""

    def __init__(self, kind: str):
        self.run = SimpleNamespace(id=f"none-{kind}")
        self.loss = ColumnDataSource(_empty(LOSS_COLUMNS))
        self.eval = ColumnDataSource(_empty(EPOCH_COLUMNS))
        self.train = self.phases = None


def summary_frame(runs: dict) -> pd.DataFrame:
    """Ranking table of ``{kind: run}``: best latest test accuracy first, then fastest."""
    rows = []
    for kind, run in runs.items():
        acc = run.log.last("test_accuracy")
        rows.append({"ste": str(kind.value if hasattr(kind, "value") else kind), "status": run.status,
                     "test_accuracy": acc, "test_loss": run.log.last("test_loss"),
                     "seconds": round(run.elapsed, 2), "steps_per_second": round(run.steps_per_second, 1),
                     "steps": run.steps_done, "run": run.id})
    rows.sort(key=lambda r: (-r["test_accuracy"] if math.isfinite(r["test_accuracy"]) else math.inf,
                             r["seconds"]))
    for rank, row in enumerate(rows, start=1):
        row["rank"] = rank
    return pd.DataFrame(rows, columns=SUMMARY_COLUMNS)


def _fmt(value, spec: str, scale: float = 1.0) -> str:
    return "–" if value is None or not math.isfinite(value) else format(value * scale, spec)


def summary_html(df: pd.DataFrame) -> str:
    """The ranking as a small HTML table (one colour swatch per kind, an accuracy bar)."""
    head = ("<tr><th>#</th><th>STE</th><th>status</th><th>test accuracy</th><th>test loss</th>"
            "<th>time (s)</th><th>steps/s</th><th>steps</th><th>run</th></tr>")
    rows = []
    for r in df.itertuples(index=False):
        color = F.STE_COLORS.get(r.ste, "#333333")
        acc = r.test_accuracy if math.isfinite(r.test_accuracy) else 0.0
        bar = (f"<span style='display:inline-block;width:80px;height:9px;background:#e6e6e6;margin-right:6px'>"
               f"<span style='display:block;height:9px;width:{100 * acc:.0f}%;background:{color}'></span></span>")
        rows.append(f"<tr><td>{r.rank}</td><td><span style='color:{color}'>&#9632;</span> {r.ste}</td>"
                    f"<td>{r.status}</td><td>{bar}{_fmt(r.test_accuracy, '.1f', 100)}%</td>"
                    f"<td>{_fmt(r.test_loss, '.4f')}</td><td>{_fmt(r.seconds, '.1f')}</td>"
                    f"<td>{_fmt(r.steps_per_second, ',.0f')}</td><td>{r.steps:,}</td><td>{r.run}</td></tr>")
    style = ("<style>table.qatlab-ste{border-collapse:collapse;width:100%;font-size:13px}"
             "table.qatlab-ste th{text-align:left;border-bottom:2px solid #0072B5;padding:4px 8px}"
             "table.qatlab-ste td{padding:3px 8px;border-bottom:1px solid #e0e0e0}</style>")
    return f"{style}<table class='qatlab-ste'><thead>{head}</thead><tbody>{''.join(rows)}</tbody></table>"


class SteCompareView(LiveView):
    """Overlaid curves, small multiples and a ranking for a ``{SteKind: run}`` comparison."""

    runs = param.Dict(default={}, doc="{SteKind: run} of the comparison shown.")

    def __init__(self, runs: dict | None = None, hub=None, options=None, lazy: bool = False, **params):
        super().__init__(hub, options, lazy, **params)
        self.figures: dict = {}
        self._shape = None           # what the overlays were built for: (x field, log y, kinds)
        self._bindings: dict = {}    # {kind: stream_bindings() of the figures for that kind's run}
        self._bound: list = []       # ids of the runs the figures' lines are bound to
        self.summary = summary_frame({})
        # A fixed-height HTML table: re-rendering it once a second costs the browser almost nothing,
        # while replacing a Tabulator's value re-lays out the whole page (the browser's main CPU cost
        # while runs stream).
        self.table = pn.pane.HTML(summary_html(self.summary), css_classes=["qatlab-ste-summary"], height=170,
                                  sizing_mode="stretch_width", margin=(0, 10))
        self.intro = pn.pane.Markdown(INTRO, margin=(5, 10))
        self._plots = pn.Column(sizing_mode="stretch_width")
        # The small multiples are built when this card is first opened, and drawn only while it is
        # open: closed, the page's browser draws the two overlays alone (the streaming goal).
        self.detail = pn.Card(title=DETAIL_TITLE, collapsed=True, sizing_mode="stretch_width",
                              css_classes=["qatlab-ste-detail"], margin=(5, 10))
        self.detail.param.watch(self._on_detail, "collapsed")
        self._x_range = None
        self._layers = None          # the layers the small multiples were built for
        self._no_runs = {k.value: _NoRun(k.value) for k in SteKind}
        self._layout = pn.Column(self.intro, self.table, self._plots, sizing_mode="stretch_width")
        self._last_summary = None
        self._last_state = None
        self._next_table = 0.0
        self.param.watch(lambda e: self.request_rebuild(), "runs")
        if runs:
            self.runs = runs
        elif not lazy:
            self.rebuild()

    @one_message
    def prepare(self) -> None:
        """Build the overlays, drawing from empty sources, even while the view is hidden (in pieces in
        a server session), so that the first comparison finds them; nothing if figures exist."""
        if not self.figures:
            self._begin_rebuild()

    def rebuild_steps(self):
        """(Re)create the figures for the current comparison and plot options, yielding after building
        each figure (see :meth:`LiveView.request_rebuild`): the loss and accuracy figures, shown
        together, then, when the detail card is open, the small multiples, shown together (each
        change of the shown layout makes the browser lay out the whole page again, so not one by one;
        all six in one event-loop turn would hold up the server's loop when several sessions press
        Compare at once). Figures drawn for the same kinds and options are reused, their lines
        pointed at the comparison's runs (or at empty sources when there is none)."""
        first = next(iter(self.runs.values()), None)
        streams = ({str(getattr(k, "value", k)): self.hub.stream(r) for k, r in self.runs.items()}
                   if self.runs else self._no_runs)
        layers = None if first is None else n_layers_of(first.config)
        if layers != self._layers:          # small multiples of other layers (or no runs): dropped
            self._drop_small_multiples()
            self._layers = layers
        shape = (self.x_field, self.options.log_y, tuple(streams))
        if self.figures and shape == self._shape:
            if self._bound != [rs.run.id for rs in streams.values()]:   # else: the detail card opened
                self._rebind(streams)
        else:
            yield from self._build_overlays(streams, shape)
        if first is not None and not self.detail.collapsed and "grad_norm" not in self.figures:
            yield from self._build_small_multiples(streams, layers)
        self._show_intro(first)
        self._bindings = {kind: stream_bindings(self.figures.values(), rs) for kind, rs in streams.items()}
        self._bound = [rs.run.id for rs in streams.values()]
        self._last_summary = None
        self.refresh(force=True)

    def _build_overlays(self, streams: dict, shape: tuple):
        """The loss and accuracy figures (overlaid kinds), shown once both are built; the small
        multiples of an earlier shape are dropped (built again when the detail card is open)."""
        x, y_log = self.x_field, self.options.log_y
        self._x_range = F.shared_x_range()
        yield
        loss = F.line_figure("Train loss (EMA) per STE", "loss", name="fig-ste-loss", x_field=x,
                             x_range=self._x_range, y_log=y_log, height=280)
        for kind, rs in streams.items():
            F.add_line(loss, rs.loss, x, "loss_s", **F.ste_line(kind), name=f"ste-loss-{rs.run.id}", label=kind)
        F.finish(loss)
        yield
        acc = F.line_figure("Test accuracy per STE", "accuracy", name="fig-ste-accuracy", x_field=x,
                            x_range=self._x_range, y_range=F.fraction_range(), height=280)
        for kind, rs in streams.items():
            F.add_line(acc, rs.eval, x, "test_accuracy", **F.ste_line(kind), name=f"ste-accuracy-{rs.run.id}",
                       label=kind)
        F.finish(acc, location="bottom_right")
        yield
        self.figures, self._shape = {"loss": loss, "accuracy": acc}, shape
        self.detail.objects = []
        self._plots.objects = [pn.Row(bokeh_pane(loss), bokeh_pane(acc), sizing_mode="stretch_width"),
                               self.detail]
        yield

    def _build_small_multiples(self, streams: dict, n_layers: int):
        """The four small multiples (one line per layer and kind) into the detail card."""
        x, y_log = self.x_field, self.options.log_y
        dash_key = " ".join(f"<span style='font-family:monospace'>{_DASH_TEXT[F.LAYER_DASHES[i % 5]]}</span> "
                            f"layer {i}" for i in range(n_layers))
        legend = " ".join(f"<span style='color:{F.STE_COLORS.get(k, '#333')};font-weight:600'>&#9632; {k}</span>"
                          for k in streams)
        small = {}
        for metric, title, ylab, logy in SMALL:
            # one figure per metric (layers as dash styles), no legend: every figure and legend costs
            # the browser a repaint per streamed tick
            fig = F.line_figure(title, ylab, name=f"fig-ste-{metric}", x_field=x, x_range=self._x_range,
                                y_log=y_log and logy, height=210)
            columns = [f"{metric}_{i}" for i in range(n_layers)] if metric in PER_LAYER else [metric]
            for i, col in enumerate(columns):
                for kind, rs in streams.items():
                    y = f"{col}_s" if f"{col}_s" in rs.train.data else col
                    F.add_line(fig, rs.train, x, y, color=F.STE_COLORS.get(kind, "#333333"), width=1.5,
                               dash=F.LAYER_DASHES[i % len(F.LAYER_DASHES)], name=f"ste-{col}-{rs.run.id}")
            small[metric] = fig
            yield
        self.figures = {**self.figures, **small}
        self.detail.objects = [
            pn.pane.HTML(f"{legend} &nbsp;&nbsp; {dash_key}", margin=(5, 10)),
            pn.GridBox(*(bokeh_pane(small[m]) for m, *_ in SMALL), ncols=2, sizing_mode="stretch_width")]

    def _drop_small_multiples(self) -> None:
        """Forget the small multiples (built again when the detail card is open and there are runs)."""
        gone = {id(r) for key, fig in self.figures.items() if key in SMALL_KEYS for r in fig.renderers}
        self.figures = {key: fig for key, fig in self.figures.items() if key not in SMALL_KEYS}
        self._bindings = {kind: [b for b in bindings if id(b[0]) not in gone]
                          for kind, bindings in self._bindings.items()}
        self.detail.objects = []

    def _on_detail(self, event) -> None:
        """Opening the detail card builds its small multiples (once per shape of comparison)."""
        if not event.new and self.runs and "grad_norm" not in self.figures:
            self.request_rebuild()

    def _rebind(self, streams: dict) -> None:
        """Point every line at the new runs' sources (and names): a comparison after the first
        builds no figure, the costliest part of a Compare for the server and the browser."""
        with frozen(self.figures["loss"]):
            for kind, bindings in self._bindings.items():
                rebind(bindings, streams[kind])
        self.drop_fitter()               # the ranges fit the new data from scratch

    def _show_intro(self, first) -> None:
        """The line above the table: what is compared (the intro while there is no comparison)."""
        if first is None:
            self.intro.object = INTRO
            self.table.visible = False
            return
        q = first.config.quant
        names = ", ".join(r.name for r in self.runs.values())
        self.intro.object = (f"**{len(self.runs)} STE kinds** · weights **{q.weights}**"
                             + (f" ({q.weight_bits} bit)" if q.weights == "fake" else "")
                             + f" · same seed and data · runs: {names}")
        self.table.visible = True

    def shown_runs(self) -> list:
        return list(self.runs.values())

    def _curves_state(self) -> tuple:
        """Per run: status, whether its loss curve has points, and its eval points (count, last step).
        When this changes the table follows on the same tick, so it never says "0 steps" or "-%"
        next to curves that already draw (a short run draws them within the throttle period)."""
        state = []
        for run in self.runs.values():
            if run.id not in self.hub:
                state.append((run.status, False, 0, None))
                continue
            rs = self.hub.stream(run)
            steps = rs.eval.data["step"]
            state.append((run.status, len(rs.loss.data["step"]) > 0, len(steps),
                          float(steps[-1]) if len(steps) else None))
        return tuple(state)

    def refresh(self, force: bool = False) -> None:
        """Re-rank the summary table: on the tick the curves get their first points, an eval point
        or a status change, else at most once per :data:`TABLE_PERIOD` s (only if it changed)."""
        now = time.monotonic()
        if not self.runs:
            return
        state = self._curves_state()
        if now < self._next_table and not force and state == self._last_state:
            return
        self._last_state = state
        self._next_table = now + TABLE_PERIOD
        df = summary_frame(self.runs)
        key = df.to_json()
        if key != self._last_summary:
            self._last_summary = key
            self.summary = df
            self.table.object = summary_html(df)

    def _panel(self):
        return self._layout
