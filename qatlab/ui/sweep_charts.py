"""Charts of the Sweeps tab: axis scales, the parallel-coordinates figure and the heatmap of a metric.

A sweep's runs are rows (dicts with the point's fields, ``seed``, final metrics and ``status``).
:func:`parallel_columns` turns them into the columns of ONE ColumnDataSource (a row per run: its
polyline across the axes and its point on the metric axis), so selecting rows of that source
highlights a run in both glyphs and in the table. :func:`heat_cells` groups the runs by two axes:
a cell's colour is the mean metric of its finished runs, its hover the spread over them.
"""
from __future__ import annotations

import math
import numbers

import numpy as np
from bokeh.models import (BoxSelectTool, ColorBar, ColumnDataSource, FactorRange, FixedTicker, HoverTool,
                          LinearColorMapper, Range1d, TapTool)
from bokeh.palettes import Viridis256
from bokeh.plotting import figure

from . import figures as F

NONE_AXIS = "(none)"
NAN_COLOR = "#c8c8c8"
MAX_TICKS = 6


def is_number(value) -> bool:
    return isinstance(value, numbers.Real) and not isinstance(value, bool) and math.isfinite(value)


def value_text(value) -> str:
    """A short label of an axis value (floats in 3 significant digits, lists as typed)."""
    if isinstance(value, float):
        return f"{value:.3g}"
    if value is None:
        return "-"
    return str(value)


class AxisScale:
    """Where each value of one axis sits on [0, 1], and the axis's tick labels.

    Numbers are placed linearly (logarithmically when all are > 0 and span 100x or more); anything
    else (strings, lists) is a category, spread evenly in first-seen order. Missing values map to NaN."""

    def __init__(self, values):
        present = [v for v in values if v is not None and not (isinstance(v, float) and math.isnan(v))]
        self.numeric = bool(present) and all(is_number(v) for v in present)
        self.log = False
        if self.numeric:
            xs = np.array(present, dtype=np.float64)
            self.lo, self.hi = float(xs.min()), float(xs.max())
            self.log = self.lo > 0 and self.hi / self.lo >= 100
            self.distinct = sorted(set(present))
            self.categories = []
        else:
            self.categories = list(dict.fromkeys(value_text(v) for v in present))

    def position(self, value) -> float:
        if value is None or (isinstance(value, float) and math.isnan(value)):
            return math.nan
        if self.numeric:
            if not is_number(value):
                return math.nan
            if self.hi == self.lo:
                return 0.5
            if self.log:
                return (math.log(value) - math.log(self.lo)) / (math.log(self.hi) - math.log(self.lo))
            return (float(value) - self.lo) / (self.hi - self.lo)
        text = value_text(value)
        if text not in self.categories:
            return math.nan
        n = len(self.categories)
        return 0.5 if n == 1 else self.categories.index(text) / (n - 1)

    def ticks(self) -> list[tuple[float, str]]:
        """(position, label) pairs: every category, or a few evenly spread numbers."""
        if not self.numeric:
            return [(self.position(c), c) for c in self.categories]
        if len(self.distinct) <= MAX_TICKS:       # a grid's few values: label each one
            return [(self.position(v), value_text(v)) for v in self.distinct]
        if self.log:
            values = np.geomspace(self.lo, self.hi, 4)
        else:
            values = np.linspace(self.lo, self.hi, 4)
        return [(self.position(float(v)), value_text(float(v))) for v in values]


def parallel_columns(rows: list[dict], axes: list[str], metric: str) -> tuple[dict, dict]:
    """(run source columns, tick label columns) for the parallel-coordinates figure.

    The axes are ``axes`` then ``metric`` (the last axis); a run's ``ys`` are its positions on them
    (NaN where it has no value: a running run has no metric yet, so its line stops before that axis).
    The metric axis is scaled over the finished runs only."""
    names = list(axes) + [metric]
    finished = [r for r in rows if r.get("status") == "finished"]
    scales = {a: AxisScale([r.get(a) for r in rows]) for a in axes}
    scales[metric] = AxisScale([r.get(metric) for r in finished] or [None])
    xs = list(range(len(names)))
    cols = {"run_id": [], "name": [], "status": [], "value": [], "xs": [], "ys": [], "mx": [], "my": [],
            "label": []}
    for r in rows:
        value = r.get(metric) if r.get("status") == "finished" and is_number(r.get(metric)) else math.nan
        ys = [scales[a].position(r.get(a)) for a in axes] + [scales[metric].position(value)]
        cols["run_id"].append(r["run_id"])
        cols["name"].append(r.get("name") or r["run_id"][:8])
        cols["status"].append(r.get("status", ""))
        cols["value"].append(float(value))
        cols["xs"].append(xs)
        cols["ys"].append(ys)
        cols["mx"].append(float(len(axes)))
        cols["my"].append(ys[-1])
        cols["label"].append(", ".join(f"{a.rsplit('.', 1)[-1]}={value_text(r.get(a))}" for a in axes))
    ticks = {"x": [], "y": [], "text": []}
    for i, a in enumerate(names):
        for pos, text in scales[a].ticks():
            ticks["x"].append(float(i))
            ticks["y"].append(pos)
            ticks["text"].append(text)
    return cols, ticks


