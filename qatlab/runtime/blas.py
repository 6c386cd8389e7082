"""Keep BLAS single-threaded whatever was imported first.

``qatlab/__init__.py`` sets ``OPENBLAS_NUM_THREADS=1`` (several runs train at once
on small matrices, where a multi-threaded OpenBLAS is much slower; large products
are split across cores by :mod:`qatlab.runtime.parallel` instead). That only works if numpy's
OpenBLAS has not been loaded yet; a notebook's ``import numpy`` or Panel under ``panel serve``
load it first, and a run in the server then trained many times slower than headless. So
``import qatlab`` calls :func:`limit_blas_threads` when numpy is already loaded: with one BLAS
thread either way, a run gives the same numbers whether numpy or qatlab was imported first.
"""
from __future__ import annotations

import ctypes
import logging
import os

log = logging.getLogger(__name__)

_SYMBOLS = ("scipy_openblas_set_num_threads64_", "scipy_openblas_set_num_threads", "openblas_set_num_threads64_",
            "openblas_set_num_threads")


def limit_blas_threads(n: int | None = None) -> bool:
    """Limit loaded BLAS libraries to ``n`` threads (default: ``$OPENBLAS_NUM_THREADS`` or 1).

    Uses threadpoolctl when installed, else calls OpenBLAS's setter through ctypes.
    Returns True if a limit was applied.
    """
    if n is None:
        try:
            n = max(1, int(os.environ.get("OPENBLAS_NUM_THREADS", "1")))
        except ValueError:
            n = 1
    try:
        from threadpoolctl import threadpool_limits
        threadpool_limits(limits=n, user_api="blas")
        return True
    except ImportError:
        pass
    except Exception:  # pragma: no cover - best effort
        log.debug("threadpoolctl failed", exc_info=True)
    applied = False
    try:
        with open("/proc/self/maps") as fh:
            paths = {line.split()[-1] for line in fh if "openblas" in line.lower() and ".so" in line}
    except OSError:
        return False
    for path in paths:
        try:
            lib = ctypes.CDLL(path)
        except OSError:
            continue
        for sym in _SYMBOLS:
            fn = getattr(lib, sym, None)
            if fn is not None:
                fn(ctypes.c_int(n))
                applied = True
                break
    return applied
