"""Bokeh figure factories and the colour conventions every view shares.

Functions here build figures and glyphs only; they never read a Run or a
MetricsLog. Views pass in the ColumnDataSources they own (see
:mod:`qatlab.ui.streaming`) and the x field (``"step"`` or ``"time"``).

Stable names: every figure gets ``name="fig-<what>"`` and every glyph renderer
``name="<metric>-<run id>"`` (the callers choose them), so a browser test can find
them with ``Bokeh.documents[0].get_model_by_name(...)``.
"""
from __future__ import annotations

from bokeh.models import DataRange1d, HoverTool, Legend, Range1d, Span
from bokeh.palettes import Category10_10
from bokeh.plotting import figure

from ..ste import SteKind

#: One colour per SteKind, the same in every plot and table.
STE_COLORS = {
    SteKind.IDENTITY.value: "#1f77b4",
    SteKind.CLIPPED_IDENTITY.value: "#ff7f0e",
    SteKind.TANH.value: "#2ca02c",
    SteKind.HARD_TANH.value: "#d62728",
}

#: Phase codes written by the phase trainer into the ``phase`` column.
PHASE_NAMES = {0: "WARMUP", 1: "FULL", 2: "PREDICT", 3: "CORRECT"}
PHASE_COLORS = {0: "#9e9e9e", 1: "#1f77b4", 2: "#ff7f0e", 3: "#2ca02c"}

#: Colours for runs overlaid in the runs tab, and for layers within one plot.
RUN_COLORS = list(Category10_10)
LAYER_DASHES = ["solid", "dashed", "dotted", "dotdash", "dashdot"]

X_LABELS = {"step": "step", "time": "wall time (s)"}
TOOLS = "pan,box_zoom,wheel_zoom,reset,save"


def run_color(i: int) -> str:
    """Colour of the i-th overlaid run (cycles through Category10)."""
    return RUN_COLORS[i % len(RUN_COLORS)]


def shared_x_range() -> DataRange1d:
    """A fresh auto-ranging x range; pass it to every figure of a view to link their x axes."""
    return DataRange1d(only_visible=True)


def line_figure(title: str, y_label: str, *, name: str, x_field: str = "step", x_range=None,
                y_log: bool = False, height: int = 240, y_range=None) -> figure:
    """A stretch-width time-series figure.

    Args:
        title: shown above the plot.
        y_label: y axis label.
        name: the figure's stable Bokeh ``name`` (``fig-...``).
        x_field: ``"step"`` or ``"time"``; only sets the x axis label here.
        x_range: a shared range (``shared_x_range()``) to link x axes; a new one if None.
        y_log: logarithmic y axis (values <= 0 are simply not drawn).
        y_range: optional fixed y range, e.g. ``Range1d(0, 1)`` for fractions.
    """
    kwargs = {}
    if y_range is not None:
        kwargs["y_range"] = y_range
    fig = figure(title=title, name=name, height=height, sizing_mode="stretch_width", tools=TOOLS,
                 toolbar_location="above", x_range=x_range if x_range is not None else shared_x_range(),
                 y_axis_type="log" if y_log else "linear", output_backend="canvas", **kwargs)
    fig.xaxis.axis_label = X_LABELS.get(x_field, x_field)
    fig.yaxis.axis_label = y_label
    fig.toolbar.logo = None
    fig.min_border_left = 50
    return fig


def fraction_range() -> Range1d:
    """y range for quantities in [0, 1] (accuracy, fractions), with a little headroom."""
    return Range1d(-0.02, 1.02)


def add_line(fig, source, x: str, y: str, *, color: str, name: str, label: str | None = None,
             alpha: float = 1.0, width: float = 2.0, dash: str = "solid"):
    """A line of column ``y`` against ``x``; NaN breaks the line. Returns the renderer."""
    kwargs = {"legend_label": label} if label else {}
    return fig.line(x, y, source=source, color=color, alpha=alpha, line_width=width, line_dash=dash,
                    name=name, **kwargs)


def add_points(fig, source, x: str, y: str, *, color: str, name: str, label: str | None = None,
               size: float = 5, alpha: float = 1.0):
    """Markers of column ``y`` (rows with NaN are skipped). Returns the renderer."""
    kwargs = {"legend_label": label} if label else {}
    return fig.scatter(x, y, source=source, color=color, size=size, alpha=alpha, name=name, **kwargs)


def add_phase_bands(fig, source, x_field: str, *, name: str, alpha: float = 0.13):
    """Vertical coloured bands, one per phase segment, drawn behind everything else.

    ``source`` has columns left/right (steps), left_t/right_t (seconds), color, label
    (see ``RunStream.phases``).
    """
    left, right = ("left", "right") if x_field == "step" else ("left_t", "right_t")
    renderer = fig.vstrip(x0=left, x1=right, source=source, fill_color="color", fill_alpha=alpha,
                          line_alpha=0.0, legend_field="label", name=name, level="underlay")
    return renderer


def add_unit_span(fig, value: float = 1.0):
    """A dashed horizontal reference line (e.g. speedup 1.0)."""
    fig.add_layout(Span(location=value, dimension="width", line_dash="dashed", line_color="#888888",
                        line_width=1))


def add_hover(fig, renderer, tooltips: list[tuple[str, str]]):
    """A vline hover tool limited to ``renderer``."""
    fig.add_tools(HoverTool(renderers=[renderer], tooltips=tooltips, mode="vline"))


def finish(fig, legend: bool = True, location: str = "top_right"):
    """Legend styling: click an entry to hide its line; small and translucent."""
    if legend and fig.legend:
        lg = fig.legend[0]
        lg.click_policy = "hide"
        lg.location = location
        lg.background_fill_alpha = 0.6
        lg.label_text_font_size = "8pt"
        lg.spacing = 0
        lg.padding = 4
        lg.margin = 4
    elif not legend:
        for lg in list(fig.select(type=Legend)):
            lg.visible = False
    return fig


def histogram_figure(title: str, source, *, name: str, renderer_name: str, color: str,
                     height: int = 200, x_label: str = "weight"):
    """A histogram drawn from a source with columns left, right, count."""
    fig = figure(title=title, name=name, height=height, sizing_mode="stretch_width", tools=TOOLS,
                 toolbar_location="above")
    fig.toolbar.logo = None
    fig.quad(left="left", right="right", bottom=0, top="count", source=source, fill_color=color,
             line_color=color, fill_alpha=0.55, name=renderer_name)
    fig.xaxis.axis_label = x_label
    fig.yaxis.axis_label = "count"
    fig.y_range.start = 0
    return fig
