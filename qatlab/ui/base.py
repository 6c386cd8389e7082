"""Shared plumbing of the live views: plot options and the :class:`LiveView` base class.

A LiveView owns (or shares) a :class:`~qatlab.ui.streaming.StreamHub` and a
:class:`PlotOptions`. ``pull()`` is one streaming tick (hub pull when the view
owns its hub, then :meth:`LiveView.refresh` for the non-streamed parts: tables,
histograms, status text). Changing ``log_y`` or ``x_axis`` rebuilds the view's
figures from the same sources (Bokeh cannot swap a live figure's scale type).

In a server session a view with ``rebuild_steps`` (the STE comparison's figures) builds one
figure per event-loop turn and shows them in two steps, so other sessions' requests are answered
in between; no piece starts within ``PRESS_QUIET_S`` of a button press on any page
(:func:`note_press`), so presses are answered before figures are built. The time-series figures'
ranges are fitted on the server once per tick (:meth:`LiveView.fit_ranges`).

Per tick, all Bokeh events go to the browser as one message (``pn.io.hold``); status text
is throttled to about 2 Hz (:class:`Throttle`).

Notebook use: a view built without a hub owns one; displaying it starts its own
~10 Hz periodic callback (``start_streaming``) and each tick is pushed with
``pn.io.push_notebook``, so curves move inline.
"""
from __future__ import annotations

import asyncio
import contextlib
import functools
import logging
import time
import weakref

import panel as pn
import param
from panel.io.state import set_curdoc

from . import internals
from .ranges import RangeFitter
from .streaming import StreamHub

log = logging.getLogger(__name__)

PERIOD_MS = 100
#: Markdown options of the panes that show messages and field names: no autolinks (markdown-it
#: linkifies a field name such as ``optim.lr`` into a link to http://optim.lr).
NO_AUTOLINKS = {"linkify": False}
TEXT_PERIOD = 0.5  # seconds between updates of status/progress text (each update re-lays out the page)
_DONE = object()   # sentinel: the rebuild generator is exhausted
MAX_PIECE_REST = 0.25   # seconds: the longest rest after one rebuild piece (see _rebuild_in_pieces)
_active_builds = 0      # rebuilds in pieces under way in this process (all sessions)
PRESS_QUIET_S = 0.3     # seconds after a button press (any page) before a rebuild piece may run
_last_press = -float("inf")


def note_press() -> None:
    """Record a button press: rebuild pieces wait until presses have been quiet for PRESS_QUIET_S
    (with several pages pressing at once, each press is answered before any page's figures are built)."""
    global _last_press
    _last_press = time.monotonic()


async def _after_presses() -> None:
    while (wait := _last_press + PRESS_QUIET_S - time.monotonic()) > 0:
        await asyncio.sleep(wait)


_turns: "weakref.WeakKeyDictionary[asyncio.AbstractEventLoop, asyncio.Lock]" = weakref.WeakKeyDictionary()


def _build_turn() -> asyncio.Lock:
    """The running event loop's lock that rebuild pieces take turns on (FIFO).

    Every session of a server shares its event loop. Without the turn, sessions rebuilding
    at once would each run a piece in every loop turn, and a plain HTTP request, which needs
    several loop turns, would wait behind one piece per session in each of them.
    """
    loop = asyncio.get_running_loop()
    lock = _turns.get(loop)
    if lock is None:
        lock = _turns[loop] = asyncio.Lock()
    return lock


def one_message(callback):
    """Decorate a callback Panel or Bokeh calls (a watcher, a click, a tab switch, a next-tick call) so
    all the Bokeh events it makes go to the page as one message on Panel's write queue (``pn.io.hold``).

    Panel runs a served page's callbacks without a hold: its own widget updates go out on its write
    queue, but a Bokeh model edited directly (a source, a range) goes out on Bokeh's path, which can
    overtake a message Panel queued before it. The browser then meets a model it has not been sent
    yet ("reference ... isn't known") and drops that update. Inside a hold this is a no-op."""
    @functools.wraps(callback)
    def held(*args, **kwargs):
        with pn.io.hold():
            return callback(*args, **kwargs)
    return held


class Throttle:
    """``ready()`` is True at most once per ``period`` seconds (or when forced)."""

    def __init__(self, period: float = TEXT_PERIOD):
        self.period = period
        self._next = 0.0

    def ready(self, force: bool = False) -> bool:
        now = time.monotonic()
        if force or now >= self._next:
            self._next = now + self.period
            return True
        return False


