"""Big array work split across the cores: slices of one operation run in parallel threads.

The Numba kernels are ``nogil`` and NumPy's BLAS releases the GIL, so slices of one large
element-wise kernel (ranges of elements) or matrix product (row or column blocks) run at the
same time on a shared thread pool; each slice writes its own part of ``out``, so nothing is
reduced across threads (but a sum over slices, :func:`sum_slices`). Only work above a size
threshold is split: every layer of the small models trained here stays on the calling
thread, and several runs training big layers at once take turns at the pool rather than queue
on it. Sums and matrix products are cut into a number of blocks that depends only on the shapes
(:func:`fixed_blocks`), spread over however many cores there are, so a run gives the same bits
on a machine (or Dask worker) with any core count.

Products split over the operand stored transposed (a column block of ``W.T`` is a contiguous
block of rows of ``W``), which is the faster way (``python -m qatlab.bench fakequant`` / ``train``).
"""
from __future__ import annotations

import os
import threading
from concurrent.futures import ThreadPoolExecutor

import numpy as np

from . import fpmode

#: An element-wise kernel over at least this many elements is split (below it the thread hand-off
#: costs more than the split saves).
MIN_ELEMENTS = 1 << 18
#: A matrix product of at least this many multiply-adds (rows x inner x columns) is split.
MIN_MACS = 1 << 24
MAX_PARTS = 8

_cores: int | None = None
_pool: ThreadPoolExecutor | None = None
_splitting = threading.Lock()


def cores() -> int:
    """Usable cores, at most MAX_PARTS (``os.cpu_count`` reads /sys, so it is read once)."""
    global _cores
    if _cores is None:
        _cores = max(1, min(os.cpu_count() or 1, MAX_PARTS))
    return _cores


def split_rows(fn, n_rows: int, parts: int) -> None:
    """Call ``fn(lo, hi)`` for ``parts`` contiguous ranges covering ``range(n_rows)``, the first
    on the calling thread and the rest on the pool; returns when all are done (re-raises errors).

    One split runs at a time: while another thread's split holds the pool (several runs training
    big layers at once), the caller runs the same slices one after the other itself instead of
    queueing behind it -- the same calls, so the same result either way."""
    global _pool
    parts = max(1, parts)
    bounds = [n_rows * k // parts for k in range(parts + 1)]
    if parts < 2 or not _splitting.acquire(blocking=False):   # another thread's split holds the pool
        for lo, hi in zip(bounds, bounds[1:]):
            fn(lo, hi)
        return
    try:
        if _pool is None:
            _pool = ThreadPoolExecutor(max(1, cores() - 1), thread_name_prefix="qatlab-split")
        mode = fpmode.get_mode()      # the slices run in the caller's floating-point mode
        futures = [_pool.submit(_in_mode, mode, fn, lo, hi) for lo, hi in zip(bounds[1:-1], bounds[2:])]
        fn(bounds[0], bounds[1])
        for f in futures:
            f.result()
    finally:
        _splitting.release()


def _in_mode(mode, fn, lo: int, hi: int) -> None:
    """``fn(lo, hi)`` on a pool thread with the MXCSR ``mode`` of the thread that split the work."""
    before = fpmode.get_mode()
    fpmode.set_mode(mode)
    try:
        fn(lo, hi)
    finally:
        fpmode.set_mode(before)


def elementwise(kernel, arrays, scalars, out=None) -> None:
    """``kernel(*arrays, *scalars, out)`` (or ``kernel(*arrays, *scalars)`` when ``out`` is None,
    for kernels that update ``arrays`` in place) over flat (n,) arrays of one length, split into
    slices when n >= MIN_ELEMENTS. Bit-identical to one call (every element is independent)."""
    tail = () if out is None else (out,)
    n = (tail or arrays)[0].shape[0]
    parts = cores() if n >= MIN_ELEMENTS else 1
    if parts < 2:
        kernel(*arrays, *scalars, *tail)
        return
    split_rows(lambda lo, hi: kernel(*(a[lo:hi] for a in arrays), *scalars, *(t[lo:hi] for t in tail)), n, parts)


def fixed_blocks(fn, n: int, blocks: int) -> None:
    """Call ``fn(lo, hi)`` for ``blocks`` contiguous ranges covering ``range(n)`` -- ranges that
    depend only on ``n`` and ``blocks`` -- spread over the cores (each core takes a run of blocks)."""
    bounds = [n * k // blocks for k in range(blocks + 1)]

    def some(first: int, last: int) -> None:
        for k in range(first, last):
            fn(bounds[k], bounds[k + 1])
    split_rows(some, blocks, min(cores(), blocks))


def sum_slices(kernel, x: np.ndarray) -> float:
    """``kernel(x)`` for a kernel returning a float64 sum over x (n,): when n >= MIN_ELEMENTS, the
    sum of ``kernel`` over MAX_PARTS slices of x computed on the cores, added in slice order. The
    slices depend only on n, so the result does too, whatever the core count; it can differ from
    one call in the last bits of the float64 sum."""
    n = x.shape[0]
    if n < MIN_ELEMENTS:
        return kernel(x)
    partial = {}
    fixed_blocks(lambda lo, hi: partial.__setitem__(lo, kernel(x[lo:hi])), n, MAX_PARTS)
    return sum(partial[lo] for lo in sorted(partial))


def dot(a: np.ndarray, b: np.ndarray, out: np.ndarray) -> np.ndarray:
    """``out = a @ b`` for a (M, K), b (K, N), out (M, N) float32, out C-contiguous; when
    M*K*N >= MIN_MACS, computed in up to MAX_PARTS blocks of at least 32 columns of ``b``/``out``
    when ``b`` is a transposed weight (F-contiguous: the forward ``x @ W.T``), else of at least 32
    rows of ``a``/``out`` (the gradient products ``dY.T @ x`` and ``dY @ W``), spread over the cores;
    ``np.matmul`` writes each block of out in place. The blocks depend only on the shapes, so the
    result does too; it can differ from one ``np.dot`` in the last bits (BLAS blocks differently)."""
    m, n = a.shape[0], b.shape[1]
    if m * a.shape[1] * n < MIN_MACS:
        return np.dot(a, b, out=out)
    by_columns = b.flags.f_contiguous and not b.flags.c_contiguous
    blocks = min(MAX_PARTS, (n if by_columns else m) // 32)
    if blocks < 2:
        return np.dot(a, b, out=out)
    if by_columns:
        fixed_blocks(lambda lo, hi: np.matmul(a, b[:, lo:hi], out=out[:, lo:hi]), n, blocks)
    else:
        fixed_blocks(lambda lo, hi: np.matmul(a[lo:hi], b, out=out[lo:hi]), m, blocks)
    return out
