"""STE comparison tab: one run per SteKind, overlaid and as small multiples, plus a ranking.

Figures (x linked), each with one line per kind named ``<metric>-<run id>`` and
coloured by :data:`qatlab.ui.figures.STE_COLORS`:

- ``fig-ste-loss`` (EMA train loss, ``ste-loss-<run id>``) and ``fig-ste-accuracy``
  (``ste-accuracy-<run id>``), overlaid, with click-to-hide legends;
- small multiples ``fig-ste-grad_norm``, ``fig-ste-noise_mse``, ``fig-ste-sqnr_db`` (one line per
  layer and kind, ``ste-<metric>_<i>-<run id>``, dash style = layer) and
  ``fig-ste-active_grad_fraction`` (``ste-active_grad_fraction-<run id>``); no legends there
  (the colour key sits above them), since each legend is re-rendered on every streamed tick.

A served page builds the figures while it loads (:meth:`SteCompareView.prepare`); a comparison
moves their lines to its runs. Lines no run uses are unnamed and draw nothing.

The summary table (an HTML pane, CSS class ``qatlab-ste-summary``; the DataFrame behind it is
``SteCompareView.summary``) ranks the kinds by latest test accuracy (descending), then wall time
(ascending).
"""
from __future__ import annotations

import math
import time

import pandas as pd
import panel as pn
import param
from bokeh.models import ColumnDataSource
from bokeh.models.glyphs import Line

from . import figures as F
from .base import LiveView, bokeh_pane, frozen
from .streaming import is_smoothed, n_layers_of

SUMMARY_COLUMNS = ["rank", "ste", "status", "test_accuracy", "test_loss", "seconds", "steps_per_second", "steps",
                   "run"]

INTRO = ("Press **Compare STE kinds** in the sidebar: the current config is trained once per "
         "straight-through estimator (same seed and data, concurrently).")
TABLE_PERIOD = 1.0  # seconds between summary-table refreshes

# (metric, title, y label, log-scale allowed); per-layer metrics draw one line per layer and kind
SMALL = [("grad_norm", "Gradient norm per layer", "‖∇W‖", True),
         ("noise_mse", "Quantization noise MSE per layer", "MSE", True),
         ("sqnr_db", "SQNR per layer", "dB", False),
         ("active_grad_fraction", "Active-gradient fraction", "fraction", False)]
PER_LAYER = {"grad_norm", "noise_mse", "sqnr_db"}
_DASH_TEXT = {"solid": "───", "dashed": "‒ ‒", "dotted": "···", "dotdash": "·‒·", "dashdot": "‒·‒"}


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


def _legend_glyph(kind: str) -> Line:
    """What a kind's legend entry shows: its overlaid curve's colour, dash and width."""
    style = F.ste_line(kind)
    return Line(line_color=style["color"], line_dash=style["dash"], line_width=style["width"])


def _small_multiples_key(kinds: list, n_layers: int) -> str:
    """HTML key above the small multiples: each kind's colour and each layer's dash style."""
    colours = " ".join(f"<span style='color:{F.STE_COLORS.get(k, '#333')};font-weight:600'>&#9632; {k}</span>"
                       for k in kinds)
    dashes = " ".join(f"<span style='font-family:monospace'>{_DASH_TEXT[F.LAYER_DASHES[i % 5]]}</span> layer {i}"
                      for i in range(n_layers))
    return f"<b>Small multiples</b> &nbsp; {colours} &nbsp;&nbsp; {dashes}"


#: The RunStream source the overlaid figures' lines draw from; the small multiples draw from "train".
_SOURCE = {"loss": "loss", "accuracy": "eval"}


def _line_layers(n_layers: int) -> list[tuple[str, list]]:
    """``[(metric, [layer or None, ...])]``: the lines each figure draws per kind."""
    return ([("loss", [None]), ("accuracy", [None])]
            + [(m, list(range(n_layers)) if m in PER_LAYER else [None]) for m, *_ in SMALL])


