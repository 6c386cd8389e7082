"""qatlab.ui.heap: the server's malloc on one arena (checked in fresh processes).

The fixed mmap and trim thresholds are checked only as far as glibc accepting them (the settings'
effect on a heap depends on its state; the dashboard bench measures the memory they keep flat)."""
from __future__ import annotations

import subprocess
import sys

import pytest

from qatlab.ui.heap import tune_server_malloc, malloc_arenas

# Four threads that each allocate (ctypes calls malloc without the GIL) while all four are alive:
# glibc gives each an arena of its own unless the process is capped.
SCRIPT = """
import ctypes, ctypes.util, sys, threading
from qatlab.ui.heap import tune_server_malloc, malloc_arenas
if sys.argv[1] == "cap":
    assert tune_server_malloc()          # glibc took all three settings
libc = ctypes.CDLL(ctypes.util.find_library("c"))
libc.malloc.restype, libc.malloc.argtypes = ctypes.c_void_p, (ctypes.c_size_t,)
together, kept = threading.Barrier(4), []
def allocate():
    together.wait()
    kept.append(libc.malloc(1000))
    together.wait()
threads = [threading.Thread(target=allocate) for _ in range(4)]
for t in threads:
    t.start()
for t in threads:
    t.join()
print(malloc_arenas())
"""


def _printed(script: str, mode: str) -> int:
    """The number ``script`` prints, run in a fresh process with ``mode`` ("cap" or "none") as argv[1]."""
    out = subprocess.run([sys.executable, "-c", script, mode], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    return int(out.stdout.strip())


@pytest.mark.skipif(malloc_arenas() is None, reason="glibc's malloc_info is not available")
def test_capped_process_keeps_one_malloc_arena_however_many_threads_allocate():
    assert _printed(SCRIPT, "none") >= 3
    assert _printed(SCRIPT, "cap") == 1


def test_arena_cap_rejects_a_count_below_one_before_changing_anything():
    for bad in (0, -1, 1.5, True, "2"):
        with pytest.raises(ValueError, match="arenas: expected an int >= 1"):
            tune_server_malloc(bad)