def metric_range(values) -> tuple[float, float]:
    """The colour mapper's (low, high) over the finite ``values`` ((0, 1) when there are none)."""
    xs = [float(v) for v in values if is_number(v)]
    if not xs:
        return 0.0, 1.0
    lo, hi = min(xs), max(xs)
    return (lo, hi) if hi > lo else (lo - 0.5, hi + 0.5) if lo == 0 else (lo - abs(lo) * 0.01, hi + abs(hi) * 0.01)


def parallel_figure(source: ColumnDataSource, ticks: ColumnDataSource, names: list[str],
                    mapper: LinearColorMapper):
    """Runs as polylines across the axes ``names`` (the metric last), coloured by ``mapper`` on
    ``value``; tap or box-select (on the metric axis's points) selects runs in ``source``."""
    n = len(names)
    fig = figure(name="fig-sweep-parallel", title=f"Runs across the axes (colour: {names[-1]})", height=330,
                 sizing_mode="stretch_width", tools="tap,box_select,reset,save",
                 x_range=Range1d(-0.35, n - 0.65), y_range=Range1d(-0.08, 1.08), toolbar_location="above")
    fig.xaxis.ticker = FixedTicker(ticks=list(range(n)))
    fig.xaxis.major_label_overrides = {i: name for i, name in enumerate(names)}
    fig.yaxis.visible = False
    fig.ygrid.visible = False
    fig.xgrid.grid_line_color = "#888888"
    fig.xgrid.grid_line_alpha = 0.6
    color = {"field": "value", "transform": mapper}
    lines = fig.multi_line("xs", "ys", source=source, line_color=color, line_width=2, line_alpha=0.75,
                           selection_line_color=color, selection_line_width=4, selection_line_alpha=1.0,
                           nonselection_line_color=color, nonselection_line_alpha=0.12, name="sweep-lines")
    points = fig.scatter("mx", "my", source=source, size=9, fill_color=color, line_color="#333333",
                         selection_line_color="#d62728", selection_line_width=2.5, nonselection_fill_alpha=0.15,
                         nonselection_line_alpha=0.15, name="sweep-points")
    fig.text("x", "y", text="text", source=ticks, text_font_size="9pt", x_offset=4, text_baseline="middle",
             text_color="#444444")
    fig.select_one(TapTool).renderers = [lines, points]
    fig.select_one(BoxSelectTool).renderers = [points]
    fig.add_tools(HoverTool(renderers=[lines, points], tooltips=[("run", "@name"), ("point", "@label"),
                                                                  ("status", "@status"), ("metric", "@value")]))
    fig.add_layout(ColorBar(color_mapper=mapper, width=10, title=names[-1], name="sweep-parallel-colorbar"), "right")
    F.style_text(fig)
    return fig


def label_metric(parallel, heatmap, names: list[str]) -> None:
    """Retitle both figures for the metric ``names[-1]`` (the figures stay: no new models)."""
    metric = names[-1]
    parallel.title.text = f"Runs across the axes (colour: {metric})"
    parallel.xaxis.major_label_overrides = {i: name for i, name in enumerate(names)}
    parallel.right[0].title = metric                  # (the colour bar; looked up directly: select() walks every model)
    heatmap.title.text = f"Mean {metric} (hover: spread over seeds)"
    hover = next(t for t in heatmap.toolbar.tools if isinstance(t, HoverTool))
    hover.tooltips = [(f"mean {metric}", t[1]) if t[0].startswith("mean ") else t for t in hover.tooltips]


