"""qatlab.ui.heap: the server's malloc, one arena and fixed thresholds (checked in fresh processes)."""
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
    assert tune_server_malloc()
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


# A 4 MiB block freed, then a 1 MiB one: glibc maps the 1 MiB block on its own only while the mmap
# threshold stays where it was set (by default the free moves it up to 4 MiB, and the heap serves it).
THRESHOLD_SCRIPT = """
import ctypes, ctypes.util, re, sys
from qatlab.ui.heap import tune_server_malloc, malloc_info
if sys.argv[1] == "cap":
    assert tune_server_malloc()
libc = ctypes.CDLL(ctypes.util.find_library("c"))
libc.malloc.restype, libc.malloc.argtypes = ctypes.c_void_p, (ctypes.c_size_t,)
libc.free.argtypes = (ctypes.c_void_p,)
def mapped():
    return int(re.search(r'<total type="mmap" count="(\\d+)"', malloc_info()).group(1))
libc.free(libc.malloc(4 << 20))
before = mapped()
block = libc.malloc(1 << 20)
print(mapped() - before)
"""


@pytest.mark.skipif(malloc_arenas() is None, reason="glibc's malloc_info is not available")
def test_capped_process_keeps_its_mmap_threshold_after_a_large_block_is_freed():
    assert _printed(THRESHOLD_SCRIPT, "none") == 0     # the 1 MiB block came from the heap
    assert _printed(THRESHOLD_SCRIPT, "cap") == 1      # mapped on its own
