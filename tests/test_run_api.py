"""The public run names: ``ql.Run`` trains on the Dask executor (DESIGN's contract), ``ql.LocalRun`` in a thread."""
from __future__ import annotations

import pytest

import qatlab as ql
from qatlab.executor import RemoteRun
from qatlab.runs import LocalRun


def test_ql_run_is_the_executor_run_and_local_run_the_thread():
    assert ql.Run is RemoteRun and ql.RemoteRun is RemoteRun and ql.LocalRun is LocalRun
    from qatlab import Run
    assert Run is RemoteRun


def test_ql_run_takes_designs_arguments_and_refuses_bad_ones():
    cfg = ql.ExperimentConfig()
    run = ql.Run(cfg, name="x", store=None, client=None, keep_alive=False)
    assert run.status == "created" and run.name == "x" and run.result() is None
    with pytest.raises(TypeError, match="store: expected a RunStore"):
        ql.Run(cfg, store="runs.sqlite")
    with pytest.raises(TypeError, match="keep_alive: expected a bool"):
        ql.Run(cfg, keep_alive="yes")