class SteCompareView(LiveView):
    """Overlaid curves, small multiples and a ranking for a ``{SteKind: run}`` comparison."""

    runs = param.Dict(default={}, doc="{SteKind: run} of the comparison shown.")

    def __init__(self, runs: dict | None = None, hub=None, options=None, lazy: bool = False, **params):
        super().__init__(hub, options, lazy, **params)
        self.figures: dict = {}
        self._shape = None           # what the figures were built for: (x field, log y)
        self._unfinished = None      # (shape, x range, figures, legends) of a build not yet done
        self._lines: dict = {}       # {(metric, layer or None, kind): line} drawn so far in the figures
        self._parking: dict = {}     # {source kind: empty source} the lines no run uses draw from
        self._legends: dict = {}     # {metric: {kind: legend proxy}} of the overlaid figures
        self._prepared = 0           # layers to draw lines for before the first comparison (prepare())
        self.summary = summary_frame({})
        # A fixed-height HTML table: re-rendering it once a second costs the browser almost nothing,
        # while replacing a Tabulator's value re-lays out the whole page (the browser's main CPU cost
        # while runs stream).
        self.table = pn.pane.HTML(summary_html(self.summary), css_classes=["qatlab-ste-summary"], height=170,
                                  sizing_mode="stretch_width", margin=(0, 10))
        self.intro = pn.pane.Markdown(INTRO, margin=(5, 10))
        self.key = pn.pane.HTML("", margin=(5, 10))      # colours and dash styles of the small multiples
        self._plots = pn.Column(sizing_mode="stretch_width", visible=False)
        self._layout = pn.Column(self.intro, self.table, self._plots, sizing_mode="stretch_width")
        self._last_summary = None
        self._last_state = None
        self._next_table = 0.0
        self.param.watch(lambda e: self.request_rebuild(), "runs")
        if runs:
            self.runs = runs
        else:
            self.rebuild()

    def prepare(self, layers: int) -> None:
        """Build the figures, with lines for a comparison of ``layers`` weight layers, before the
        first comparison and even while the tab is hidden. Building six figures is most of what a
        page's first Compare costs the server and the browser, which share the CPU with the
        comparison's training; with the figures built, a Compare moves their lines to its runs."""
        self._prepared = layers
        if not self.figures:
            self.request_rebuild(hidden=True)

    def rebuild_steps(self):
        """Build the figures if there are none for the plot options (yielding after each figure,
        see :meth:`LiveView.request_rebuild`), then move their lines to the comparison's runs
        (:meth:`_draw`). The figures show once their lines are drawn."""
        shape = (self.x_field, self.options.log_y)
        new = (self.runs or self._prepared) and (not self.figures or shape != self._shape)
        if new:
            yield from self._build_figures(*shape)
        if not self.runs:
            if new:
                self._draw({kind: None for kind in F.STE_COLORS}, self._prepared)
                self._show_figures()
            self._plots.visible = self.table.visible = False
            self.intro.object = INTRO
            return
        streams = {str(getattr(k, "value", k)): self.hub.stream(r) for k, r in self.runs.items()}
        first = next(iter(self.runs.values()))
        self._draw(streams, n_layers_of(first.config))
        if new:
            self._show_figures()         # (with their lines bound: the page gets them as they are)
        self.drop_fitter()               # the ranges fit the new data from scratch
        self._show_intro(first)
        self._plots.visible = True
        self._last_summary = None
        self.refresh(force=True)

    def _build_figures(self, x: str, y_log: bool):
        """New figures (not yet in the layout, without lines). A build abandoned for a newer one
        (a Compare during ``prepare``'s) leaves its figures to it."""
        if self._unfinished is None or self._unfinished[0] != (x, y_log):
            self._unfinished = ((x, y_log), F.shared_x_range(), {}, {})
        _, xr, figures, legends = self._unfinished
        kinds = list(F.STE_COLORS)
        yield
        for metric, title, ylab, where in (("loss", "Train loss (EMA) per STE", "loss", "top_right"),
                                           ("accuracy", "Test accuracy per STE", "accuracy", "bottom_right")):
            if metric not in figures:
                fig = F.line_figure(title, ylab, name=f"fig-ste-{metric}", x_field=x, x_range=xr, height=280,
                                    y_log=y_log and metric == "loss",
                                    y_range=F.fraction_range() if metric == "accuracy" else None)
                legends[metric] = F.add_legend(fig, [(k, _legend_glyph(k)) for k in kinds], where)
                figures[metric] = fig
                yield
        for metric, title, ylab, logy in SMALL:
            if metric not in figures:
                # one figure per metric (layers as dash styles), no legend: every figure and legend
                # costs the browser a repaint per streamed tick
                figures[metric] = F.line_figure(title, ylab, name=f"fig-ste-{metric}", x_field=x, x_range=xr,
                                                y_log=y_log and logy, height=210)
                yield
        self._unfinished = None
        self.figures, self._legends, self._shape = figures, legends, (x, y_log)
        self._lines, self._parking = {}, {}

    def _show_figures(self) -> None:
        """Put the figures in the layout, in one step (each change of the shown layout makes the
        browser lay out the whole page again)."""
        figures = self.figures
        self._plots.objects = [
            pn.Row(bokeh_pane(figures["loss"]), bokeh_pane(figures["accuracy"]), sizing_mode="stretch_width"),
            self.key,
            pn.GridBox(*(bokeh_pane(figures[m]) for m, *_ in SMALL), ncols=2, sizing_mode="stretch_width")]

    def _draw(self, streams: dict, n_layers: int) -> None:
        """Point a line per kind (and layer) at ``streams`` ({kind: RunStream, or None: no run yet}).

        Lines are kept and moved, never removed: a line no run uses draws from an empty source,
        hidden in the small multiples (the legends own the overlaid lines' visibility). New lines
        are added only for a layer or kind no comparison had before: adding or removing a line makes
        the browser lay out the page again, moving one does not. All in one step, since Bokeh walks
        the page's whole model graph after each step that changes which models a model holds."""
        wanted = [(metric, layer, kind) for metric, layers in _line_layers(n_layers) for layer in layers
                  for kind in streams]            # in drawing order: the widest overlaid line first
        used = set(wanted)
        with frozen(self.figures["loss"]):
            for key, line in self._lines.items():
                self._bind(line, key, streams[key[2]] if key in used else None)
            new = [key for key in wanted if key not in self._lines]
            for key in new:
                self._lines[key] = self._add_line(key, streams[key[2]])
            for metric in ("loss", "accuracy"):
                if any(key[0] == metric for key in new):
                    F.set_legend_targets(self._legends[metric], {k: [line] for (m, _, k), line in self._lines.items()
                                                                 if m == metric})
        self.key.object = _small_multiples_key(list(streams), n_layers)

    def _bind(self, line, key: tuple, rs) -> None:
        """Move ``line`` to its source of ``rs`` (named after the run), or park it (``rs`` None)."""
        metric, layer, _ = key
        attr = _SOURCE.get(metric, "train")
        col = metric if layer is None else f"{metric}_{layer}"
        line.update(data_source=getattr(rs, attr) if rs is not None else self._parking[attr],
                    name=f"ste-{col}-{rs.run.id}" if rs is not None else "")
        if metric not in _SOURCE:
            line.visible = rs is not None

    def _add_line(self, key: tuple, rs):
        """A new line for ``key`` (metric, layer, kind) in its figure, drawing from ``rs`` (or parked)."""
        metric, layer, kind = key
        col = metric if layer is None else f"{metric}_{layer}"
        y = {"loss": "loss_s", "accuracy": "test_accuracy"}.get(metric, f"{col}_s" if is_smoothed(col) else col)
        attr = _SOURCE.get(metric, "train")
        parking = self._parking.setdefault(attr, ColumnDataSource({}, name=f"ste-parking-{attr}"))
        missing = {f: [] for f in (self.x_field, y) if f not in parking.data}
        if missing:                      # (the columns the line needs if it is parked later)
            parking.data.update(missing)
        if metric in _SOURCE:
            style = F.ste_line(kind)
        else:
            style = {"color": F.STE_COLORS.get(kind, "#333333"), "width": 1.5,
                     "dash": F.LAYER_DASHES[(layer or 0) % len(F.LAYER_DASHES)]}
        line = F.add_line(self.figures[metric], parking if rs is None else getattr(rs, attr), self.x_field, y,
                          name=f"ste-{col}-{rs.run.id}" if rs is not None else "", **style)
        line.visible = rs is not None or metric in _SOURCE
        return line

    def _show_intro(self, first) -> None:
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
