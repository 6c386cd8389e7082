"""Shared fixtures for the qatlab test suite."""
from __future__ import annotations

import gc
import os
import sys

import numpy as np
import pytest

# `tests/reference.py` (slow numpy references) is imported as `reference` by the test modules.
sys.path.insert(0, os.path.dirname(__file__))


def pytest_collection_finish(session):
    """Freeze what collection built (the imports of numba, panel, bokeh, torch, dask: ~400,000 objects)
    out of the garbage collector's sight, so its full passes during the tests, and the ``gc.collect()``
    of tests that check an object is let go, scan only what the tests made since (and exit skips
    them): ~5 s of the fast tests in one process. Objects made by a test are collected as before;
    ``gc.get_objects()`` no longer lists the frozen ones."""
    gc.collect()
    gc.freeze()


@pytest.fixture(autouse=True, scope="session")
def _temporary_default_store(tmp_path_factory):
    """No test writes to the user's run store: ``$QATLAB_STORE`` is a temporary file for the session
    (the default store of Dashboards and ``ql.Run``; tests that need their own pass one)."""
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("QATLAB_STORE", str(tmp_path_factory.mktemp("default-store") / "runs.sqlite"))
        yield


@pytest.fixture
def rng() -> np.random.Generator:
    """A fresh, seeded generator per test (deterministic data)."""
    return np.random.default_rng(20240601)


@pytest.fixture
def torch():
    """PyTorch, or skip the test cleanly when it is not installed."""
    return pytest.importorskip("torch")


@pytest.fixture
def force_split(monkeypatch):
    """``force_split(cores, **thresholds)`` makes qatlab.runtime.parallel split small work over ``cores``
    (thresholds such as ``MIN_ELEMENTS=1000`` or ``MIN_MACS=1`` patched for the test) and returns
    the list that then records ``(n_rows, parts)`` of every split_rows call."""
    from qatlab.runtime import parallel

    def patch(cores: int, **thresholds) -> list:
        calls = []
        split_rows = parallel.split_rows
        monkeypatch.setattr(parallel, "split_rows", lambda fn, n, p: calls.append((n, p)) or split_rows(fn, n, p))
        monkeypatch.setattr(parallel, "_cores", cores)
        for name, value in thresholds.items():
            monkeypatch.setattr(parallel, name, value)
        return calls
    return patch


def _local_client(n_workers: int):
    """A Dask client on a new local cluster of ``n_workers`` one-thread worker processes (kernels not
    warmed), closed with its cluster when the generator ends."""
    from qatlab.executor import WarmWorker, local_cluster
    from qatlab.executor.cluster import local_client
    cluster = local_cluster(n_workers)
    client = local_client(cluster, timeout="60s")
    client.register_plugin(WarmWorker(warm=False))
    yield client
    client.close(timeout=30)
    cluster.close(timeout=30)


@pytest.fixture(scope="module")
def client2():
    """A Dask client on a new local cluster of 2 one-thread worker processes."""
    yield from _local_client(2)


@pytest.fixture(scope="module")
def client4():
    """A Dask client on a new local cluster of 4 one-thread worker processes."""
    yield from _local_client(4)


@pytest.fixture(scope="module")
def client6():
    """A Dask client on a new local cluster of 6 one-thread worker processes (runs that hold their
    worker while paused can all train at once)."""
    yield from _local_client(6)
