"""A monotonic clock readable inside Numba kernels: :func:`monotonic_ns`.

A kernel that makes steps of two kinds in one call (phase training's predicted and backward
steps, :func:`qatlab.kernels.fused.predict_block`) times each kind itself. It calls the C
library's ``clock_gettime(CLOCK_MONOTONIC)``, the clock ``time.monotonic_ns`` and
``time.perf_counter`` read on Linux and macOS, directly from the compiled code: no GIL, ~20 ns a
read, and the symbol is resolved again when a cached kernel is loaded (``cache=True`` works).
``AVAILABLE`` is False on other platforms (Windows has no ``clock_gettime``): callers then make
the two kinds of step in separate calls and time them from Python.
"""
from __future__ import annotations

import sys

from llvmlite import ir
from numba import njit, types
from numba.core import cgutils
from numba.extending import intrinsic

_CLOCK_MONOTONIC = {"linux": 1, "darwin": 6}.get(sys.platform)
AVAILABLE = _CLOCK_MONOTONIC is not None


@intrinsic
def _clock_gettime_ns(typingctx):
    """int64 nanoseconds of CLOCK_MONOTONIC (see module doc)."""
    def codegen(context, builder, signature, args):
        i64 = ir.IntType(64)
        timespec = ir.LiteralStructType([i64, i64])       # tv_sec, tv_nsec (64-bit platforms)
        fnty = ir.FunctionType(ir.IntType(32), [ir.IntType(32), timespec.as_pointer()])
        fn = cgutils.get_or_insert_function(builder.module, fnty, "clock_gettime")
        ts = cgutils.alloca_once(builder, timespec)
        builder.call(fn, [ir.Constant(ir.IntType(32), _CLOCK_MONOTONIC), ts])
        sec = builder.load(cgutils.gep_inbounds(builder, ts, 0, 0))
        nsec = builder.load(cgutils.gep_inbounds(builder, ts, 0, 1))
        return builder.add(builder.mul(sec, ir.Constant(i64, 1_000_000_000)), nsec)
    return types.int64(), codegen


if AVAILABLE:
    @njit(cache=True, nogil=True)
    def monotonic_ns():
        """Nanoseconds of the monotonic clock (``time.monotonic_ns``'s), inside or outside a kernel."""
        return _clock_gettime_ns()
else:   # pragma: no cover - not reached on Linux/macOS
    @njit(cache=True, nogil=True)
    def monotonic_ns():
        """0: no clock readable from compiled code on this platform (``AVAILABLE`` is False)."""
        return 0
