"""The composed dashboard of one session: sidebar, tabs, one periodic callback, cleanup.

:class:`Dashboard` wires the views to one :class:`~qatlab.ui.streaming.StreamHub` and
one :class:`~qatlab.ui.base.PlotOptions`, and is the only place that creates runs:

- ``Start``: ``LocalRun(config, owner=<session id>, keep_alive=<checkbox>)`` shown in Overview,
  Quantization and Phases;
- ``Compare STE kinds``: ``start_ste_comparison(config, owner=..., start=False)``, shown in the
  STE tab; the four runs start once the page has drawn its figures (in a server session they are
  built one per event-loop turn, :meth:`~qatlab.ui.base.LiveView.request_rebuild`, shown in two
  steps, and the page answers when it has drawn them, :mod:`qatlab.ui.drawn`; at most 2 s later);
- ``Stop`` / ``Pause`` / ``Resume``: the session's latest run or comparison.

Streaming: one ``pn.state.add_periodic_callback(..., period=100)`` per session calls
:meth:`Dashboard.pull`: the hub streams new rows of every shown run, the sidebar
progress updates, and only the *visible* tab refreshes its tables/histograms. Ticks are
skipped while the session's page has no connection (closed or reloaded, not yet destroyed).

Cleanup: when the session's page closes (each tick asks :class:`~qatlab.ui.base.PageWatch`:
no connection for 0.1 s after having one) or the session is destroyed
(``pn.state.on_session_destroyed``), the periodic callback stops, and every run this session
owns that is not ``keep_alive`` is stopped at once, then joined and released (model dropped,
history kept) on a small reaper thread, so the server's event loop never blocks; a comparison
whose page closed before its figures were drawn never starts. ``close(join_timeout=...)`` does
the same by hand (notebooks, tests). Runs themselves belong to the process
(``qatlab.runs.all_runs()``), so a keep-alive run stays listed in the Runs tab of later sessions;
the Runs tab lets a page change only its own runs while they are active.
"""
from __future__ import annotations

import itertools
import logging
import threading
import uuid
import weakref

import panel as pn
import param

from ..runs import LocalRun, all_runs, start_ste_comparison
from ..train.experiment import training_paused
from . import render_patch
from .base import PERIOD_MS, PageWatch, PlotOptions, periodic_callback, streaming_tick
from .config_panel import ConfigPanel
from .drawn import when_drawn
from .phase_view import PhaseView
from .quant_view import QuantView
from .run_view import RunStatus, RunView
from .runs_table import RunsTable
from .ste_compare import SteCompareView
from .sweep_view import SweepView
from .streaming import StreamHub

log = logging.getLogger(__name__)

JOIN_TIMEOUT = 30.0
TAB_NAMES = ["Overview", "STE comparison", "Quantization", "Phases", "Runs", "Sweeps"]

_groups = itertools.count(1)

#: Live dashboards of this process (weak): lets tests and benchmarks find a session's dashboard.
DASHBOARDS: "weakref.WeakSet[Dashboard]" = weakref.WeakSet()


def _join_and_release(runs: list[LocalRun], timeout: float) -> None:
    """Join runs a closing page stopped and drop their models (nobody can show them any more)."""
    for run in runs:
        if run.join(timeout) and run.done:
            run.release()


def _session_id() -> str | None:
    doc = pn.state.curdoc
    ctx = getattr(doc, "session_context", None) if doc is not None else None
    return getattr(ctx, "id", None)


