"""A long-lived server gives back the memory its pages let go of.

Every Start builds the shown tab's figures anew. The old Bokeh models refer to each other, so they
are cyclic garbage, which CPython frees only at a full collection; a server that makes few new
objects reaches one rarely (Panel runs one when a session ends, not while a page stays open). And
glibc keeps freed heap pages mapped. A view marks the process when it drops figures
(:func:`note_garbage`); the server's loop (:func:`start`) then runs one full collection at most
once per :data:`PERIOD_S` (a collection holds the loop for tens of milliseconds, so never on every
Start), and glibc's ``malloc_trim`` every :data:`PERIOD_S`.
"""
from __future__ import annotations

import ctypes
import ctypes.util
import gc
import logging

log = logging.getLogger(__name__)

PERIOD_S = 10.0
_dirty = False
_timer = None


def note_garbage() -> None:
    """Figures (or a page) were dropped: the next tidy-up collects."""
    global _dirty
    _dirty = True


def tidy_if_needed() -> bool:
    """A full collection if garbage was noted since the last (True if it ran), then a heap trim
    either way (freed memory goes back to the system, not only after a rebuild: a long run's rows
    pass through the heap too)."""
    global _dirty
    collected = _dirty
    if collected:
        _dirty = False
        gc.collect()
    trim_heap()
    return collected


def _malloc_trim():
    name = ctypes.util.find_library("c")
    try:
        return getattr(ctypes.CDLL(name), "malloc_trim", None) if name else None
    except OSError:
        return None


_TRIM = _malloc_trim()


def trim_heap() -> bool:
    """Return the C heap's free pages to the system (glibc's ``malloc_trim(0)``); False where the
    C library has no such call."""
    if _TRIM is None:
        return False
    _TRIM(0)
    return True


def start(period_s: float = PERIOD_S) -> None:
    """Tidy up every ``period_s`` seconds on the server's Tornado loop, for the process's lifetime
    (idempotent: one timer per process)."""
    global _timer
    if _timer is not None:
        return
    from tornado.ioloop import PeriodicCallback
    _timer = PeriodicCallback(_tick, period_s * 1000)
    _timer.start()


def _tick() -> None:
    try:
        tidy_if_needed()
    except Exception:           # the timer must outlive a bad tick
        log.exception("qatlab: tidying up the server's memory failed")
