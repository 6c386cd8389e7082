"""Bokeh figure factories and the colour conventions every view shares.

Functions here build figures and glyphs only; they never read a LocalRun or a
MetricsLog. Views pass in the ColumnDataSources they own (see
:mod:`qatlab.ui.streaming`) and the x field (``"step"`` or ``"time"``).

Legends are built from *proxy* renderers: Bokeh re-renders a legend whenever anything reachable
from its items changes, and a streaming source is reachable from a real line, so a plain legend
would be re-drawn on every tick, a large share of the browser's time while runs stream.
Each legend entry here points at a look-alike glyph with one NaN row (draws nothing); clicking it
(``click_policy="hide"``) toggles the proxy, and a small ``CustomJS`` (holding model *ids*, not references) sets ``visible``
on the real renderers.

Ranges: the time-series figures use server-fitted ``Range1d`` ranges (:mod:`qatlab.ui.ranges`),
not ``DataRange1d``, which refits and re-lays out the plot in the browser on every streamed row.

Glyphs are added with ``add_glyph`` (one glyph model per line) rather than ``figure.line`` and
friends, which also build selection, non-selection, hover and muted copies of every glyph (a
large part of the time of building the STE comparison's figures on the server's event loop).

Stable names: every figure gets ``name="fig-<what>"`` and every glyph renderer
``name="<metric>-<run id>"`` (the callers choose them), so a browser test can find
them with ``Bokeh.documents[0].get_model_by_name(...)``.
"""
from __future__ import annotations

import math

from bokeh.models import (CDSView, ColumnDataSource, CustomJS, GroupFilter, HoverTool, Legend,
                          LegendItem, Range1d, Span)
from bokeh.models.glyphs import Line, Scatter, Step, VStrip
from bokeh.palettes import Category10_10
from bokeh.plotting import figure

from ..quant.ste import SteKind
from .ranges import auto_range

#: One colour per SteKind, the same in every plot and table.
STE_COLORS = {
    SteKind.IDENTITY.value: "#1f77b4",
    SteKind.CLIPPED_IDENTITY.value: "#ff7f0e",
    SteKind.TANH.value: "#2ca02c",
    SteKind.HARD_TANH.value: "#d62728",
}

#: Line dash and width per SteKind, widest first in drawing order: the four curves of a comparison
#: often coincide, and each stays visible on top of the others.
STE_LINES = {
    SteKind.IDENTITY.value: ("solid", 4.0),
    SteKind.CLIPPED_IDENTITY.value: ("dashed", 3.0),
    SteKind.TANH.value: ("dotted", 2.5),
    SteKind.HARD_TANH.value: ("dotdash", 2.0),
}


def ste_line(kind: str) -> dict:
    """``add_line`` keywords (color, dash, width) of an STE kind's curve."""
    dash, width = STE_LINES.get(kind, ("solid", 2.0))
    return {"color": STE_COLORS.get(kind, "#333333"), "dash": dash, "width": width}


#: Phase codes written by the phase trainer into the ``phase`` column.
PHASE_NAMES = {0: "WARMUP", 1: "FULL", 2: "PREDICT", 3: "CORRECT"}
PHASE_COLORS = {0: "#9e9e9e", 1: "#1f77b4", 2: "#ff7f0e", 3: "#2ca02c"}

#: Colours for runs overlaid in the runs tab, and for layers within one plot.
RUN_COLORS = list(Category10_10)
LAYER_DASHES = ["solid", "dashed", "dotted", "dotdash", "dashdot"]

X_LABELS = {"step": "step", "time": "wall time (s)"}
TOOLS = "pan,box_zoom,wheel_zoom,reset,save"


def style_text(fig) -> None:
    """Text sizes in px: the Fast theme's ``em`` sizes make the browser resolve computed styles on every
    repaint, the top cost of streaming into many plots."""
    fig.title.text_font_size = "13px"
    for axis in fig.axis:
        axis.major_label_text_font_size = "11px"
        axis.axis_label_text_font_size = "12px"
        axis.axis_label_standoff = 6


def run_color(i: int) -> str:
    """Colour of the i-th overlaid run (cycles through Category10)."""
    return RUN_COLORS[i % len(RUN_COLORS)]


def shared_x_range() -> Range1d:
    """A fresh auto x range (fitted by :class:`~qatlab.ui.ranges.RangeFitter`); pass it to every
    figure of a view to link their x axes."""
    return auto_range()


