"""qatlab.ui.drawn.when_drawn: the server side of the page-drawn handshake, without a browser
(the browser test checks that a real page answers)."""
from __future__ import annotations

import pytest

pytest.importorskip("panel")

from bokeh.document import Document  # noqa: E402
from bokeh.plotting import figure  # noqa: E402
from qatlab.ui.drawn import DRAWN_TIMEOUT_MS, when_drawn  # noqa: E402


class _Context:
    """Stands in for a server session's context (``doc.session_context`` is a weak reference)."""


def session_figure(monkeypatch):
    """(fig, ticks, timeouts): a figure in a Document that looks like a server session's, whose
    next-tick and timeout callbacks are recorded instead of scheduled."""
    doc = Document()
    doc._context = _Context()
    doc._session_context = lambda: doc._context
    ticks, timeouts = [], []
    monkeypatch.setattr(doc, "add_next_tick_callback", ticks.append)
    monkeypatch.setattr(doc, "add_timeout_callback", lambda cb, ms: timeouts.append((cb, ms)))
    fig = figure()
    doc.add_root(fig)
    return fig, ticks, timeouts


def test_outside_a_server_session_the_callback_runs_at_once():
    calls = []
    when_drawn(None, lambda: calls.append("none"))
    fig = figure()
    when_drawn(fig, lambda: calls.append("no doc"))
    Document().add_root(fig)
    when_drawn(fig, lambda: calls.append("plain doc"))
    assert calls == ["none", "no doc", "plain doc"]


def test_the_page_ack_calls_back_once(monkeypatch):
    fig, ticks, timeouts = session_figure(monkeypatch)
    calls = []
    when_drawn(fig, lambda: calls.append(1))
    assert calls == [] and len(ticks) == 1 and timeouts[0][1] == DRAWN_TIMEOUT_MS
    assert "change:tags" not in fig.js_property_callbacks
    ticks.pop(0)()                        # install: the JS callback goes to the page first ...
    assert len(fig.js_property_callbacks["change:tags"]) == 1 and fig.tags == []
    ticks.pop(0)()                        # ... then the request
    (token,) = fig.tags
    assert token.startswith("qatlab-drawn-") and calls == []
    fig.tags = [*fig.tags, "unrelated"]
    assert calls == []
    fig.tags = [*fig.tags, f"{token}:ack"]  # what the page's JS sends back
    assert calls == [1]
    timeouts[0][0]()                      # the fallback after an ack does nothing
    fig.tags = [*fig.tags, f"{token}:ack"]
    assert calls == [1] and len(fig._callbacks["tags"]) == 1
    ticks.pop(0)()                        # the listener goes on the next turn
    assert ticks == [] and fig._callbacks["tags"] == []


def test_no_answer_starts_after_the_timeout_once_and_the_js_is_installed_once(monkeypatch):
    fig, ticks, timeouts = session_figure(monkeypatch)
    calls = []
    for name in ("a", "b"):
        when_drawn(fig, lambda name=name: calls.append(name))
    while ticks:
        ticks.pop(0)()
    assert len(fig.js_property_callbacks["change:tags"]) == 1 and len(fig.tags) == 2
    for cb, _ms in timeouts:
        cb()
        cb()
    assert calls == ["a", "b"]
    while ticks:                          # the listeners go
        ticks.pop(0)()
    assert fig._callbacks["tags"] == []
    fig.tags = [*fig.tags, *(f"{t}:ack" for t in list(fig.tags))]   # a late answer changes nothing
    assert calls == ["a", "b"]


def test_a_timeout_before_install_never_listens(monkeypatch):
    fig, ticks, timeouts = session_figure(monkeypatch)
    calls = []
    when_drawn(fig, lambda: calls.append(1))
    timeouts[0][0]()
    ticks.pop(0)()                        # install: the JS goes in, but no request, no listener
    assert calls == [1] and ticks == [] and fig.tags == [] and not fig._callbacks.get("tags")


def test_bad_arguments_are_refused_before_anything_is_scheduled(monkeypatch):
    fig, ticks, timeouts = session_figure(monkeypatch)
    with pytest.raises(TypeError, match="callback: expected a callable"):
        when_drawn(fig, None)
    for bad in (0, -5, 1.5, True, "2000"):
        with pytest.raises(ValueError, match="timeout_ms: expected an int > 0"):
            when_drawn(fig, lambda: None, timeout_ms=bad)
    assert ticks == [] and timeouts == [] and fig.tags == []


def test_a_listener_already_gone_is_not_removed_twice(monkeypatch):
    """The listener goes on the turn after the answer; a figure whose tags callbacks were cleared
    meanwhile (a destroyed session) must not raise ``list.remove(x): x not in list``."""
    fig, ticks, timeouts = session_figure(monkeypatch)
    calls = []
    when_drawn(fig, lambda: calls.append(1))
    ticks.pop(0)()
    ticks.pop(0)()
    (token,) = fig.tags
    fig.tags = [*fig.tags, f"{token}:ack"]
    assert calls == [1] and len(fig._callbacks["tags"]) == 1
    fig._callbacks["tags"].clear()
    ticks.pop(0)()                        # stop_listening: nothing to remove, no error
    assert fig._callbacks["tags"] == [] and calls == [1]
