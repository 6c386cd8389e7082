"""Shared plumbing of the live views: plot options and the :class:`LiveView` base class.

A LiveView owns (or shares) a :class:`~qatlab.ui.streaming.StreamHub` and a
:class:`PlotOptions`. ``pull()`` is one streaming tick (hub pull when the view
owns its hub, then :meth:`LiveView.refresh` for the non-streamed parts: tables,
histograms, status text). Changing ``log_y`` or ``x_axis`` rebuilds the view's
figures from the same sources (Bokeh cannot swap a live figure's scale type).

Notebook use: a view built without a hub owns one; displaying it starts its own
~10 Hz periodic callback (``start_streaming``), so curves move inline.
"""
from __future__ import annotations

import logging

import panel as pn
import param

from .streaming import StreamHub

log = logging.getLogger(__name__)

PERIOD_MS = 100


class PlotOptions(param.Parameterized):
    """TensorBoard-style plot handling shared by every view of a session."""

    smoothing = param.Number(default=0.6, bounds=(0.0, 0.99), step=0.01,
                             doc="EMA weight of the smoothed curves (0 = raw).")
    log_y = param.Boolean(default=False, doc="Logarithmic y axis on loss-like plots.")
    x_axis = param.Selector(default="step", objects=["step", "time"], doc="x axis: training step or wall time (s).")

    def controls(self) -> pn.Row:
        """Widgets: ``Smoothing`` slider, ``Log-scale y`` checkbox, ``x axis`` radio buttons."""
        return pn.Row(
            pn.widgets.FloatSlider.from_param(self.param.smoothing, name="Smoothing (EMA)", width=220),
            pn.widgets.Checkbox.from_param(self.param.log_y, name="Log-scale y", align="center"),
            pn.widgets.RadioButtonGroup.from_param(self.param.x_axis, name="x axis", align="center",
                                                   button_type="default"),
            sizing_mode="stretch_width", css_classes=["qatlab-plot-controls"])


class LiveView(pn.viewable.Viewer):
    """Base of the session views.

    Args:
        hub: the session's StreamHub; None creates (and owns) one.
        options: the session's PlotOptions; None creates one.
    """

    def __init__(self, hub: StreamHub | None = None, options: PlotOptions | None = None, **params):
        super().__init__(**params)
        self._owns_hub = hub is None
        self.options = options if options is not None else PlotOptions()
        self.hub = hub if hub is not None else StreamHub(self.options.smoothing)
        self._periodic = None
        self.options.param.watch(self._on_layout_option, ["log_y", "x_axis"])
        if self._owns_hub:
            self.options.param.watch(lambda e: self.hub.set_smoothing(e.new), "smoothing")

    # -------------------------------------------------------------- streaming
    def pull(self) -> None:
        """One streaming tick: new rows into the sources (own hub only), then :meth:`refresh`."""
        if self._owns_hub:
            self.hub.pull()
        self.refresh()

    def refresh(self) -> None:
        """Update the non-streamed parts (status text, tables, histograms). Cheap when nothing changed."""

    def start_streaming(self, period: int = PERIOD_MS):
        """Start a periodic callback calling :meth:`pull` (idempotent); returns it."""
        if self._periodic is None:
            self._periodic = pn.state.add_periodic_callback(self._safe_pull, period=period)
        return self._periodic

    def stop_streaming(self) -> None:
        """Stop the periodic callback started by :meth:`start_streaming`."""
        if self._periodic is not None:
            self._periodic.stop()
            self._periodic = None

    def _safe_pull(self) -> None:
        try:
            self.pull()
        except Exception:  # a bad tick must never kill the session's callback
            log.exception("qatlab: streaming tick failed")

    # -------------------------------------------------------------- figures
    def _on_layout_option(self, *_events) -> None:
        self.rebuild()

    def rebuild(self) -> None:
        """Recreate the figures (after a run, log_y or x_axis change)."""

    @property
    def x_field(self) -> str:
        return self.options.x_axis

    def _panel(self):
        raise NotImplementedError

    def __panel__(self):
        if self._owns_hub:
            self.start_streaming()
        return self._panel()


def bokeh_pane(fig, **kwargs) -> pn.pane.Bokeh:
    """A stretch-width Bokeh pane."""
    return pn.pane.Bokeh(fig, sizing_mode="stretch_width", **kwargs)


def short_message(message: str, limit: int = 300) -> str:
    """The last meaningful line of a run message (never a whole traceback), at most ``limit`` chars."""
    lines = [ln.strip() for ln in (message or "").strip().splitlines() if ln.strip()]
    if not lines:
        return ""
    text = lines[-1]
    return text if len(text) <= limit else text[: limit - 1] + "…"