def line_figure(title: str, y_label: str, *, name: str, x_field: str = "step", x_range=None,
                y_log: bool = False, height: int = 240, y_range=None, toolbar_location: str = "above") -> figure:
    """A stretch-width time-series figure.

    Args:
        title: shown above the plot.
        y_label: y axis label.
        name: the figure's stable Bokeh ``name`` (``fig-...``).
        x_field: ``"step"`` or ``"time"``; only sets the x axis label here.
        x_range: a shared range (``shared_x_range()``) to link x axes; a new one if None.
        y_log: logarithmic y axis (values <= 0 are simply not drawn).
        y_range: optional fixed y range, e.g. ``Range1d(0, 1)`` for fractions; by default an auto
            range that the view's :class:`~qatlab.ui.ranges.RangeFitter` fits to the data.
        toolbar_location: ``"above"`` shares the title's row (keep titles short); ``"right"`` for
            narrow figures, where the toolbar would cover the title.
    """
    fig = figure(title=title, name=name, height=height, sizing_mode="stretch_width", tools=TOOLS,
                 toolbar_location=toolbar_location, x_range=x_range if x_range is not None else shared_x_range(),
                 y_axis_type="log" if y_log else "linear", output_backend="canvas",
                 y_range=y_range if y_range is not None else auto_range(y_log))
    fig.xaxis.axis_label = X_LABELS.get(x_field, x_field)
    fig.yaxis.axis_label = y_label
    fig.toolbar.logo = None
    fig.min_border_left = 50
    style_text(fig)
    return fig


def fraction_range() -> Range1d:
    """y range for quantities in [0, 1] (accuracy, fractions), with a little headroom."""
    return Range1d(-0.02, 1.02)


_LEGEND: dict[str, list[tuple[str, list]]] = {}   # figure id -> [(label, [renderers])], until finish()


def register_legend(fig, label: str | None, renderer) -> None:
    """Add ``renderer`` to the legend entry ``label`` of ``fig`` (built by :func:`finish`)."""
    if not label:
        return
    entries = _LEGEND.setdefault(fig.id, [])
    for entry_label, renderers in entries:
        if entry_label == label:
            renderers.append(renderer)
            return
    entries.append((label, [renderer]))


def add_line(fig, source, x: str, y: str, *, color: str, name: str, label: str | None = None,
             alpha: float = 1.0, width: float = 2.0, dash: str = "solid"):
    """A line of column ``y`` against ``x``; NaN breaks the line. Returns the renderer."""
    r = fig.add_glyph(source, Line(x=x, y=y, line_color=color, line_alpha=alpha, line_width=width, line_dash=dash),
                      name=name)
    register_legend(fig, label, r)
    return r


def add_step(fig, source, x: str, y: str, *, color: str, name: str, label: str | None = None,
             width: float = 2.0):
    """A step line (value holds until the next row). Returns the renderer."""
    r = fig.add_glyph(source, Step(x=x, y=y, mode="after", line_color=color, line_width=width), name=name)
    register_legend(fig, label, r)
    return r


def add_points(fig, source, x: str, y: str, *, color: str, name: str, label: str | None = None,
               size: float = 5, alpha: float = 1.0):
    """Markers of column ``y`` (rows with NaN are skipped). Returns the renderer."""
    r = fig.add_glyph(source, Scatter(x=x, y=y, size=size, fill_color=color, line_color=color, fill_alpha=alpha,
                                      line_alpha=alpha), name=name)
    register_legend(fig, label, r)
    return r


def add_phase_bands(fig, source, x_field: str, *, name: str, alpha: float = 0.13) -> list:
    """Vertical coloured bands behind everything else: one renderer per phase (``<name>-<PHASE>``).

    ``source`` has columns left/right (steps), left_t/right_t (seconds), color, label
    (see ``RunStream.phases``). Returns the renderers; each phase gets a legend entry.
    """
    left, right = ("left", "right") if x_field == "step" else ("left_t", "right_t")
    renderers = []
    for code, phase in PHASE_NAMES.items():
        view = CDSView(filter=GroupFilter(column_name="label", group=phase))
        r = fig.add_glyph(source, VStrip(x0=left, x1=right, fill_color=PHASE_COLORS[code], fill_alpha=alpha,
                                         line_alpha=0.0), view=view, name=f"{name}-{phase}", level="underlay")
        register_legend(fig, phase, r)
        renderers.append(r)
    return renderers


_TOGGLE_CODE = """
const doc = cb_obj.document;
if (doc == null) return;
for (const id of ids) {
  const model = doc.get_model_by_id(id);
  if (model != null) model.visible = cb_obj.visible;
}
"""


