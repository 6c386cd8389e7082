"""The dashboard server's malloc arenas, capped at one.

glibc gives each thread that allocates while others do an arena of its own (up to eight per core),
and memory freed in one arena is never reused by another. The server makes threads for every run
(the thread that starts it, the thread that follows it), so the memory finished runs leave free
ends up spread over many arenas, and the server's resident memory grows in steps of an arena's
chunk as runs come and go. Its threads take turns on the GIL anyway, so they seldom wait on a
shared arena's lock: :func:`cap_malloc_arenas` (glibc's ``mallopt(M_ARENA_MAX)``, what the
``MALLOC_ARENA_MAX`` environment variable sets at start-up) limits the process to
:data:`SERVER_ARENAS`; arenas made before the call stay.
"""
from __future__ import annotations

import ctypes
import ctypes.util
import os
import sys
import tempfile

M_ARENA_MAX = -8        # glibc's mallopt parameter number (malloc.h)
SERVER_ARENAS = 1


def _glibc():
    """glibc's ``mallopt`` and ``malloc_info`` (None off glibc)."""
    if not sys.platform.startswith("linux"):
        return None
    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")
        libc.mallopt.argtypes, libc.mallopt.restype = (ctypes.c_int, ctypes.c_int), ctypes.c_int
        libc.malloc_info.argtypes, libc.malloc_info.restype = (ctypes.c_int, ctypes.c_void_p), ctypes.c_int
        libc.fopen.argtypes, libc.fopen.restype = (ctypes.c_char_p, ctypes.c_char_p), ctypes.c_void_p
        libc.fclose.argtypes = (ctypes.c_void_p,)
    except (OSError, AttributeError):
        return None
    return libc


def cap_malloc_arenas(arenas: int = SERVER_ARENAS) -> bool:
    """Allow at most ``arenas`` malloc arenas in this process from now on; True if glibc took the
    setting (False on other C libraries and systems: nothing is changed)."""
    if not isinstance(arenas, int) or isinstance(arenas, bool) or arenas < 1:
        raise ValueError(f"arenas: expected an int >= 1, got {arenas!r}")
    libc = _glibc()
    return libc is not None and libc.mallopt(M_ARENA_MAX, arenas) == 1


def malloc_arenas() -> int | None:
    """How many malloc arenas this process has (glibc's ``malloc_info``), None off glibc."""
    libc = _glibc()
    if libc is None:
        return None
    fd, path = tempfile.mkstemp(prefix="qatlab-malloc-info-")
    os.close(fd)
    try:
        f = libc.fopen(path.encode(), b"w")
        if not f:
            return None
        libc.malloc_info(0, f)
        libc.fclose(f)
        with open(path) as info:
            return info.read().count("<heap nr=")
    finally:
        os.unlink(path)
