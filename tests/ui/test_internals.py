"""qatlab.ui.internals: with QATLAB_PANEL_INTERNALS=0 nothing private is touched, and the app still
serves a page that trains a run (headless chromium against ``panel serve app/``)."""
from __future__ import annotations

import os
from types import SimpleNamespace

import pytest

pytest.importorskip("panel")

from bokeh.document import Document  # noqa: E402
from panel.io.state import set_curdoc  # noqa: E402

from qatlab.ui import base, internals  # noqa: E402

DONE = ("finished", "stopped", "diverged", "failed")


class _Context:
    """Stands in for a server session's context (weak-referenceable, with a ``_session``)."""

    def __init__(self, session):
        self._session = session


def _server_doc(connections: int) -> Document:
    doc = Document()
    session = SimpleNamespace(connection_count=connections, destroyed=False, milliseconds_since_last_unsubscribe=1e6)
    context = _Context(session)
    doc._session_context = lambda: context
    return doc


def test_switched_off_nothing_private_is_read_or_written(monkeypatch):
    from panel.theme.fast import Fast
    monkeypatch.setattr(internals, "ENABLED", False)
    doc = _server_doc(connections=0)
    with set_curdoc(doc):
        assert base.page_disconnected() is False           # the connection count is not read
    watch = base.PageWatch(doc)
    doc.session_context._session.connection_count = 1
    assert watch.gone() is False                           # ... nor when it had one and lost it
    doc.session_context._session.connection_count = 0
    assert watch.gone() is False
    registered = []
    monkeypatch.setattr("panel.state._periodic", SimpleNamespace(setdefault=lambda *a: registered))
    internals.stop_with_session(doc, object())
    assert registered == []
    assert internals.fast_design() is Fast
    internals.install_render_patch(doc)
    assert not doc.callbacks._js_event_callbacks


def test_switched_on_the_session_and_design_are_used(monkeypatch):
    from panel.theme.fast import Fast
    monkeypatch.setattr(internals, "ENABLED", True)
    with set_curdoc(_server_doc(connections=0)):
        assert base.page_disconnected() is True
    design = internals.fast_design()
    assert issubclass(design, Fast) and "font" not in design._resources
    doc = Document()
    internals.install_render_patch(doc)
    assert "document_ready" in doc.callbacks._js_event_callbacks


@pytest.mark.browser
@pytest.mark.slow
def test_the_app_trains_a_run_with_the_internals_switched_off(open_app, tmp_path):
    server, dash = open_app(QATLAB_PANEL_INTERNALS="0", QATLAB_STORE=str(tmp_path / "runs.sqlite"))
    dash.set_input("Epochs", 1)
    dash.click("Start")
    assert dash.wait_status(lambda s: s in DONE, timeout=90, what="finished") == "finished"
    assert dash.source_lengths() and max(dash.source_lengths().values()) > 0
    assert dash.page.evaluate("() => window.qatlab_render_patch === undefined")
    assert "Traceback" not in server.log_tail(400), server.log_tail()
    assert os.environ.get("QATLAB_PANEL_INTERNALS") is None          # (the server's environment only)
