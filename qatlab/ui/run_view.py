"""Overview of one run (loss, test curves, phase bands, speedup, status) and the sidebar progress.

:class:`RunStatus` (sidebar): progress bar (CSS class ``qatlab-progress``), a text line with
steps, steps/s and ETA (CSS class ``qatlab-progress-text``), and a status line
``Status: <status>`` (CSS class ``qatlab-status``). It summarises a list of runs:
one run, or the four runs of an STE comparison.

:class:`RunView` (Overview tab) figures, linked in x:

- ``fig-loss``: raw train loss ``loss-raw-<run id>`` (faint), its EMA ``loss-<run id>``,
  test loss ``test-loss-<run id>`` (+ ``test-loss-points-<run id>``), and phase bands
  ``phase-bands-<run id>-<PHASE>`` (PHASE in WARMUP/FULL/PREDICT/CORRECT) behind them when phase training is on;
- ``fig-accuracy``: ``test-accuracy-<run id>`` and ``train-accuracy-<run id>``;
- ``fig-speedup`` (phase runs): ``speedup-steps-<run id>``, ``speedup-wall-<run id>``.

A new run drawn the same way as the last one (same x axis, y scale and phase training on or off)
keeps the figures: their lines move to the new run's sources and names (:func:`stream_bindings`),
so a Start builds no figure (for the server, the browser and the heap, the costliest part of it).

Status and message are shown in an alert (CSS class ``qatlab-run-alert``); a failed
run shows only the last line of its error, never a traceback.
"""
from __future__ import annotations

import math

import panel as pn
import param

from .. import warmup
from ..progress import RunProgress
from . import figures as F
from .base import NO_AUTOLINKS, LiveView, Throttle, bokeh_pane, rebind, short_message, stream_bindings

ALERT_TYPES = {"created": "light", "running": "primary", "paused": "warning", "finished": "success",
               "stopped": "secondary", "diverged": "danger", "failed": "danger", "interrupted": "warning",
               "pruned": "secondary"}


def format_seconds(seconds: float) -> str:
    """``42 s``, ``3:05``, ``1:02:03``; ``–`` when unknown."""
    if seconds is None or not math.isfinite(seconds):
        return "–"
    s = int(round(seconds))
    if s < 60:
        return f"{s} s"
    h, rem = divmod(s, 3600)
    m, sec = divmod(rem, 60)
    return f"{h}:{m:02d}:{sec:02d}" if h else f"{m}:{sec:02d}"


def progress_text(runs: list[RunProgress]) -> tuple[float, str]:
    """(progress 0..1, ``"step a / b · r steps/s · ETA t"``) of one run or a group of runs."""
    compiling = warmup.status_text()   # Numba compiling: say so rather than "step 0 · loss nan"
    if compiling and not any(r.steps_done or r.done for r in runs):
        return 0.0, compiling
    if not runs:
        return 0.0, "No run yet: press **Start**."
    done = sum(r.steps_done for r in runs)
    total = sum(r.total_steps for r in runs)
    rate = sum(r.steps_per_second for r in runs if r.status == "running")
    etas = [r.eta for r in runs if r.status in ("running", "paused")]
    eta = max(etas) if etas else 0.0
    frac = done / total if total else 0.0
    if all(r.done for r in runs):
        frac = 1.0 if all(r.status == "finished" for r in runs) else frac
        return frac, f"step {done:,} / {total:,} · done in {format_seconds(max(r.elapsed for r in runs))}"
    return frac, f"step {done:,} / {total:,} · {rate:,.0f} steps/s · ETA {format_seconds(eta)}"


def group_status(runs: list[RunProgress]) -> str:
    """The single run's status, or e.g. ``running (2 running, 2 finished)`` for a group."""
    if not runs:
        return "idle"
    if len(runs) == 1:
        return runs[0].status
    counts: dict[str, int] = {}
    for r in runs:
        counts[r.status] = counts.get(r.status, 0) + 1
    if len(counts) == 1:
        return runs[0].status
    lead = next(s for s in ("running", "paused", "failed", "diverged", "stopped", "finished", "created")
                if s in counts)
    return f"{lead} (" + ", ".join(f"{n} {s}" for s, n in counts.items()) + ")"


