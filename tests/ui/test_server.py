"""The dashboard served by a threaded ``pn.serve``: several sessions stream, then are destroyed.

Sessions are opened with Bokeh's ``pull_session`` (a real websocket client) and with a
plain HTTP GET (a session that never connects). When a session goes away its periodic
callback must stop and the runs it owns must stop and be joined, except a keep-alive run.
"""
from __future__ import annotations

import logging
import re
import socket
import time
import urllib.request

import pytest

pn = pytest.importorskip("panel")

import qatlab as ql  # noqa: E402
from bokeh.client import pull_session  # noqa: E402
from qatlab.executor.remote import active_runs  # noqa: E402
from qatlab.ui import Dashboard, template_kwargs  # noqa: E402

pytestmark = pytest.mark.filterwarnings("ignore:The inplace keyword")

LONG_EPOCHS = 100_000  # runs that are still training when their session goes away


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _wait(predicate, timeout: float = 30.0, interval: float = 0.05) -> bool:
    end = time.monotonic() + timeout
    while time.monotonic() < end:
        if predicate():
            return True
        time.sleep(interval)
    return predicate()


@pytest.fixture(scope="module")
def server(client6):
    """A threaded server whose app starts a run, a comparison or a keep-alive run, by session number."""
    dashboards: list[Dashboard] = []

    def app():
        cfg = ql.ExperimentConfig()
        cfg.model.hidden = [16]
        cfg.optim.epochs = LONG_EPOCHS
        dash = Dashboard(config=cfg, client=client6)
        dashboards.append(dash)
        kind = len(dashboards) % 3
        if kind == 1:
            dash.start_run()
        elif kind == 2:
            dash.compare_ste()
        else:
            dash.config_panel.keep_alive.value = True
            dash.start_run()
        return pn.template.FastListTemplate(sidebar=[dash.sidebar], main=[dash.main], **template_kwargs())

    port = _free_port()
    thread = pn.serve({"app": app}, port=port, address="127.0.0.1", threaded=True, show=False, start=True,
                      check_unused_sessions_milliseconds=100, unused_session_lifetime_milliseconds=200)

    def up() -> bool:
        try:
            with socket.create_connection(("127.0.0.1", port), timeout=0.2):
                return True
        except OSError:
            return False

    assert _wait(up, 20), "server did not start"
    yield f"http://127.0.0.1:{port}/app", dashboards
    for dash in dashboards:
        for run in dash.owned_runs():
            run.stop()
            run.join(10)
    thread.stop()


@pytest.mark.slow
def test_page_is_served_with_local_resources_only(server):
    url, dashboards = server
    n = len(dashboards)
    html = urllib.request.urlopen(url, timeout=30).read().decode()
    assert "qatlab" in html
    refs = re.findall(r'(?:src|href)="([^"]*)"', html)
    assert refs, "no resources found in the page"
    external = [r for r in refs if re.match(r"^(https?:)?//", r)]
    assert external == [], f"page references external hosts: {external}"
    assert "fonts.googleapis" not in html and "cdn.jsdelivr" not in html and "unpkg.com" not in html
    # that GET created a session which never connects: it expires and its run stops and is joined
    assert _wait(lambda: len(dashboards) > n)
    dash = dashboards[n]
    assert _wait(lambda: dash.closed, 30), "unconnected session was not destroyed"
    assert _wait(lambda: all(r.done for r in dash.owned_runs() if not r.keep_alive), 30)


