"""The dashboard server's malloc: one arena, fixed thresholds.

glibc gives each thread that allocates while others do an arena of its own (up to eight per core),
and memory freed in one arena is never reused by another. The server makes threads for every run
(the thread that starts it, the thread that follows it), so the memory finished runs leave free
ends up spread over many arenas, and the server's resident memory grows in steps of an arena's
chunk as runs come and go. Its threads take turns on the GIL anyway, so they seldom wait on a
shared arena's lock: :func:`tune_server_malloc` (glibc's ``mallopt(M_ARENA_MAX)``, what the
``MALLOC_ARENA_MAX`` environment variable sets at start-up) limits the process to
:data:`SERVER_ARENAS`; arenas made before the call stay.

glibc also moves its thresholds as the process runs: freeing a large block (a long run's log, a
big message) raises the size above which blocks are mapped on their own to that block's size, and
the free space it keeps at the top of its heap to twice that, so after one long run the heap holds
on to many megabytes that it would have given back before. :func:`tune_server_malloc` also sets
both thresholds to glibc's own starting values (:data:`MMAP_THRESHOLD`, :data:`TRIM_THRESHOLD`),
which keeps them there (glibc stops moving a threshold that was set).
"""
from __future__ import annotations

import ctypes
import ctypes.util
import os
import sys
import tempfile

M_TRIM_THRESHOLD, M_MMAP_THRESHOLD, M_ARENA_MAX = -1, -3, -8     # glibc's mallopt parameter numbers (malloc.h)
SERVER_ARENAS = 1
MMAP_THRESHOLD = 128 * 1024     # blocks this large or larger are mapped on their own, and unmapped when freed
TRIM_THRESHOLD = 128 * 1024     # free space at the top of the heap beyond this is given back


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


def tune_server_malloc(arenas: int = SERVER_ARENAS) -> bool:
    """Allow at most ``arenas`` malloc arenas in this process from now on, and fix the mmap and trim
    thresholds (module doc); True if glibc took the settings (False on other C libraries and
    systems: nothing is changed)."""
    if not isinstance(arenas, int) or isinstance(arenas, bool) or arenas < 1:
        raise ValueError(f"arenas: expected an int >= 1, got {arenas!r}")
    libc = _glibc()
    if libc is None:
        return False
    settings = ((M_ARENA_MAX, arenas), (M_MMAP_THRESHOLD, MMAP_THRESHOLD), (M_TRIM_THRESHOLD, TRIM_THRESHOLD))
    return all(libc.mallopt(param, value) == 1 for param, value in settings)


def malloc_info() -> str | None:
    """glibc's ``malloc_info`` XML for this process (arenas, free space, mapped blocks), None off glibc."""
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
            return info.read()
    finally:
        os.unlink(path)


def malloc_arenas() -> int | None:
    """How many malloc arenas this process has, None off glibc."""
    info = malloc_info()
    return None if info is None else info.count("<heap nr=")