class PlotOptions(param.Parameterized):
    """TensorBoard-style plot handling shared by every view of a session."""

    smoothing = param.Number(default=0.6, bounds=(0.0, 0.99), step=0.01,
                             doc="EMA weight of the smoothed curves (0 = raw).")
    log_y = param.Boolean(default=False, doc="Logarithmic y axis on loss-like plots.")
    x_axis = param.Selector(default="step", objects=["step", "time"], doc="x axis: training step or wall time (s).")

    def controls(self) -> pn.Row:
        """Widgets: ``Smoothing`` slider, ``Log-scale y`` checkbox, ``x axis`` radio buttons."""
        return pn.Row(
            pn.widgets.FloatSlider.from_param(self.param.smoothing, label="Smoothing (EMA)", width=220),
            pn.widgets.Checkbox.from_param(self.param.log_y, label="Log-scale y", align="center"),
            pn.widgets.RadioButtonGroup.from_param(self.param.x_axis, label="x axis", align="center",
                                                   color="default"),
            sizing_mode="stretch_width", css_classes=["qatlab-plot-controls"])


class LiveView(pn.viewable.Viewer):
    """Base of the session views.

    Args:
        hub: the session's StreamHub; None creates (and owns) one.
        options: the session's PlotOptions; None creates one.
        lazy: build figures only while the view is active (``set_active``); the Dashboard makes
            hidden tabs lazy so a Start rebuilds only the visible tab.
    """

    def __init__(self, hub: StreamHub | None = None, options: PlotOptions | None = None, lazy: bool = False,
                 **params):
        super().__init__(**params)
        self._active = not lazy
        self._stale = False
        self._owns_hub = hub is None
        self.options = options if options is not None else PlotOptions()
        self.hub = hub if hub is not None else StreamHub(self.options.smoothing)
        self._periodic = None
        self._root = None
        self._fitter = None
        self._build_id = 0
        self._building = False
        self._after_build = []
        self.options.param.watch(self._on_layout_option, ["log_y", "x_axis"])
        if self._owns_hub:
            self.options.param.watch(lambda e: self.hub.set_smoothing(e.new), "smoothing")

    # -------------------------------------------------------------- streaming
    def pull(self) -> None:
        """One streaming tick: new rows into the sources (own hub only), :meth:`refresh`, then
        :meth:`fit_ranges`."""
        if self._owns_hub:
            self.hub.tick()
        self.refresh()
        self.fit_ranges()

    def fit_ranges(self) -> None:
        """Move the figures' auto ranges to the data streamed so far (:mod:`qatlab.ui.ranges`).

        Views keep their figures in ``self.figures``; a new fitter is made after a rebuild."""
        figures = list(getattr(self, "figures", {}).values())
        if self._fitter is None or list(map(id, self._fitter.figures)) != list(map(id, figures)):
            self.drop_fitter()
            self._fitter = RangeFitter(figures)
        runs = self.shown_runs()
        self._fitter.update(final=bool(runs) and all(r.done for r in runs))   # ended: x ends at the data

    def drop_fitter(self) -> None:
        """Forget the range fitter (the next :meth:`fit_ranges` makes a new one for the figures shown)."""
        if self._fitter is not None:
            self._fitter.close()
            self._fitter = None

    def refresh(self, force: bool = False) -> None:
        """Update the non-streamed parts (status text, tables, histograms). Cheap when nothing changed;
        views that throttle these updates skip the throttle when ``force``."""

    def follow_run(self, run) -> None:
        """For views with a ``run`` parameter: rebuild whenever it changes, and show ``run`` now
        (None: the view's empty state)."""
        self.param.watch(lambda e: self.request_rebuild(), "run")
        if run is not None:
            self.run = run
        else:
            self.rebuild()

    def shown_runs(self) -> list:
        """Runs whose sources this view displays (the Dashboard streams only the visible tab's runs)."""
        return []

    def start_streaming(self, period: int = PERIOD_MS):
        """Start a periodic callback calling :meth:`pull` (idempotent); returns it."""
        if self._periodic is None:
            self._periodic = periodic_callback(self._safe_pull, period)
        return self._periodic

    def stop_streaming(self) -> None:
        """Stop the periodic callback started by :meth:`start_streaming`."""
        if self._periodic is not None:
            self._periodic.stop()
            self._periodic = None

    def _safe_pull(self) -> None:
        streaming_tick(self.pull, self._root)

    # -------------------------------------------------------------- figures
    def _on_layout_option(self, *_events) -> None:
        self.request_rebuild()

    @one_message
    def request_rebuild(self) -> None:
        """Rebuild if the view is active, else when it next becomes active. Views with
        ``rebuild_steps`` rebuild in pieces in a server session (:meth:`_rebuild_in_pieces`),
        elsewhere at once."""
        if not self._active:
            self._stale = True
            return
        self._stale = False
        self._begin_rebuild()

    def _begin_rebuild(self) -> None:
        """Rebuild now, or in pieces from the next tick in a server session (see :meth:`request_rebuild`)."""
        self._build_id += 1
        doc = pn.state.curdoc
        if self.rebuild_steps is not None and in_server_session():
            self._building = True
            doc.add_next_tick_callback(functools.partial(self._rebuild_in_pieces, doc, self._build_id))
        else:
            self.rebuild()

    async def _rebuild_in_pieces(self, doc, build_id: int) -> None:
        """Run ``rebuild_steps()`` one piece (one figure) at a time, yielding to the event loop in
        between: the server answers other requests and sessions meanwhile instead of after the
        whole rebuild (with several sessions pressing Compare at once, that would be seconds). The
        pieces of all sessions take turns (:func:`_build_turn`), so one event-loop turn runs one
        piece, not one per rebuilding session; none starts soon after a button press
        (:func:`note_press`). A newer rebuild request abandons this one."""
        global _active_builds
        pieces = self.rebuild_steps()
        turn = _build_turn()
        _active_builds += 1
        try:
            while build_id == self._build_id:
                await _after_presses()
                async with turn:
                    if build_id != self._build_id or _page_closed(doc):   # nobody to show it to
                        return
                    start = time.perf_counter()
                    with set_curdoc(doc), pn.io.hold():     # one message (see one_message)
                        if next(pieces, _DONE) is _DONE:
                            return
                    if _active_builds > 1:
                        # other sessions build too: rest as long as the piece took, still holding
                        # the turn, so pieces fill at most half of the loop's time and requests
                        # get the other half (a lone build does not wait: Compare starts sooner)
                        await asyncio.sleep(min(time.perf_counter() - start, MAX_PIECE_REST))
                await asyncio.sleep(0)
        finally:
            _active_builds -= 1
            if build_id == self._build_id:   # the latest build ended (done or failed)
                self._building = False
                callbacks, self._after_build = self._after_build, []
                for callback in callbacks:
                    callback()

    def when_built(self, callback) -> None:
        """Call ``callback()`` once the figures requested so far are shown: now, or when a rebuild
        in pieces ends."""
        if self._building:
            self._after_build.append(callback)
        else:
            callback()

    def set_active(self, active: bool) -> None:
        """Mark the view shown/hidden; a pending rebuild runs when it is shown."""
        self._active = bool(active)
        if self._active and self._stale:
            self.request_rebuild()

    #: A generator method doing the rebuild in pieces (yield after each figure), or None.
    rebuild_steps = None

    def rebuild(self) -> None:
        """Recreate the figures (after a run, log_y or x_axis change): all of ``rebuild_steps()``
        where the view has it; views without it override this."""
        for _ in self.rebuild_steps() if self.rebuild_steps is not None else ():
            pass

    @property
    def x_field(self) -> str:
        return self.options.x_axis

    def _panel(self):
        raise NotImplementedError

    def __panel__(self):
        if self._owns_hub:
            self.start_streaming()
        if self._root is None:
            self._root = self._panel()
        return self._root


