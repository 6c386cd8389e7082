"""Count the document patches Bokeh's server sends on its own path, outside Panel's write queue.

A served Panel page gets its updates two ways: Panel's own (``pn.io.hold``/``unlocked``: a message
serialized at once, written or queued in order) and Bokeh's (a Bokeh model edited outside any
hold: ``ServerConnection.send_patch_document``, written as soon as the socket is free). A Bokeh
message can overtake one Panel queued before it; if it refers to a model that queued message
defines, the browser rejects it ("reference p1234 isn't known") and that update is lost. The app
keeps every edit inside a hold (:func:`qatlab.ui.base.one_message`), so a served page should see
no Bokeh-path patch at all: the browser tests read :func:`report` through the bench's inspector.
"""
from __future__ import annotations

import threading
import traceback

_lock = threading.Lock()
_count = 0
_samples: list[dict] = []
MAX_SAMPLES = 20


def install() -> None:
    """Wrap ``ServerConnection.send_patch_document`` in this process to count its calls (idempotent)."""
    from bokeh.server.connection import ServerConnection
    send = ServerConnection.send_patch_document
    if getattr(send, "qatlab_counted", False):
        return

    def counted(self, event):
        _record(event)
        return send(self, event)

    counted.qatlab_counted = True
    ServerConnection.send_patch_document = counted


def _record(event) -> None:
    global _count
    model = getattr(event, "model", None)
    frames = [f"{f.filename.rsplit('/qatlab/', 1)[-1]}:{f.lineno} {f.name}"
              for f in traceback.extract_stack(limit=40)[:-2] if "/qatlab/" in f.filename]
    with _lock:
        _count += 1
        if len(_samples) < MAX_SAMPLES:
            _samples.append({"event": type(event).__name__, "model": type(model).__name__ if model else None,
                             "attr": getattr(event, "attr", None), "qatlab_frames": frames[-6:]})


def report() -> dict:
    """``{"count": patches sent on Bokeh's path so far, "samples": the first few, with qatlab's frames}``."""
    with _lock:
        return {"count": _count, "samples": list(_samples)}
