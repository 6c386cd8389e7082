"""Per-thread floating-point mode: flush subnormal numbers to zero while training (x86 MXCSR).

Subnormal floats (magnitude below 1.18e-38 for float32) take a microcode slow path on x86: an
operation on them costs tens to hundreds of cycles instead of one. Training produces them where
values decay towards zero (gradients through saturated softmax outputs, dead units), and then
the matrix products on them, and the whole run, slow down severalfold.

:func:`flush_subnormals` sets the SSE control register's FTZ (results that would be subnormal
become 0) and DAZ (subnormal inputs read as 0) bits for the calling thread only, as
``torch.set_flush_denormal(True)`` does; the training thread of every run turns it on, and
:mod:`qatlab.runtime.parallel` runs a split's slices in the caller's mode, so a split and an unsplit
computation give the same bits. Values that small change a float32 training step by less than
one part in 1e30. Other threads (a notebook's, the tests') keep IEEE semantics.

On other architectures these functions do nothing and report ``None``.
"""
from __future__ import annotations

import contextlib
import platform

from llvmlite import ir
from numba import njit, types
from numba.core import cgutils
from numba.extending import intrinsic

FTZ = 0x8000   # MXCSR bit 15: flush to zero
DAZ = 0x0040   # MXCSR bit 6: denormals are zero
X86 = platform.machine().lower() in ("x86_64", "amd64", "i386", "i686")


def _mxcsr_op(builder, name: str, slot) -> None:
    """Call the LLVM intrinsic ``llvm.x86.sse.<name>`` (stmxcsr / ldmxcsr) on the i32 ``slot``."""
    i8p = ir.IntType(8).as_pointer()
    fn = cgutils.get_or_insert_function(builder.module, ir.FunctionType(ir.VoidType(), [i8p]), f"llvm.x86.sse.{name}")
    builder.call(fn, [builder.bitcast(slot, i8p)])


@intrinsic
def _read_mxcsr(typingctx):
    def codegen(context, builder, signature, args):
        slot = cgutils.alloca_once(builder, ir.IntType(32))
        _mxcsr_op(builder, "stmxcsr", slot)
        return builder.load(slot)
    return types.uint32(), codegen


@intrinsic
def _write_mxcsr(typingctx, value):
    def codegen(context, builder, signature, args):
        slot = cgutils.alloca_once(builder, ir.IntType(32))
        builder.store(args[0], slot)
        _mxcsr_op(builder, "ldmxcsr", slot)
        return context.get_dummy_value()
    return types.void(types.uint32), codegen


@njit(cache=True, nogil=True)
def _get():
    return _read_mxcsr()


@njit(cache=True, nogil=True)
def _set(value):
    _write_mxcsr(value)


def get_mode() -> int | None:
    """The calling thread's MXCSR register (an int), or None off x86."""
    return int(_get()) if X86 else None


def set_mode(mode: int | None) -> None:
    """Restore a value from :func:`get_mode` in the calling thread (None: nothing)."""
    if X86 and mode is not None:
        _set(mode & 0xFFFF)


def flush_subnormals(on: bool = True) -> None:
    """Turn FTZ and DAZ on (or off) for the calling thread."""
    mode = get_mode()
    if mode is not None:
        set_mode(mode | FTZ | DAZ if on else mode & ~(FTZ | DAZ))


@contextlib.contextmanager
def subnormals_flushed():
    """``with subnormals_flushed(): ...`` runs the block with FTZ and DAZ on in this thread,
    then restores the previous mode."""
    before = get_mode()
    flush_subnormals(True)
    try:
        yield
    finally:
        set_mode(before)