class RunStatus(pn.viewable.Viewer):
    """Sidebar progress for the runs the session started last (one run or a comparison)."""

    runs = param.List(default=[], item_type=RunProgress, doc="Runs summarised (a single run or a comparison group).")

    def __init__(self, **params):
        super().__init__(**params)
        self.bar = pn.indicators.Progress(value=0, max=1000, css_classes=["qatlab-progress"], bar_color="primary",
                                          sizing_mode="stretch_width", height=18, margin=(8, 10, 0, 10))
        # fixed heights: text that changes twice a second must not re-lay out the page
        self.text = pn.pane.Markdown(progress_text([])[1], css_classes=["qatlab-progress-text"], height=44,
                                     margin=(0, 10), sizing_mode="stretch_width", styles={"font-size": "0.95em"})
        self.status = pn.pane.Markdown("**Status:** idle", css_classes=["qatlab-status"], margin=(0, 10),
                                       sizing_mode="stretch_width")
        self._layout = pn.Column(self.bar, self.text, self.status, sizing_mode="stretch_width")
        self._throttle = Throttle()
        self.param.watch(lambda e: self.refresh(force=True), "runs")

    def refresh(self, force: bool = False) -> None:
        """Update bar, text and status from the runs, about twice a second (no-op when nothing changed)."""
        if not self._throttle.ready(force):
            return
        frac, text = progress_text(self.runs)
        self.bar.value = int(round(1000 * frac))
        self.text.object = text
        status = group_status(self.runs)
        msgs = [f"{r.name}: {short_message(r.message)}" for r in self.runs
                if r.status in ("diverged", "failed") and r.message]
        self.status.object = f"**Status:** {status}" + ("<br>" + "<br>".join(msgs[:4]) if msgs else "")

    def __panel__(self):
        return self._layout


