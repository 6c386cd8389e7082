"""The composed dashboard of one session: sidebar, tabs, one periodic callback, cleanup.

:class:`Dashboard` wires the views to one :class:`~qatlab.ui.streaming.StreamHub` and
one :class:`~qatlab.ui.base.PlotOptions`, and is the only place that creates runs. The server
trains nothing: every run is a :class:`~qatlab.executor.remote.RemoteRun` (``ql.Run``) on the Dask
client (:func:`qatlab.executor.connect`: the local cluster, or ``$QATLAB_SCHEDULER``), its rows
streamed back into ``run.log`` (at most :data:`PAGE_LOG_ROWS` kept here) and kept in the run store
(``$QATLAB_STORE``):

- ``Start``: one run of the sidebar config, shown in Overview, Quantization and Phases;
- ``Compare STE kinds``: one run per SteKind, started together, shown in the STE tab;
- ``Stop`` / ``Pause`` / ``Resume``: the session's latest run or comparison.

Streaming: one periodic callback (``period=100`` ms) per session calls :meth:`Dashboard.pull`:
the hub streams new rows of the visible tab's runs, the sidebar progress updates, and only the
visible tab refreshes its tables/histograms. Ticks are skipped while the session's page has no
connection (closed or reloaded, not yet destroyed).

Cleanup: when the session's page closes (each tick asks :class:`~qatlab.ui.base.PageWatch`:
no connection for 0.1 s after having one) or the session is destroyed
(``pn.state.on_session_destroyed``), the periodic callback stops and every run this session
owns that is not ``keep_alive`` is asked to stop at once (its worker stops within a step); a
reaper thread then waits for their results and drops their models from this process (the store
keeps them). ``close(join_timeout=...)`` does the same by hand (notebooks, tests).
"""
from __future__ import annotations

import itertools
import logging
import threading
import time
import uuid
import weakref

import panel as pn
import param
from panel.io.state import set_curdoc

from ..config import SteKind
from ..executor import cluster
from ..executor.remote import RemoteRun, active_runs, default_store
from . import internals
from .base import PERIOD_MS, PageWatch, PlotOptions, in_server_session, one_message, periodic_callback, streaming_tick
from .config_panel import ConfigPanel
from .phase_view import PhaseView
from .quant_view import QuantView
from .run_view import RunStatus, RunView
from .runs_table import RunsTable
from .ste_compare import SteCompareView
from .streaming import StreamHub
from .sweep_view import SweepView

log = logging.getLogger(__name__)

JOIN_TIMEOUT = 30.0
#: Rows of history a page's run keeps in the server (older ones thinned 2:1 past it): its figures
#: show at most 1000 points a curve, and the store keeps every row (downloads read it there).
PAGE_LOG_ROWS = 10_000
#: Text (sidebar status, the tab's tables) changes on ticks that stream rows, so the browser lays
#: out and repaints once for both; after this many seconds without rows (a run paused, ended or
#: stalled) it changes on any tick.
TEXT_QUIET_S = 0.5
TAB_NAMES = ["Overview", "STE comparison", "Quantization", "Phases", "Runs", "Sweeps"]

_groups = itertools.count(1)

#: Live dashboards of this process (weak): lets tests and benchmarks find a session's dashboard.
DASHBOARDS: "weakref.WeakSet[Dashboard]" = weakref.WeakSet()


def on_next_tick(doc, fn, *args) -> None:
    """``fn(*args)`` on ``doc``'s next tick (with ``doc`` as Panel's current document), or now
    when ``doc`` is None; nothing if the session is gone."""
    if doc is None:
        fn(*args)
        return

    def call():
        with set_curdoc(doc), pn.io.hold():     # one message (see base.one_message)
            fn(*args)

    try:
        doc.add_next_tick_callback(call)
    except Exception:           # the session was destroyed meanwhile: nobody to show it to
        log.debug("qatlab: session gone before its runs were shown")


def _join_and_release(runs: list, timeout: float) -> None:
    """Wait for the results of runs a closing page stopped and drop their models from this process."""
    for run in runs:
        if run.join(timeout) and run.done:
            run.release()


def _per_ste_kind(cfg, group: str):
    """``(kind, config, name)`` for each SteKind: ``cfg`` itself, its STE set to that kind just
    before the run made from it copies it (no copy of its own)."""
    for kind in SteKind:
        cfg.quant.ste = kind.value
        yield kind, cfg, f"{group} {kind.value}"


def _session_id() -> str | None:
    doc = pn.state.curdoc
    ctx = getattr(doc, "session_context", None) if doc is not None else None
    return getattr(ctx, "id", None)