@pytest.mark.slow
def test_sessions_stream_then_stop_and_join_their_runs(server):
    url, dashboards = server
    first = len(dashboards)
    sessions, mine = [], []
    try:
        for i in range(3):
            sessions.append(pull_session(url=url))
            assert _wait(lambda: len(dashboards) > first + i)
            dash = dashboards[first + i]
            mine.append(dash)
            assert dash.owner == sessions[-1].id
            assert _wait(lambda: dash.streaming and dash.hub.ticks > 3, 30), "periodic callback is not running"
            runs = dash.owned_runs()
            assert _wait(lambda: all(len(dash.hub.stream(r).train.data["loss"]) > 0 for r in runs), 60), \
                "no rows streamed"
            for run in runs:   # paused runs stay alive but leave the 2 test cores to the server
                run.pause()
        assert sorted(len(d.owned_runs()) for d in mine) == [1, 1, 4]   # run, comparison, keep-alive run
        assert all(r.status == "paused" for d in mine for r in d.owned_runs())
    finally:
        for s in sessions:
            s.close()

    for dash in mine:
        assert _wait(lambda: dash.closed, 30), "session was not destroyed"
        assert not dash.streaming
        ticks = dash.hub.ticks
        time.sleep(0.3)          # deliberately lets time pass: a closed session's callback must not tick again
        assert dash.hub.ticks == ticks, "periodic callback still ticking after the session closed"
    stopped = [r for d in mine for r in d.owned_runs() if not r.keep_alive]
    kept = [r for d in mine for r in d.owned_runs() if r.keep_alive]
    assert len(stopped) == 5 and len(kept) == 1
    assert _wait(lambda: all(r.done and r.join(0) for r in stopped), 30), [r.status for r in stopped]
    assert all(r.status == "stopped" for r in stopped)
    assert all(d.reaper is None or _wait(lambda: not d.reaper.is_alive(), 30) for d in mine)
    assert kept[0].status == "paused"           # keep-alive: outlives its session ...
    assert kept[0] in active_runs()             # ... and stays in this process's runs for later sessions
    kept[0].stop()
    assert kept[0].join(30) and kept[0].status == "stopped"


class _Context:
    """Stands in for a server session's context (weak-referenceable, with a ``_session``)."""

    def __init__(self, session=None):
        self._session = session


class _Session:
    def __init__(self):
        self.connection_count, self.destroyed, self.milliseconds_since_last_unsubscribe = 0, False, 0.0
        self.expiration_requested = False

    def request_expiration(self):
        self.expiration_requested = True


def test_page_watch_says_gone_only_once_a_connected_page_has_been_away_for_the_grace():
    from bokeh.document import Document
    from qatlab.ui.base import PAGE_GONE_SECONDS, PageWatch
    assert PageWatch(None).gone() is False and PageWatch(Document()).gone() is False   # no server session
    ctx = _Context()
    doc = Document()
    doc._session_context = lambda: ctx
    watch = PageWatch(doc)
    assert watch.gone() is False                       # Bokeh has not made the session yet
    ctx._session = session = _Session()
    session.milliseconds_since_last_unsubscribe = 10_000.0
    assert watch.gone() is False                       # never connected (a plain GET): Bokeh expires it
    session.connection_count = 1
    assert watch.gone() is False and watch.connected_once
    session.connection_count, session.milliseconds_since_last_unsubscribe = 0, 500 * PAGE_GONE_SECONDS
    assert watch.gone() is False                       # away for less than the grace
    session.milliseconds_since_last_unsubscribe = 1000 * PAGE_GONE_SECONDS
    assert watch.gone() is True
    watch.expire()
    assert session.expiration_requested
    session.destroyed = True
    assert watch.gone() is True


def test_writes_to_a_closed_pages_socket_are_not_logged_as_tracebacks(caplog):
    import asyncio

    from qatlab.ui.base import quiet_closed_sockets
    from tornado.iostream import StreamClosedError
    from tornado.websocket import WebSocketClosedError

    async def main():
        quiet_closed_sockets()
        quiet_closed_sockets()                         # installed once
        loop = asyncio.get_running_loop()
        for exc in (WebSocketClosedError(), StreamClosedError(), ValueError("a real bug")):
            loop.call_exception_handler({"message": "Task exception was never retrieved", "exception": exc})

    caplog.set_level(logging.DEBUG)
    asyncio.run(main())
    errors = [r for r in caplog.records if r.levelno >= logging.ERROR]
    assert len(errors) == 1 and "a real bug" in repr(errors[0].exc_info[1])
    assert sum("closed page's websocket" in r.getMessage() for r in caplog.records) == 2