def _proxy(fig, renderer):
    """A renderer that looks like ``renderer`` but draws nothing (one NaN row: the legend needs a row)."""
    g = renderer.glyph
    empty = ColumnDataSource({"x": [math.nan], "y": [math.nan]})
    if isinstance(g, VStrip):
        return fig.vstrip(x0="x", x1="y", source=empty, fill_color=g.fill_color, fill_alpha=max(g.fill_alpha, 0.3),
                          line_alpha=0.0, level="underlay")
    if isinstance(g, Scatter):
        return fig.scatter("x", "y", source=empty, marker=g.marker, fill_color=g.fill_color, line_color=g.line_color,
                           size=g.size)
    if isinstance(g, (Line, Step)):
        return fig.line("x", "y", source=empty, line_color=g.line_color, line_dash=g.line_dash,
                        line_width=g.line_width, line_alpha=max(g.line_alpha, 0.5))
    return fig.line("x", "y", source=empty)


def add_unit_span(fig, value: float = 1.0):
    """A dashed horizontal reference line (e.g. speedup 1.0)."""
    fig.add_layout(Span(location=value, dimension="width", line_dash="dashed", line_color="#888888",
                        line_width=1))


def add_hover(fig, renderer, tooltips: list[tuple[str, str]]):
    """A vline hover tool limited to ``renderer``."""
    fig.add_tools(HoverTool(renderers=[renderer], tooltips=tooltips, mode="vline"))


def finish(fig, legend: bool = True, location: str = "top_right", outside: bool = False):
    """Build the figure's legend from the registered entries: click an entry to hide its renderers.
    ``outside``: to the right of the plot area (for plots whose whole area carries data)."""
    entries = _LEGEND.pop(fig.id, [])
    if not legend or not entries:
        return fig
    items = []
    for label, renderers in entries:
        proxy = _proxy(fig, renderers[0])
        proxy.js_on_change("visible", CustomJS(args={"ids": [r.id for r in renderers]}, code=_TOGGLE_CODE))
        items.append(LegendItem(label=label, renderers=[proxy]))
    legend = Legend(items=items, click_policy="hide", location="top_left" if outside else location,
                    background_fill_alpha=0.6, label_text_font_size="11px", spacing=0, padding=4, margin=4,
                    glyph_height=14, glyph_width=18, label_height=14)
    fig.add_layout(legend, "right" if outside else "center")
    return fig


def histogram_figure(title: str, source, *, name: str, renderer_name: str, color: str,
                     height: int = 200, x_label: str = "weight", x_range=None):
    """A histogram drawn from a source with columns left, right, count (pass ``x_range`` to link x axes).

    Its ranges are plain ``Range1d`` (x: ``x_range`` or -1..1, y: 0..1) that the view sets with
    :func:`fit_histogram`: a ``DataRange1d`` over a still empty source makes Bokeh warn in the
    browser console ("could not set initial ranges")."""
    fig = figure(title=title, name=name, height=height, sizing_mode="stretch_width", tools=TOOLS,
                 toolbar_location="above", x_range=x_range if x_range is not None else Range1d(-1.0, 1.0),
                 y_range=Range1d(0.0, 1.0))
    fig.toolbar.logo = None
    fig.quad(left="left", right="right", bottom=0, top="count", source=source, fill_color=color,
             line_color=color, fill_alpha=0.55, name=renderer_name)
    fig.xaxis.axis_label = x_label
    fig.yaxis.axis_label = "count"
    style_text(fig)
    return fig


def fit_histogram(fig, bars: dict, x_bars: list[dict], fitted: dict) -> None:
    """Set a histogram's ranges: y to 0 .. its highest bar (+5%), x to the extent of ``x_bars`` (the
    bars of every figure sharing its x range; +2%). A range the user zoomed or panned (it differs
    from what was set last, kept in ``fitted`` by range id) is left alone."""
    lefts = [float(b["left"].min()) for b in x_bars if len(b["left"])]
    if lefts:
        lo, hi = min(lefts), max(float(b["right"].max()) for b in x_bars if len(b["right"]))
        pad = 0.02 * (hi - lo) if hi > lo else 1.0
        _set_range(fig.x_range, lo - pad, hi + pad, fitted)
    if len(bars["count"]):
        _set_range(fig.y_range, 0.0, float(bars["count"].max()) * 1.05 or 1.0, fitted)


def _set_range(rng: Range1d, start: float, end: float, fitted: dict) -> None:
    last = fitted.get(rng.id)
    if last is not None and (rng.start, rng.end) != last:
        return
    rng.update(start=start, end=end, reset_start=start, reset_end=end)
    fitted[rng.id] = (rng.start, rng.end)
