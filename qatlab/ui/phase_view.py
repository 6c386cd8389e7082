"""Phases tab: what phase training did, for one run with ``config.phase.enabled``.

The intro names the predictor, the schedule and where the trend entries are kept (``history_storage``)
with their bytes (``memory-phase-history``: from the run's ``phase_history`` meta, once the run has started).

Figures (x linked), from the run's ``train-source-<run id>`` / ``phase-source-<run id>``:

- ``fig-phase-timeline``: phase bands ``phase-timeline-bands-<run id>-<PHASE>`` and the phase
  code as a step line ``phase-code-<run id>`` (0 WARMUP, 1 FULL, 2 PREDICT, 3 CORRECT);
- ``fig-phase-backward``: ``backward-passes-<run id>`` against the ``steps-<run id>``
  diagonal (a full-backprop run would follow it; the gap is what was saved);

Titles stay short and the three narrow figures keep their toolbar on the right, so neither covers
a title; the timeline's legend sits outside its plot area, which the bands fill.
- ``fig-phase-pred``: ``pred-error-<run id>`` and ``pred-cosine-<run id>`` (markers: the
  values exist on CORRECT steps only) and the learned gain applied to predictions,
  ``pred-gain-<run id>`` (a step line);
- ``fig-phase-lengths``: adaptive ``full-len-<run id>`` and ``predict-len-<run id>``.
"""
from __future__ import annotations

import panel as pn
import param
from bokeh.models import Range1d

from ..progress import RunProgress
from . import figures as F
from .base import LiveView, bokeh_pane


class PhaseView(LiveView):
    """Phase timeline, backward passes saved, prediction quality and adaptive lengths of one run."""

    run = param.ClassSelector(class_=RunProgress, default=None, allow_None=True, doc="The run shown.")

    def __init__(self, run: RunProgress | None = None, hub=None, options=None, lazy: bool = False, **params):
        super().__init__(hub, options, lazy, **params)
        self.figures: dict = {}
        self.intro = pn.pane.Markdown("", margin=(5, 10))
        self.memory = pn.pane.Markdown("", margin=(0, 10), css_classes=["memory-phase-history"])
        self._plots = pn.Column(sizing_mode="stretch_width")
        self._layout = pn.Column(self.intro, self.memory, self._plots, sizing_mode="stretch_width")
        self.follow_run(run)

    def rebuild(self) -> None:
        """(Re)create the phase figures (or explain why there are none)."""
        self.figures = {}
        run = self.run
        if run is None or not run.config.phase.enabled:
            self.intro.object = ("Phase training is off for this run: tick **Enabled** under **Phase training** "
                                 "in the sidebar, then press **Start**." if run is not None else
                                 "No run yet: enable **Phase training** in the sidebar and press **Start**.")
            self._plots.objects = []
            self.memory.object = ""
            return
        p = run.config.phase
        self.intro.object = (f"**{run.name}** · predictor **{p.predictor}** · warmup {p.warmup_steps}, "
                             f"FULL {p.full_steps}, predict block {p.predict_steps}, CORRECT every "
                             f"{p.correct_every}" + (" · adaptive lengths" if p.adaptive_phases else "")
                             + f" · trend history **{p.history_storage}**"
                             + "<br>*Backward passes*: the gap to the dashed diagonal (one pass per step, as "
                             "full backprop does) is what phase training saved.")
        rs = self.hub.stream(run)
        x, xr, rid = self.x_field, F.shared_x_range(), run.id

        tl = F.line_figure("Phase timeline", "phase", name="fig-phase-timeline", x_field=x, x_range=xr,
                           height=170, y_range=Range1d(-0.5, 3.5))
        F.add_phase_bands(tl, rs.phases, x, name=f"phase-timeline-bands-{rid}", alpha=0.35)
        F.add_step(tl, rs.train, x, "phase", color="#333333", width=1, name=f"phase-code-{rid}")
        tl.yaxis.ticker = [0, 1, 2, 3]
        tl.yaxis.major_label_overrides = {k: v for k, v in F.PHASE_NAMES.items()}
        F.finish(tl, outside=True)

        narrow = dict(x_field=x, x_range=xr, toolbar_location="right")   # three to a row
        bw = F.line_figure("Backward passes", "count", name="fig-phase-backward", **narrow)
        F.add_line(bw, rs.train, x, "step", color="#7f7f7f", dash="dashed", width=1, name=f"steps-{rid}",
                   label="steps (full backprop)")
        F.add_line(bw, rs.train, x, "backward_passes", color="#1f77b4", name=f"backward-passes-{rid}",
                   label="backward passes")
        F.finish(bw, location="top_left")

        pred = F.line_figure("Prediction on CORRECT steps", "value", name="fig-phase-pred",
                             y_log=self.options.log_y, **narrow)
        F.add_points(pred, rs.train, x, "pred_error", color="#d62728", name=f"pred-error-{rid}",
                     label="relative error")
        F.add_points(pred, rs.train, x, "pred_cosine", color="#2ca02c", name=f"pred-cosine-{rid}",
                     label="cosine")
        F.add_step(pred, rs.train, x, "pred_gain", color="#9467bd", name=f"pred-gain-{rid}",
                   label="gain applied")
        F.finish(pred)

        lens = F.line_figure("Adaptive phase lengths", "steps", name="fig-phase-lengths", **narrow)
        F.add_step(lens, rs.train, x, "full_len", color=F.PHASE_COLORS[1], label="FULL length",
                   name=f"full-len-{rid}")
        F.add_step(lens, rs.train, x, "predict_len", color=F.PHASE_COLORS[2], label="predict length",
                   name=f"predict-len-{rid}")
        F.finish(lens)

        self.refresh()
        self.figures = {"timeline": tl, "backward": bw, "pred": pred, "lengths": lens}
        self._plots.objects = [bokeh_pane(tl),
                               pn.GridBox(bokeh_pane(bw), bokeh_pane(pred), bokeh_pane(lens), ncols=3,
                                          sizing_mode="stretch_width")]

    def refresh(self, force: bool = False) -> None:
        """The trend history's bytes, once the run's meta has them."""
        run = self.run
        info = run.log.meta.get("phase_history") if run is not None and run.config.phase.enabled else None
        text = history_text(info) if info else ""
        if self.memory.object != text:
            self.memory.object = text

    def shown_runs(self) -> list:
        return [self.run] if self.run is not None else []

    def _panel(self):
        return self._layout


def history_text(info: dict) -> str:
    """'Trend history: ternary, 20.8 kB (float32 rows would take 333 kB)' from a run's ``phase_history`` meta."""
    text = f"Trend history: **{info['storage']}**, {_kb(info['bytes'])}"
    if info["storage"] != "float32" and info.get("float32_bytes"):
        text += f" (float32 rows would take {_kb(info['float32_bytes'])})"
    return text


def _kb(n: int) -> str:
    return f"{n / 1000:.1f} kB" if n < 1_000_000 else f"{n / 1e6:.2f} MB"
