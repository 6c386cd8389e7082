"""``connect()``: the Dask client runs train on, and ``shutdown()``.

With no address (and no ``$QATLAB_SCHEDULER``) a process-wide :class:`~distributed.LocalCluster`
of one-thread worker processes on loopback, no dashboard (the engine never imports Bokeh), started
once and reused; with ``"tcp://host:8786"`` a client of that cluster (started with ``dask scheduler``
and ``dask worker``). Workers import qatlab and warm its Numba kernels (:class:`WarmWorker`). A
task is never retried (``allowed-failures`` 0 on the local scheduler): a rerun would duplicate rows.
"""
from __future__ import annotations

import atexit
import logging
import os
import threading

log = logging.getLogger(__name__)

SCHEDULER_ENV = "QATLAB_SCHEDULER"
#: The local cluster has at least this many workers, so the four runs of an STE comparison
#: train together (each a process of its own) even on a 2-core machine.
MIN_LOCAL_WORKERS = 4
#: Dask settings of the local cluster. No retry (a rerun would duplicate rows); a run waits on the
#: scheduler, not behind a busy worker (so there is nothing to steal). The rest slow down housekeeping
#: that only Dask's own dashboard needs (event-loop tick every 20 ms, psutil sampling every 0.5 s,
#: nanny memory check every 0.1 s), which otherwise keeps the process that started the cluster (its
#: scheduler and nannies run there: the dashboard's server) busy while nothing trains. Dask's debug
#: logs keep their last 10 entries, not 1000: the scheduler's log of what it sent a client kept a
#: run's last 1000 row batches in the server's memory (a client made by :func:`local_client`). Its
#: own logs keep their last 100 records, not 10,000 (a few per run, kept for good in a long-lived server).
#: Dask's statistical profiler is off: a callback on each worker's event loop that walked the running
#: task's stack 100 times a second, taking the GIL from the training thread, for Dask's own dashboard.
LOCAL_DASK_CONFIG = {
    "distributed.scheduler.allowed-failures": 0,
    "distributed.scheduler.worker-saturation": 1.0,
    "distributed.scheduler.work-stealing": False,
    "distributed.admin.tick.interval": "500ms",
    "distributed.admin.system-monitor.interval": "2s",
    "distributed.worker.memory.monitor-interval": "1s",
    "distributed.admin.low-level-log-length": 10,
    "distributed.admin.log-length": 100,
    "distributed.worker.profile.enabled": False,
}
#: Set process-wide where the local scheduler runs (Dask reads it each time a client leaves, not when
#: the scheduler starts): each run's two Variables leave as scheduler clients, and Dask keeps a task
#: per leaving client until this delay has passed, an hour by default (two pending tasks per run).
LOCAL_SCHEDULER_PROCESS_CONFIG = {"distributed.scheduler.events-cleanup-delay": "60s"}
CONNECT_TIMEOUT = "20s"
#: The local cluster's worker processes run at this lower CPU priority (nice) than the process that
#: started them, as batch work (:func:`lower_priority`): a machine that serves the dashboard and
#: trains answers its pages first.
LOCAL_NICE = 10

_lock = threading.RLock()
_clients: dict[str, object] = {}       # "local" or an address -> Client made by connect()
_cluster = None                        # the LocalCluster connect() started
_before_shutdown: list = []            # callables run first by shutdown() (RemoteRun stops its runs)
_atexit_registered = False

try:                                   # WorkerPlugin is only a base class: keep importing this module cheap
    from distributed import WorkerPlugin as _PluginBase
except ImportError:                    # (dask[distributed] is a dependency; this keeps the error at connect())
    _PluginBase = object


class WarmWorker(_PluginBase):
    """On each worker (and each one that joins or restarts later): lower its CPU priority by
    ``nice``, import qatlab and, with ``warm``, compile or load its Numba kernels on a background
    thread (:func:`qatlab.warmup.start`; about a second once Numba's on-disk cache is filled)."""

    name = "qatlab-warm"
    idempotent = True

    def __init__(self, warm: bool = True, nice: int = 0):
        self.warm, self.nice = bool(warm), int(nice)

    def setup(self, worker) -> None:
        import qatlab  # noqa: F401  (one BLAS thread, Numba's cache directory)
        if self.nice:
            lower_priority(self.nice)
        if self.warm:
            from qatlab import warmup
            warmup.start()