class RunView(LiveView):
    """Overview tab: live loss/accuracy/speedup of one run, with its status."""

    run = param.ClassSelector(class_=RunProgress, default=None, allow_None=True, doc="The run shown.")

    def __init__(self, run: RunProgress | None = None, hub=None, options=None, lazy: bool = False, **params):
        super().__init__(hub, options, lazy, **params)
        self.figures: dict = {}
        self._shape = None           # what the figures were built for: (x field, log y, phase training)
        self._bindings: list = []    # stream_bindings() of the figures
        self._text_throttle = Throttle()
        self.alert = pn.pane.Alert("No run yet: set up an experiment in the sidebar and press **Start**.",
                                   alert_type="light", css_classes=["qatlab-run-alert"],
                                   sizing_mode="stretch_width", margin=(5, 10), renderer_options=NO_AUTOLINKS)
        self.stats = pn.pane.Markdown("", css_classes=["qatlab-run-stats"], sizing_mode="stretch_width",
                                      margin=(0, 10), height=42)
        self._plots = pn.Column(sizing_mode="stretch_width")
        self._layout = pn.Column(self.alert, self.stats, self._plots, sizing_mode="stretch_width")
        self.follow_run(run)

    def rebuild(self) -> None:
        """Show the current run: the same figures moved to its sources when they were built for the
        same plot options and kind of run, else new figures."""
        run = self.run
        if run is None:
            self.figures, self._shape, self._bindings = {}, None, []
            self._plots.objects = []
            return
        rs = self.hub.stream(run)
        shape = (self.x_field, self.options.log_y, run.config.phase.enabled)
        if self.figures and shape == self._shape:
            rebind(self._bindings, rs)
            self.figures["loss"].title.text = f"Loss · {run.name}"
            self.drop_fitter()               # the ranges fit the new run's data from scratch
        else:
            self._build(run, rs)
            self._shape, self._bindings = shape, stream_bindings(self.figures.values(), rs)
        self.refresh(force=True)

    def _build(self, run, rs) -> None:
        """New figures for ``run`` (and their panes in the layout)."""
        x, rid, xr, y_log = self.x_field, run.id, F.shared_x_range(), self.options.log_y
        phased = run.config.phase.enabled

        loss = F.line_figure(f"Loss · {run.name}", "loss", name="fig-loss", x_field=x, x_range=xr,
                             y_log=y_log, height=300)
        if phased:
            F.add_phase_bands(loss, rs.phases, x, name=f"phase-bands-{rid}")
        F.add_line(loss, rs.loss, x, "loss", color="#1f77b4", alpha=0.25, width=1, name=f"loss-raw-{rid}",
                   label="train (raw)")
        ema = F.add_line(loss, rs.loss, x, "loss_s", color="#1f77b4", name=f"loss-{rid}", label="train (EMA)")
        F.add_line(loss, rs.eval, x, "test_loss", color="#d62728", name=f"test-loss-{rid}", label="test")
        F.add_points(loss, rs.eval, x, "test_loss", color="#d62728", name=f"test-loss-points-{rid}")
        F.add_hover(loss, ema, [("step", "@step"), ("loss", "@loss{0.0000}"), ("EMA", "@loss_s{0.0000}")])
        F.finish(loss)

        acc = F.line_figure("Accuracy", "accuracy", name="fig-accuracy", x_field=x, x_range=xr,
                            y_range=F.fraction_range())
        F.add_line(acc, rs.eval, x, "test_accuracy", color="#d62728", name=f"test-accuracy-{rid}", label="test")
        F.add_points(acc, rs.eval, x, "test_accuracy", color="#d62728", name=f"test-accuracy-points-{rid}")
        F.add_line(acc, rs.eval, x, "train_accuracy", color="#1f77b4", dash="dashed",
                   name=f"train-accuracy-{rid}", label="train")
        F.finish(acc, location="bottom_right")
        self.figures = {"loss": loss, "accuracy": acc}

        if phased:
            sp = F.line_figure("Speedup vs full backprop", "speedup (x)", name="fig-speedup", x_field=x,
                               x_range=xr)
            F.add_unit_span(sp)
            F.add_line(sp, rs.train, x, "speedup_steps", color="#9467bd", name=f"speedup-steps-{rid}",
                       label="step count")
            F.add_line(sp, rs.train, x, "speedup_wall", color="#8c564b", name=f"speedup-wall-{rid}",
                       label="wall clock")
            F.finish(sp, location="bottom_right")
            self.figures["speedup"] = sp
            panes = [bokeh_pane(loss), pn.Row(bokeh_pane(acc), bokeh_pane(sp), sizing_mode="stretch_width")]
        else:
            note = pn.pane.Markdown("*Speedup is measured for phase training: enable it under "
                                    "**Phase training** in the sidebar.*", margin=(0, 10))
            panes = [bokeh_pane(loss), bokeh_pane(acc), note]
        self._plots.objects = panes

    def shown_runs(self) -> list:
        return [self.run] if self.run is not None else []

    def refresh(self, force: bool = False) -> None:
        """Status alert and the one-line summary of the latest values (about twice a second)."""
        run = self.run
        if run is None or not self._text_throttle.ready(force):
            return
        status = run.status
        msg = short_message(run.message)
        text = f"**{run.name}** · Status: **{status}**" + (f" · {msg}" if msg else "")
        self.alert.alert_type = ALERT_TYPES.get(status, "light")
        self.alert.object = text
        rs = self.hub.stream(run)
        acc = rs.last("test_accuracy")
        compiling = warmup.status_text() if status == "running" and not run.steps_done else None
        if compiling:
            self.stats.object = compiling
            return
        parts = [f"step {run.steps_done:,} / {run.total_steps:,}",
                 f"loss {rs.last('loss_s'):.4f} (EMA)"]
        if math.isfinite(acc):
            parts.append(f"test accuracy {100 * acc:.1f}%")
        if status == "running":
            parts += [f"{run.steps_per_second:,.0f} steps/s", f"ETA {format_seconds(run.eta)}"]
        else:
            parts.append(f"{format_seconds(run.elapsed)} elapsed")
        self.stats.object = " · ".join(parts)

    def _panel(self):
        return self._layout