class Dashboard(pn.viewable.Viewer):
    """Sidebar + tabs of one session.

    Args:
        config: initial ExperimentConfig (default: a fresh one).
        owner: owner id stamped on runs (default: the server session id, else ``local-<uuid>``).
        period: periodic callback period in ms (0 disables streaming; call :meth:`pull` yourself).
    """

    current = param.ClassSelector(class_=LocalRun, default=None, allow_None=True,
                                  doc="LocalRun shown in Overview, Quantization and Phases.")
    comparison = param.Dict(default={}, doc="{SteKind: LocalRun} shown in the STE comparison tab.")

    def __init__(self, config=None, owner: str | None = None, period: int = PERIOD_MS, **params):
        super().__init__(**params)
        session = _session_id()
        self.owner = owner or session or f"local-{uuid.uuid4().hex[:8]}"
        self.options = PlotOptions()
        self.hub = StreamHub(self.options.smoothing)
        self.options.param.watch(lambda e: self.hub.set_smoothing(e.new), "smoothing")
        self.config_panel = ConfigPanel(config, on_start=self.start_run, on_stop=self.stop,
                                        on_compare=self.compare_ste, on_pause=self.pause, on_resume=self.resume)
        self.config_panel.keep_alive.param.watch(self._on_keep_alive, "value")
        self.status = RunStatus()
        shared = dict(hub=self.hub, options=self.options, lazy=True)  # hidden tabs build their figures when shown
        self.overview = RunView(**shared)
        self.ste = SteCompareView(**shared)
        self.quant = QuantView(**shared)
        self.phases = PhaseView(**shared)
        self.runs = RunsTable(on_show=self.show, owner=self.owner, **shared)
        self.sweeps = SweepView(config_source=self.config_panel.validated, owner=self.owner, **shared)  # Dask workers
        self.views = [self.overview, self.ste, self.quant, self.phases, self.runs, self.sweeps]
        self.tabs = pn.Tabs(*zip(TAB_NAMES, self.views), dynamic=True, sizing_mode="stretch_width",
                            name="qatlab-tabs")
        self.views[0].set_active(True)
        self.tabs.param.watch(self._on_tab, "active")
        self.sidebar = pn.Column(self.config_panel.buttons, self.status, self.config_panel.cards,
                                 sizing_mode="stretch_width")
        self.main = pn.Column(self.options.controls(), self.tabs, sizing_mode="stretch_width")
        self._periodic = None
        self._root = None
        self._period = period
        self.closed = False
        self.page = PageWatch(pn.state.curdoc if session is not None else None)
        self.reaper: threading.Thread | None = None
        self.param.watch(self._on_current, "current")
        self.param.watch(lambda e: setattr(self.ste, "runs", e.new), "comparison")
        DASHBOARDS.add(self)
        if session is not None:
            pn.state.on_session_destroyed(self._on_session_destroyed)
            render_patch.install(pn.state.curdoc)
        if period and session is not None:
            self.start_streaming(period)

    # ------------------------------------------------------------ actions
    def start_run(self) -> LocalRun | None:
        """``Start``: validate the sidebar config and start one run (None if the config is invalid)."""
        with training_paused():   # building the figures: the event loop gets the GIL to itself
            cfg = self.config_panel.validated()
            if cfg is None:
                return None
            try:
                run = LocalRun(cfg, owner=self.owner, keep_alive=self.config_panel.keep_alive.value)
            except (ValueError, TypeError) as exc:
                self.config_panel.notify_error(str(exc))
                return None
            self.current = run          # the current tab stays; figures first, then the run starts (when the block ends)
            self.status.runs = [run]
            run.start()
            self.refresh(force=True)
            return run

    def compare_ste(self) -> dict | None:
        """``Compare STE kinds``: train the sidebar config once per SteKind, concurrently."""
        with training_paused():   # building the figures: the event loop gets the GIL to itself
            cfg = self.config_panel.validated()
            if cfg is None:
                return None
            try:
                runs = start_ste_comparison(cfg, owner=self.owner, group=f"cmp{next(_groups)}", start=False)
            except (ValueError, TypeError, RuntimeError) as exc:
                self.config_panel.notify_error(str(exc))
                return None
            self.tabs.active = 1
            self.comparison = runs      # builds the figures (in a server session: in pieces, later)
            self.status.runs = list(runs.values())
            for run in runs.values():
                run.keep_alive = self.config_panel.keep_alive.value

            def start():                # the runs start once the page has drawn their figures ...
                if not self.closed and self.page.gone():
                    self._close_and_reap()
                for run in runs.values():  # ... unless it closed before (keep-alive runs start anyway)
                    if self.closed and not run.keep_alive:
                        run.stop()
                    else:
                        run.start()
                if not self.closed:
                    self.refresh(force=True)  # statuses "running" now, not after the next throttle period
            self.status.refresh(force=True)
            self.ste.when_built(lambda: when_drawn(self.ste.figures.get("loss"), start))
            return runs

    def _active_runs(self) -> list[LocalRun]:
        return list(self.status.runs)

    def stop(self) -> None:
        """``Stop``: stop the session's latest run or comparison."""
        for run in self._active_runs():
            if not run.done:
                run.stop()

    def pause(self) -> None:
        """``Pause`` the latest run or comparison."""
        for run in self._active_runs():
            run.pause()

    def resume(self) -> None:
        """``Resume`` the latest run or comparison."""
        for run in self._active_runs():
            run.resume()

    def show(self, run: LocalRun) -> None:
        """Show ``run`` in Overview / Quantization / Phases (from the Runs tab)."""
        self.current = run
        self.tabs.active = 0

    def owned_runs(self) -> list[LocalRun]:
        """Every run this session started."""
        return [r for r in all_runs() if r.owner == self.owner]

    def _on_tab(self, event) -> None:
        for i, view in enumerate(self.views):
            view.set_active(i == event.new)
        view = self.views[event.new]
        self.hub.pull({r.id for r in view.shown_runs()})   # catch up before the tab is drawn
        view.refresh()
        view.fit_ranges()

    def _on_current(self, event) -> None:
        for view in (self.overview, self.quant, self.phases):
            view.run = event.new

    def _on_keep_alive(self, event) -> None:
        for run in self.owned_runs():
            if not run.done:
                run.keep_alive = bool(event.new)

    # ------------------------------------------------------------ streaming
    def pull(self) -> None:
        """One tick: stream new rows of the visible tab's runs, update the sidebar, refresh that tab.

        Runs of hidden tabs keep their cursor and catch up when their tab is opened.
        """
        view = self.views[self.tabs.active]
        self.hub.pull({r.id for r in view.shown_runs()}, every_metric=self.hub.tick_is_full())
        self.refresh()
        view.fit_ranges()

    def refresh(self, force: bool = False) -> None:
        """Sidebar progress and the visible tab's non-streamed parts (now if ``force``, else as
        often as their throttles allow)."""
        self.status.refresh(force)
        self.views[self.tabs.active].refresh(force)

    def _safe_pull(self) -> None:
        if not self.closed and self.page.gone():   # page closed: stop its runs now, not when Bokeh
            self._close_and_reap()                 # destroys the session 15-30 s later
            self.page.expire()
        if not self.closed:
            streaming_tick(self.pull, self._root)

    def start_streaming(self, period: int = PERIOD_MS):
        """Start the session's periodic callback (idempotent)."""
        if self._periodic is None:
            self._periodic = periodic_callback(self._safe_pull, period)
        return self._periodic

    @property
    def streaming(self) -> bool:
        """True while the periodic callback is running."""
        return self._periodic is not None and self._periodic.running

    # ------------------------------------------------------------ cleanup
    def close(self, join_timeout: float | None = JOIN_TIMEOUT) -> list[LocalRun]:
        """Stop streaming and stop owned runs that are not keep-alive; with ``join_timeout``, join
        them and release their models (:meth:`~qatlab.runs.LocalRun.release`; their history stays).

        Returns the runs that were asked to stop. Idempotent: a second call returns [].
        """
        if self.closed:
            return []
        self.closed = True
        if self._periodic is not None:
            try:
                self._periodic.stop()
            except Exception:
                log.exception("qatlab: stopping the periodic callback failed")
            self._periodic = None
        self.sweeps.close(stop=not self.config_panel.keep_alive.value)
        stopping = [r for r in self.owned_runs() if not r.keep_alive and not r.done]
        for run in stopping:
            run.stop()
        if join_timeout is not None:
            _join_and_release(stopping, join_timeout)
        return stopping

    def _close_and_reap(self) -> None:
        """Page closed or session destroyed: stop streaming and owned runs now, join and release
        them on a reaper thread (the server's event loop never waits for a run)."""
        stopping = self.close(join_timeout=None)
        if stopping:
            self.reaper = threading.Thread(target=_join_and_release, args=(stopping, JOIN_TIMEOUT),
                                           name=f"qatlab-reaper-{self.owner[:8]}", daemon=True)
            self.reaper.start()

    def _on_session_destroyed(self, session_context) -> None:
        self._close_and_reap()

    def __panel__(self):
        if self._period and not self.closed:
            self.start_streaming(self._period)  # notebook: stream once displayed
        if self._root is None:
            self._root = pn.Row(pn.Column(self.sidebar, width=340), self.main, sizing_mode="stretch_width")
        return self._root
