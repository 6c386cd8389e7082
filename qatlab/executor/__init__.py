"""The executor: runs train on Dask workers (a local cluster by default), their rows stream back.

:func:`connect` gives the Dask client (:mod:`.cluster`); :class:`RemoteRun` submits one run and
keeps its rows, status and result on the client side (:mod:`.remote`); :func:`run_on_worker` is the
task a worker runs (:mod:`.worker`).
"""
from .cluster import MIN_LOCAL_WORKERS, SCHEDULER_ENV, WarmWorker, connect, local_cluster, shutdown
from .remote import RemoteRun, active_runs
from .worker import WorkerLost, run_on_worker

__all__ = ["MIN_LOCAL_WORKERS", "SCHEDULER_ENV", "RemoteRun", "WarmWorker", "WorkerLost", "active_runs", "connect",
           "local_cluster", "run_on_worker", "shutdown"]