def lower_priority(nice: int) -> None:
    """Lower this thread's CPU priority by ``nice`` and, on Linux, put it in the batch scheduling
    class (CPU-bound work whose wake-ups do not preempt running tasks); threads it starts later (a
    worker's task threads) inherit both. Linux does not let an unprivileged process raise the nice
    value back."""
    if hasattr(os, "nice"):
        os.nice(nice)
    if hasattr(os, "SCHED_BATCH"):
        try:
            os.sched_setscheduler(0, os.SCHED_BATCH, os.sched_param(0))
        except OSError:                 # (a sandbox may refuse it; the nice value holds)
            pass


def _check_workers(n_workers) -> int:
    if n_workers is None:
        return max(os.cpu_count() or 1, MIN_LOCAL_WORKERS)
    if isinstance(n_workers, bool) or not isinstance(n_workers, int) or not 1 <= n_workers <= 256:
        raise ValueError(f"n_workers: expected an int in [1, 256] or None, got {n_workers!r}")
    return n_workers


def local_cluster(n_workers: int | None = None):
    """A new LocalCluster: ``n_workers`` (default: the cores, at least :data:`MIN_LOCAL_WORKERS`)
    worker processes of one thread on 127.0.0.1, no dashboard, with :data:`LOCAL_DASK_CONFIG` (no task
    retried, a task queued on the scheduler until a worker is free) and, in this process for good,
    :data:`LOCAL_SCHEDULER_PROCESS_CONFIG`. The caller closes it."""
    n = _check_workers(n_workers)
    import dask
    from distributed import LocalCluster
    dask.config.set(LOCAL_SCHEDULER_PROCESS_CONFIG)
    with dask.config.set(LOCAL_DASK_CONFIG):
        return LocalCluster(n_workers=n, threads_per_worker=1, processes=True, host="127.0.0.1",
                            dashboard_address=None,   # no Bokeh dashboard; its plain HTTP routes on a free loopback port
                            scheduler_kwargs={"allowed_failures": 0, "dashboard_address": "127.0.0.1:0"})


def local_client(cluster, **kwargs):
    """A ``distributed.Client`` of a :func:`local_cluster`, made under :data:`LOCAL_DASK_CONFIG`: the
    scheduler sets up its message stream to the client (and that stream's log) as it connects."""
    import dask
    from distributed import Client
    with dask.config.set(LOCAL_DASK_CONFIG):
        return Client(cluster, set_as_default=False, **kwargs)


def _check_address(address) -> str | None:
    if address is None:
        address = os.environ.get(SCHEDULER_ENV, "").strip() or None
        if address is None:
            return None
    if not isinstance(address, str) or "://" not in address:
        raise ValueError(f"address: expected a scheduler address such as 'tcp://host:8786' or None, got {address!r}")
    return address


def connect(address: str | None = None, n_workers: int | None = None, warm: bool = True):
    """The Dask client runs are submitted to (created once per address and reused).

    address: ``"tcp://host:8786"``; None means ``$QATLAB_SCHEDULER``, else the process-wide
    local cluster (:func:`local_cluster` with ``n_workers``, started on first use).
    warm: workers warm the Numba kernels when they start (:class:`WarmWorker`).
    """
    global _cluster, _atexit_registered
    address = _check_address(address)
    if address is not None and n_workers is not None:
        raise ValueError("n_workers: only for the local cluster; an existing cluster has its own workers")
    key = address or "local"
    with _lock:
        client = _clients.get(key)
        if client is not None and client.status == "running":
            return client
        from distributed import Client
        if address is None:
            if _cluster is None or _cluster.status.name != "running":
                _cluster = local_cluster(n_workers)
            client = local_client(_cluster)
        else:
            client = Client(address, timeout=CONNECT_TIMEOUT, set_as_default=False)
        # the local cluster's workers yield the CPU to the process serving pages (and its browser)
        client.register_plugin(WarmWorker(warm, nice=LOCAL_NICE if address is None else 0))
        _clients[key] = client
        if not _atexit_registered:
            atexit.register(shutdown)
            _atexit_registered = True
        return client


def shutdown() -> None:
    """Stop this process's runs that are not ``keep_alive``, then close every client connect()
    made and the local cluster it started. Called at exit; connect() starts afresh after it."""
    global _cluster
    for hook in list(_before_shutdown):
        try:
            hook()
        except Exception:          # closing must go on whatever a hook did
            log.exception("qatlab: executor shutdown hook failed")
    with _lock:
        clients, cluster = list(_clients.values()), _cluster
        _clients.clear()
        _cluster = None
    for client in clients:
        try:
            client.close(timeout=10)
        except Exception:
            log.exception("qatlab: closing a Dask client failed")
    if cluster is not None:
        try:
            cluster.close(timeout=20)
        except Exception:
            log.exception("qatlab: closing the local Dask cluster failed")
