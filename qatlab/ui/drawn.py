"""Wait for the page to draw a figure before starting work that competes with it for the CPU.

Pressing ``Compare STE kinds`` adds six figures to the page; laying them out and painting them
the first time costs the browser most of a core for about a second. On a small machine the
four training threads would share that second with the browser, so the page appears later and
the runs start slowly. :func:`when_drawn` lets the runs wait for it instead:

1. on the next event-loop turn, ``fig.js_on_change("tags", ...)`` puts a small JS callback on
   the figure (one message; document changes belong in document callbacks, which hold its lock);
2. on the turn after that the server adds a tag ``qatlab-drawn-<n>`` (a second message, so
   the callback is already in the page when it arrives);
3. the callback waits two animation frames -- by then the page has laid out and painted what
   the earlier messages added -- and adds ``qatlab-drawn-<n>:ack`` to the tags, which Bokeh
   sends back to the server;
4. the server's ``on_change("tags")`` sees the ack and calls the callback, once.

The figure must be in the page already (sent on an earlier turn, as after
:meth:`~qatlab.ui.base.LiveView.when_built`): a tag that reaches the page before its figure is
lost. A page that never answers (in a background tab, where browsers pause animation frames, or
sent the figure late) starts the work after ``timeout_ms`` anyway; the Dashboard's callback then
checks whether the page has closed meanwhile (its runs never start then). Outside a server session (notebooks,
plain Python) the callback runs at once.
"""
from __future__ import annotations

import itertools

from bokeh.models import CustomJS

DRAWN_TIMEOUT_MS = 2000   # start anyway when the page has not answered by then
_PREFIX = "qatlab-drawn-"
_tokens = itertools.count(1)

_ACK_JS = f"""
const tags = cb_obj.tags;
for (const tag of tags) {{
  if (typeof tag !== 'string' || !tag.startsWith('{_PREFIX}') || tag.endsWith(':ack')) continue;
  if (tags.includes(tag + ':ack')) continue;
  requestAnimationFrame(() => requestAnimationFrame(() => {{
    if (!cb_obj.tags.includes(tag + ':ack')) cb_obj.tags = [...cb_obj.tags, tag + ':ack'];
  }}));
}}
"""


def when_drawn(fig, callback, timeout_ms: int = DRAWN_TIMEOUT_MS) -> None:
    """Call ``callback()`` once the page has drawn ``fig`` (a Bokeh model in a server session's
    document), or after ``timeout_ms``, whichever comes first; at once if ``fig`` is None or not
    in a server session's document. See the module doc."""
    if not callable(callback):
        raise TypeError(f"callback: expected a callable, got {type(callback).__name__}")
    if isinstance(timeout_ms, bool) or not isinstance(timeout_ms, int) or timeout_ms <= 0:
        raise ValueError(f"timeout_ms: expected an int > 0 (milliseconds), got {timeout_ms!r}")
    doc = getattr(fig, "document", None)
    if doc is None or getattr(doc, "session_context", None) is None:
        callback()
        return
    token = f"{_PREFIX}{next(_tokens)}"
    state = {"called": False, "listening": False}

    def stop_listening() -> None:
        if state["listening"]:
            state["listening"] = False
            if on_tags in fig._callbacks.get("tags", ()):   # a destroyed session's figure may have none
                fig.remove_on_change("tags", on_tags)

    def call_once() -> None:
        if state["called"]:
            return
        state["called"] = True
        if state["listening"]:          # not now: Bokeh may be iterating the tags callbacks
            doc.add_next_tick_callback(stop_listening)
        callback()

    def on_tags(attr, old, new) -> None:
        if f"{token}:ack" in new:
            call_once()

    def ask() -> None:
        fig.tags = [*fig.tags, token]

    def install() -> None:     # in a document callback: it holds the document lock
        if not any(getattr(cb, "code", None) == _ACK_JS for cb in fig.js_property_callbacks.get("change:tags", [])):
            fig.js_on_change("tags", CustomJS(code=_ACK_JS))
        if not state["called"]:
            state["listening"] = True
            fig.on_change("tags", on_tags)
            doc.add_next_tick_callback(ask)

    doc.add_next_tick_callback(install)
    doc.add_timeout_callback(call_once, timeout_ms)