class Dashboard(pn.viewable.Viewer):
    """Sidebar + tabs of one session.

    Args:
        config: initial ExperimentConfig (default: :func:`~qatlab.config.dashboard_config`).
        owner: owner id stamped on runs (default: the server session id, else ``local-<uuid>``).
        period: periodic callback period in ms (0 disables streaming; call :meth:`pull` yourself).
        client: the Dask client runs train on (default: :func:`qatlab.executor.connect`, on first use).
        store: the RunStore runs are kept in (default: the process's ``RunStore()``).
    """

    current = param.Parameter(default=None, doc="The run shown in Overview, Quantization and Phases.")
    comparison = param.Dict(default={}, doc="{SteKind: run} shown in the STE comparison tab.")

    def __init__(self, config=None, owner: str | None = None, period: int = PERIOD_MS, client=None, store=None,
                 **params):
        super().__init__(**params)
        session = _session_id()
        self.owner = owner or session or f"local-{uuid.uuid4().hex[:8]}"
        self._client = client
        self.store = store if store is not None else default_store()
        self._started: list[RemoteRun] = []     # this page's runs that may still be active
        self.options = PlotOptions()
        self.hub = StreamHub(self.options.smoothing)
        self.options.param.watch(lambda e: self.hub.set_smoothing(e.new), "smoothing")
        self.config_panel = ConfigPanel(config, on_start=self.start_run, on_stop=self.stop,
                                        on_compare=self.compare_ste, on_pause=self.pause, on_resume=self.resume)
        self.config_panel.keep_alive.param.watch(self._on_keep_alive, "value")
        self.status = RunStatus()
        # hidden tabs build their figures when shown (but the STE comparison's two overlays, built once
        # the page has loaded: SteCompareView.prepare)
        shared = dict(hub=self.hub, options=self.options, lazy=True)
        self.overview = RunView(**shared)
        self.ste = SteCompareView(**shared)
        self.quant = QuantView(**shared)
        self.phases = PhaseView(**shared)
        self.runs = RunsTable(store=self.store, live_runs=self.live_runs, on_show=self.show,
                              on_load_config=self.config_panel.load_config, owner=self.owner, **shared)
        self.sweeps = SweepView(config_source=self.config_panel.validated, owner=self.owner, store=self.store,
                                client=client, **shared)
        self.views = [self.overview, self.ste, self.quant, self.phases, self.runs, self.sweeps]
        # every tab is in the page from the start (hidden ones build their figures when shown): a switch
        # sends one property, where a dynamic Tabs renders the tab on the server at each switch
        self.tabs = pn.Tabs(*zip(TAB_NAMES, self.views), sizing_mode="stretch_width",
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
        self._rows_at = 0.0          # time.monotonic() of the last tick that streamed rows
        self.page = PageWatch(pn.state.curdoc if session is not None else None)
        self.reaper: threading.Thread | None = None
        self.param.watch(self._on_current, "current")
        self.param.watch(self._on_comparison, "comparison")
        DASHBOARDS.add(self)
        if session is not None:
            pn.state.on_session_destroyed(self._on_session_destroyed)
            internals.install_render_patch(pn.state.curdoc)
            # Compare waits for the comparison's figures, built once the page has connected (changes
            # made before would not reach it): a comparison never sends figures while its runs start
            # (on the tick after: inside onload, Panel's write queue is not in use yet)
            doc = pn.state.curdoc
            pn.state.onload(lambda: on_next_tick(doc, self._prepare_comparison))
        else:
            self.ste.prepare()
        if period and session is not None:
            self.start_streaming(period)

    @property
    def client(self):
        """The Dask client runs train on (connected on first use)."""
        if self._client is None:
            self._client = cluster.connect()
        return self._client

    # ------------------------------------------------------------ actions
    def _start(self, configs, show) -> dict | None:
        """Start one RemoteRun per ``(key, config, name)`` of ``configs``, then ``show(runs)`` once
        they have ids (each run copies its config as it is made: one config may change between items).
        In a server session the starting (store and Dask calls) runs on a thread and ``show`` on the
        session's next tick, so the click is answered at once; elsewhere both happen now. The runs
        are this page's from the start (a close or Stop reaches them); when one is refused
        (config, memory, no cluster) the others stop, the page says why and (here) None is returned."""
        try:
            runs = {key: RemoteRun(cfg, name=name, owner=self.owner, keep_alive=self.config_panel.keep_alive.value,
                                   store=self.store, client=self._client, keep_model=False, log_rows=PAGE_LOG_ROWS)
                    for key, cfg, name in configs}
        except (ValueError, TypeError) as exc:
            self.config_panel.notify_error(str(exc))
            return None
        self._started = [r for r in self._started if not r.done] + list(runs.values())
        self.status.runs = list(runs.values())
        doc = pn.state.curdoc if in_server_session() else None
        if doc is None:
            return runs if self._submit(runs, show, None) else None
        threading.Thread(target=self._submit, args=(runs, show, doc), name=f"qatlab-start-{self.owner[:8]}",
                         daemon=True).start()
        return runs

    def _submit(self, runs: dict, show, doc) -> bool:
        """Start ``runs``, then ``show(runs)``; if one is refused, stop them all and say why (on
        ``doc``'s next tick when given)."""
        try:
            for run in runs.values():
                run.start()
        except Exception as exc:
            if not isinstance(exc, (ValueError, TypeError, OSError, TimeoutError)):
                log.exception("qatlab: starting runs failed")
            for run in runs.values():
                run.stop()
            on_next_tick(doc, self._refused, runs, str(exc))
            return False
        on_next_tick(doc, self._show_started, runs, show)
        return True

    def _refused(self, runs: dict, message: str) -> None:
        """The page forgets runs that were refused before they started, and says why."""
        refused = list(runs.values())
        self._started = [r for r in self._started if r not in refused]
        if self.status.runs == refused:
            self.status.runs = []
        self.config_panel.notify_error(message)

    def _show_started(self, runs: dict, show) -> None:
        if not self.closed and all(run.id is not None for run in runs.values()):   # (not stopped before it started)
            show(runs)
            self.refresh(force=True)

    def start_run(self) -> RemoteRun | None:
        """``Start``: validate the sidebar config and start one run (None if it is refused; in a
        server session it starts in the background, :meth:`_start`)."""
        cfg = self.config_panel.validated()
        runs = None if cfg is None else self._start([("run", cfg, None)], self._show_run)
        return None if runs is None else runs["run"]

    def _show_run(self, runs: dict) -> None:
        self.current = runs["run"]          # the current tab stays

    def compare_ste(self) -> dict | None:
        """``Compare STE kinds``: train the sidebar config once per SteKind, together; the STE
        comparison tab opens at once (in a server session its curves follow once the runs have ids)."""
        cfg = self.config_panel.validated()
        if cfg is None:
            return None
        runs = self._start(_per_ste_kind(cfg, f"cmp{next(_groups)}"), self._show_comparison)
        if runs is not None:
            self.tabs.active = 1
        return runs

    def _prepare_comparison(self) -> None:
        """Build the STE comparison's figures (in pieces) with ``Compare STE kinds`` disabled meanwhile.
        Called once the page has connected: disabled in the session's first document instead, the
        button stayed disabled in the page after its enabling (Panel 1.9)."""
        doc = pn.state.curdoc
        self.config_panel.set_compare_ready(False)
        self.ste.prepare()
        self.ste.when_built(lambda: on_next_tick(doc, self.config_panel.set_compare_ready, True))

    def _show_comparison(self, runs: dict) -> None:
        self.comparison = runs

    def stop(self) -> None:
        """``Stop``: stop the session's latest run or comparison."""
        for run in self.status.runs:
            if not run.done:
                run.stop()

    def pause(self) -> None:
        """``Pause`` the latest run or comparison."""
        for run in self.status.runs:
            run.pause()

    def resume(self) -> None:
        """``Resume`` the latest run or comparison."""
        for run in self.status.runs:
            run.resume()

    def show(self, run) -> None:
        """Show ``run`` (a live run or a stored one) in Overview / Quantization / Phases (from the Runs tab)."""
        self.current = run
        self.tabs.active = 0

    def owned_runs(self) -> list[RemoteRun]:
        """The runs this page holds: its latest run or comparison, and any earlier ones still active
        (an ended run is dropped at the next start: the store keeps it)."""
        return list(self._started)

    def live_runs(self) -> list[RemoteRun]:
        """Runs of this process whose rows arrive here: every page's active ones, and this page's."""
        return list({id(r): r for r in [*active_runs(), *self._started]}.values())

    @one_message
    def _on_tab(self, event) -> None:
        for i, view in enumerate(self.views):
            view.set_active(i == event.new)
        view = self.views[event.new]
        self.hub.pull({r.id for r in view.shown_runs()})   # catch up before the tab is drawn
        view.refresh()
        view.fit_ranges()

    @one_message
    def _on_current(self, event) -> None:
        for view in (self.overview, self.quant, self.phases):
            view.run = event.new
        self._forget_unshown()

    @one_message
    def _on_comparison(self, event) -> None:
        self.ste.runs = event.new
        self._forget_unshown()

    def _forget_unshown(self) -> None:
        """Drop the streams of runs no view shows any more (their rows stay in the run and the store)."""
        shown = {r.id for view in self.views for r in view.shown_runs()}
        for stream in self.hub.streams:
            if stream.run.id not in shown:
                self.hub.drop(stream.run.id)

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
        rows = self.hub.tick({r.id for r in view.shown_runs()})
        now = time.monotonic()
        if rows:
            self._rows_at = now
        if rows or now - self._rows_at > TEXT_QUIET_S:
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
    def close(self, join_timeout: float | None = JOIN_TIMEOUT) -> list[RemoteRun]:
        """Stop streaming and stop owned runs that are not keep-alive; with ``join_timeout``, wait
        for their results and drop their models from this process (the store keeps them).

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