def stream_bindings(figures, rs) -> list[tuple]:
    """``(renderer, RunStream source attribute, name template)`` of every renderer of ``figures``
    drawn from one of ``rs``'s sources; the template has ``{}`` where the name has the run id."""
    attrs = {id(getattr(rs, a)): a for a in ("loss", "train", "eval", "phases") if getattr(rs, a) is not None}
    out = []
    for fig in figures:
        for r in fig.renderers:
            attr = attrs.get(id(getattr(r, "data_source", None)))
            if attr is not None:
                out.append((r, attr, (r.name or "").replace(rs.run.id, "{}")))
    return out


def rebind(bindings: list[tuple], rs) -> None:
    """Point each renderer of :func:`stream_bindings` at the same source of ``rs`` and name it after
    its run. In a document, Bokeh re-walks every model of it after each change of a model reference
    (a page's whole dashboard, per renderer): frozen, it walks once at the end."""
    with frozen(bindings[0][0] if bindings else None):
        for renderer, attr, template in bindings:
            renderer.update(data_source=getattr(rs, attr), name=template.format(rs.run.id))


def frozen(model):
    """A context in which changes of model references in ``model``'s document (if any) make Bokeh
    re-walk the document's models once, at the end, instead of once per change."""
    doc = getattr(model, "document", None)
    return doc.models.freeze() if doc is not None else contextlib.nullcontext()


def streaming_tick(pull, root) -> None:
    """One periodic tick: ``pull()`` with all its Bokeh events sent as one message, pushed to a
    notebook's ``root`` view when not in a server session; an exception is logged, never raised
    (a bad tick must not kill the session's callback). Skipped while the session's page is
    gone (:func:`page_disconnected`)."""
    if page_disconnected():
        return
    try:
        with pn.io.hold():
            pull()
        if root is not None and not in_server_session():
            pn.io.push_notebook(root)   # notebook: Bokeh model edits need an explicit push
        forget_detached_models(pn.state.curdoc)
    except Exception:
        log.exception("qatlab: streaming tick failed")