def heat_cells(rows: list[dict], x_axis: str, y_axis: str, metric: str) -> tuple[dict, list[list[int]], list, list]:
    """Cells of the heatmap of ``metric`` over ``x_axis`` x ``y_axis`` (``NONE_AXIS``: one row).

    Returns (source columns, the row indices of each cell's runs, x factors, y factors). A cell's
    ``mean``/``std``/``min``/``max``/``n`` are over its FINISHED runs (std: sample std, 0 for one);
    ``runs`` counts all of them, whatever their status."""
    def key(r, axis):
        return "all" if axis == NONE_AXIS else value_text(r.get(axis))
    xs = AxisScale([r.get(x_axis) for r in rows])
    ys = AxisScale([r.get(y_axis) for r in rows]) if y_axis != NONE_AXIS else None
    x_factors = _ordered([key(r, x_axis) for r in rows], xs)
    y_factors = ["all"] if ys is None else _ordered([key(r, y_axis) for r in rows], ys)
    groups: dict[tuple, list[int]] = {}
    for i, r in enumerate(rows):
        groups.setdefault((key(r, x_axis), key(r, y_axis)), []).append(i)
    cols = {k: [] for k in ("x", "y", "mean", "std", "min", "max", "n", "runs", "text")}
    members = []
    for (x, y), idx in sorted(groups.items(), key=lambda kv: (x_factors.index(kv[0][0]), y_factors.index(kv[0][1]))):
        vals = np.array([float(rows[i][metric]) for i in idx
                         if rows[i].get("status") == "finished" and is_number(rows[i].get(metric))])
        n = len(vals)
        mean = float(vals.mean()) if n else math.nan
        cols["x"].append(x)
        cols["y"].append(y)
        cols["mean"].append(mean)
        cols["std"].append(float(vals.std(ddof=1)) if n > 1 else 0.0 if n else math.nan)
        cols["min"].append(float(vals.min()) if n else math.nan)
        cols["max"].append(float(vals.max()) if n else math.nan)
        cols["n"].append(n)
        cols["runs"].append(len(idx))
        cols["text"].append(f"{mean:.3g}" if n else "-")
        members.append(idx)
    return cols, members, x_factors, y_factors


def _ordered(labels: list[str], scale: AxisScale) -> list[str]:
    """The distinct labels, numbers in increasing order, other values as first seen."""
    distinct = list(dict.fromkeys(labels))
    if scale.numeric:
        def num(text):
            try:
                return float(text)
            except ValueError:
                return math.inf
        return sorted(distinct, key=num)
    return distinct


def heat_figure(source: ColumnDataSource, x_factors: list, y_factors: list, mapper: LinearColorMapper,
                x_label: str, y_label: str, metric: str):
    """Mean ``metric`` per cell, the spread over its finished runs on hover; tap selects a cell's runs."""
    fig = figure(name="fig-sweep-heatmap", title=f"Mean {metric} (hover: spread over seeds)", height=330,
                 sizing_mode="stretch_width", tools="tap,reset,save", toolbar_location="above",
                 x_range=FactorRange(*x_factors), y_range=FactorRange(*y_factors))
    color = {"field": "mean", "transform": mapper}
    cells = fig.rect("x", "y", 0.95, 0.95, source=source, fill_color=color, line_color=None,
                     selection_line_color="#d62728", selection_line_width=3, nonselection_fill_alpha=0.45,
                     name="sweep-cells")
    fig.text("x", "y", text="text", source=source, text_align="center", text_baseline="middle",
             text_font_size="10pt", text_color="#ffffff", text_font_style="bold", text_outline_color="#333333")
    fig.add_tools(HoverTool(renderers=[cells], tooltips=[
        (x_label, "@x"), (y_label, "@y"), (f"mean {metric}", "@mean{0.0000}"), ("std", "@std{0.0000}"),
        ("min .. max", "@min{0.0000} .. @max{0.0000}"), ("finished / runs", "@n / @runs")]))
    fig.xaxis.axis_label = x_label
    fig.yaxis.axis_label = "" if y_label == NONE_AXIS else y_label
    fig.xgrid.visible = fig.ygrid.visible = False
    fig.add_layout(ColorBar(color_mapper=mapper, width=10), "right")
    F.style_text(fig)
    return fig


def color_mapper(low: float, high: float) -> LinearColorMapper:
    return LinearColorMapper(palette=Viridis256, low=low, high=high, nan_color=NAN_COLOR)