def forget_detached_models(doc) -> None:
    """Let go of models that joined ``doc`` and left it before a patch sent them. Bokeh keeps such a
    model, and all it references, in the document's set of new models for the session's lifetime:
    a run's earlier figures and sources, after every Start (public ``Document.models.flush_synced``;
    a model that joins again is new again)."""
    if doc is not None:
        doc.models.flush_synced(lambda model: model.document is not None)


def _page_closed(doc) -> bool:
    """True once the :class:`PageWatch` of ``doc``'s session (a Dashboard's) says its page closed."""
    watch = _watches.get(doc)
    return watch is not None and watch.gone()


def page_disconnected() -> bool:
    """True in a server session that has no browser connection: its page was closed or reloaded
    (or has not connected yet). Bokeh destroys such a session only 15-30 s later; ticking it
    meanwhile pulls and renders for nobody, on the CPU the training runs need. A reconnecting
    page resumes the ticks, and the first one catches up (the hub keeps each run's cursor)."""
    session = internals.server_session(getattr(pn.state.curdoc, "session_context", None))
    return session is not None and session.connection_count == 0


_watches: "weakref.WeakKeyDictionary" = weakref.WeakKeyDictionary()   # Document -> its PageWatch
PAGE_GONE_SECONDS = 0.1   # a page without a connection this long has closed (Panel reconnects are off)


class PageWatch:
    """Tells when the page of a server session has closed: it had a browser connection and has
    had none for ``grace`` seconds (or the session is gone). Bokeh destroys such a session only
    15-30 s later; the Dashboard asks on every tick and stops its runs at once. A session whose
    page never connected is not "gone" here (Bokeh expires it). Outside a server, or with
    :mod:`~qatlab.ui.internals` switched off: never gone.

    Args:
        doc: the session's Document (``pn.state.curdoc`` when the Dashboard is built).
    """

    def __init__(self, doc, grace: float = PAGE_GONE_SECONDS):
        self.grace = grace
        ctx = getattr(doc, "session_context", None) if doc is not None else None
        self._ctx = weakref.ref(ctx) if ctx is not None else None
        self.connected_once = False
        if ctx is not None:
            _watches[doc] = self
            quiet_closed_sockets()

    def _session(self):
        return internals.server_session(self._ctx() if self._ctx is not None else None)

    def gone(self) -> bool:
        if self._ctx is None:
            return False
        session = self._session()
        if session is None or session.destroyed:
            return self.connected_once
        if session.connection_count > 0:
            self.connected_once = True
            return False
        return self.connected_once and session.milliseconds_since_last_unsubscribe >= 1000 * self.grace

    def expire(self) -> None:
        """Ask Bokeh to discard the session at its next unused-session check (not after the
        unused-session lifetime); only while no page is connected."""
        session = self._session()
        if session is not None and not session.destroyed and session.connection_count == 0:
            session.request_expiration()


def _is_closed_socket(exc) -> bool:
    from tornado.iostream import StreamClosedError
    from tornado.websocket import WebSocketClosedError
    return isinstance(exc, (StreamClosedError, WebSocketClosedError))


def quiet_closed_sockets() -> None:
    """On the running event loop (the server's), log a write to a closed page's websocket as one
    debug line instead of a "Task exception was never retrieved" traceback. Panel writes a message
    as several websocket writes; when the page closes between them, the later ones raise at once and
    the futures of the earlier ones are never awaited. Other errors go to the previous handler."""
    try:
        loop = asyncio.get_running_loop()
    except RuntimeError:
        return
    previous = loop.get_exception_handler()
    if getattr(previous, "qatlab_quiet_sockets", False):
        return

    def handler(loop, context):
        if _is_closed_socket(context.get("exception")):
            log.debug("qatlab: a write to a closed page's websocket failed: %s", context.get("message"))
        elif previous is not None:
            previous(loop, context)
        else:
            loop.default_exception_handler(context)
    handler.qatlab_quiet_sockets = True
    loop.set_exception_handler(handler)


def in_server_session() -> bool:
    """True inside a ``panel serve`` / ``pn.serve`` session (False in notebooks and plain Python)."""
    doc = pn.state.curdoc
    return doc is not None and getattr(doc, "session_context", None) is not None


def periodic_callback(callback, period: int = PERIOD_MS):
    """Start a session-scoped ``pn.io.PeriodicCallback`` that does not toggle ``pn.state.busy``.

    ``pn.state.add_periodic_callback`` marks the session busy on every tick, which makes the
    template's busy spinner flicker and sends two extra messages per tick; ``background=True``
    skips that. Otherwise identical (registered per document, stopped on session destroy).
    """
    cb = pn.io.PeriodicCallback(callback=callback, period=period, background=True)
    cb.start()
    internals.stop_with_session(pn.state.curdoc, cb)
    return cb


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
