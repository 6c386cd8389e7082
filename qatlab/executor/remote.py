"""RemoteRun: one experiment trained on a Dask worker, its rows, status and result kept here.

``start()`` checks the config (and its memory estimate where the data is readable here), creates
the run in the store, subscribes to the run's row topic and submits
:func:`~qatlab.executor.worker.run_on_worker` (``prepare()`` does all but the submission, ahead).
Rows arrive on the client's event loop (:meth:`RemoteRun._on_event`) into :attr:`RemoteRun.log`,
a MetricsLog that live views read with ``rows_since(cursor)``; a monitor thread writes them to the
store every :data:`FLUSH_SECONDS`, beats the store's heartbeat and, once the task ends, stores the
result. A worker that dies ends the run ``failed`` with "worker lost" (the task is never retried);
the other runs go on.

Status: ``created`` (queued until a worker starts it) -> ``running`` <-> ``paused`` -> one of
``finished``, ``stopped``, ``diverged``, ``failed``.
"""
from __future__ import annotations

import functools
import json
import logging
import os
import threading
import time
import weakref

from ..config import ExperimentConfig
from ..metrics import DEFAULT_CAPACITY, MetricsLog
from ..progress import RunProgress
from ..store.schema import StoreLockedError, when_unlocked
from . import cluster
from .worker import (WEIGHTS_SECONDS, WorkerLost, control_name, drop_received_rows, forget_topics, run_on_worker,
                     run_topics, topic, unpack_weights, weights_name)

log = logging.getLogger(__name__)

DONE = ("finished", "stopped", "diverged", "failed")
FLUSH_SECONDS = 0.5        # rows reach the store at least this often
HEARTBEAT_SECONDS = 10.0   # the store's heartbeat of a live run
WAKE_SECONDS = 0.1         # the monitor thread's longest sleep
ROWS_WAIT_SECONDS = 5.0    # after the result, how long rows still on their way are awaited
DROP_ROWS = 2000           # rows received between two drops of their batches from the scheduler
SHUTDOWN_JOIN_SECONDS = 5.0

_active: "weakref.WeakSet[RemoteRun]" = weakref.WeakSet()
_default_store = None
_store_lock = threading.Lock()


def active_runs() -> list["RemoteRun"]:
    """The RemoteRuns of this process that were started and have not ended."""
    return [run for run in list(_active) if not run.done]


def default_store():
    """The process's shared ``RunStore()`` (``$QATLAB_STORE`` or the per-user default file)."""
    global _default_store
    with _store_lock:
        if _default_store is None:
            from ..store import RunStore
            _default_store = RunStore()
        return _default_store


@functools.lru_cache(maxsize=16)
def _shipped_sizes(data_json: str) -> tuple:
    from ..config import DataConfig
    from ..data import load_dataset
    data = load_dataset(DataConfig.from_dict(json.loads(data_json)))
    return data.n_train, data.n_test, data.n_features, data.n_outputs, getattr(data, "image_shape", None)


def _dataset_sizes(cfg: ExperimentConfig) -> tuple | None:
    """(n_train, n_test, n_features, n_outputs, image_shape) of the run's data, or None when it
    cannot be read here (a path of the worker's disk, Fashion-MNIST not installed here): the worker
    checks the memory then, as the trainer does before it builds the model."""
    from ..data import load_dataset
    d = cfg.data
    if d.dataset not in ("file", "fashion_mnist"):
        return _shipped_sizes(json.dumps(d.to_dict(), sort_keys=True))
    if d.path and not os.path.exists(d.path):
        return None
    try:
        data = load_dataset(d)          # (a user file is read each time: it may have changed)
    except (OSError, ValueError):
        if d.dataset == "fashion_mnist":
            return None
        raise                           # a bad user file: refused before anything is created
    return data.n_train, data.n_test, data.n_features, data.n_outputs, getattr(data, "image_shape", None)


def check_resources(cfg: ExperimentConfig) -> None:
    """ValueError when the run would not fit the memory budget (or a cnn the images), checked here
    before anything is submitted; skipped when the data cannot be read here."""
    from ..resources import check_memory
    from ..train.build import check_cnn
    sizes = _dataset_sizes(cfg)
    if sizes is None:
        return
    n_train, n_test, n_features, n_outputs, image_shape = sizes
    if cfg.model.architecture == "cnn":
        check_cnn(cfg, n_features, image_shape)
    check_memory(cfg, n_train, n_test, n_features, n_outputs, image_shape=image_shape)


class RemoteRun(RunProgress):
    """One experiment trained on a Dask worker: ``ql.Run`` (``ql.LocalRun`` trains in a thread of this process).

    Args:
        config: an ExperimentConfig (validated and copied).
        name: label (default: the first 8 characters of the id).
        store: the RunStore rows and result go to (default: ``RunStore()``, shared by the process).
        client: a ``distributed.Client`` (default: :func:`~qatlab.executor.connect`).
        keep_alive: the run goes on when this process shuts the executor down (else it is stopped).
        owner: the store's owner of the run: None (this process), a page id, or a dict.
        sweep_id, point: the sweep the run belongs to and its point (kept in the store; see qatlab.sweep).
        keep_model: keep the trained model in ``result().model`` once it is stored (else only the
            store holds it: ``store.load_model(run.id)``; a server showing many runs keeps none).
        weights: the worker publishes weight snapshots (:meth:`weight_snapshot`, the Quantization
            tab's histograms); a sweep's runs, which no page shows that way, save that traffic.
        on_task_end: called with no arguments once the run's Dask task has ended, so its worker slot
            is free (before the result is stored); on a thread of Dask's client: it must not block.
        log_rows: most rows of history kept in this process (``log``, ``history()``; past it older
            rows are thinned 2:1, as a MetricsLog does); the store keeps every row.
    """

    def __init__(self, config: ExperimentConfig, name: str | None = None, store=None, client=None,
                 keep_alive: bool = False, owner=None, sweep_id: str | None = None, point: dict | None = None,
                 keep_model: bool = True, weights: bool = True, on_task_end=None,
                 log_rows: int = DEFAULT_CAPACITY):
        from ..runs import checked_name
        from ..store import RunStore
        if not isinstance(config, ExperimentConfig):
            raise TypeError(f"config: expected an ExperimentConfig, got {type(config).__name__}")
        if store is not None and not isinstance(store, RunStore):
            raise TypeError(f"store: expected a RunStore or None, got {type(store).__name__}")
        if client is not None and not hasattr(client, "submit"):
            raise TypeError(f"client: expected a distributed.Client or None, got {type(client).__name__}")
        if not isinstance(keep_alive, bool):
            raise TypeError(f"keep_alive: expected a bool, got {type(keep_alive).__name__}")
        if not isinstance(weights, bool):
            raise TypeError(f"weights: expected a bool, got {type(weights).__name__}")
        if on_task_end is not None and not callable(on_task_end):
            raise TypeError(f"on_task_end: expected a callable or None, got {type(on_task_end).__name__}")
        if isinstance(log_rows, bool) or not isinstance(log_rows, int) or log_rows < 16:
            raise ValueError(f"log_rows: expected an int >= 16, got {log_rows!r}")
        config.validate()
        self.config = config.copy()
        self.name = None if name is None else checked_name(name)
        self.keep_alive, self.owner, self.keep_model = keep_alive, owner, bool(keep_model)
        self.weights = weights
        self.sweep_id, self.point = sweep_id, point
        self._on_task_end = on_task_end
        self.id: str | None = None          # the store's run id, from start()
        self.log = MetricsLog(log_rows)
        self.log.meta["config"] = self.config.to_dict()    # (as LocalRun's; the worker adds sizes, total_steps)
        self.status, self.message = "created", ""
        self.worker: str | None = None      # the worker's address once it started the run
        self.worker_pid: int | None = None
        self.steps_done = self.total_steps = 0
        self.error: BaseException | None = None   # a failed run's exception (from the worker)
        self.started_at: float | None = None     # submitted
        self.finished_at: float | None = None
        self._store, self._client = store, client
        self._result = None
        self._future = None
        self._lock = threading.RLock()      # never held while calling into the Dask client (its loop takes it)
        self._ended, self._wake = threading.Event(), threading.Event()
        self._pending: list[dict] = []      # rows received, not yet in the store
        self._received = 0                  # rows received in order
        self._early: dict[int, dict] = {}   # batches ahead of a missing one, by first row
        self._ready = False                 # prepare() done: start() only submits
        self._start_claimed = self._submitting = self._stop_when_submitted = False
        self._on_worker = False
        self._status_changed = False
        self._weights, self._weights_packed, self._weights_read = None, None, -float("inf")
        self._weights_published = False     # the worker said its weights Variable exists

    # ------------------------------------------------------------------ control

    def prepare(self) -> "RemoteRun":
        """All that :meth:`start` does before it submits: check the config and its memory estimate
        (ValueError, nothing created), create the run in the store (status ``created``) and open its
        control and row topic. A sweep prepares its next run while every worker slot is busy;
        start() then only submits. RuntimeError when already prepared or started."""
        with self._lock:
            if self.id is not None:
                raise RuntimeError(f"{self.id}: already prepared or started")
            if self.status in DONE:
                return self
            self.id = "starting"
        try:
            self.config.validate()
            check_resources(self.config)
            store = self._store = self._store if self._store is not None else default_store()
            client = self._client = self._client if self._client is not None else cluster.connect()
            run_id = store.create_run(self.config, name=self.name, owner=self.owner, sweep_id=self.sweep_id,
                                      point=self.point)
        except BaseException:
            self.id = None
            raise
        from distributed import Variable
        with self._lock:
            self.id = run_id
            self.name = self.name or run_id[:8]
            stopped = self.status in DONE
        if not stopped:
            self._control = Variable(control_name(run_id), client=client)
            self._control.set("run")
            client.subscribe_topic(topic(run_id), _EventsTo(self))
            self._task_args = (self.config.to_dict(), run_id, self.weights)
            with self._lock:
                self._ready = True
                stopped = self.status in DONE
        if stopped:                         # stop() came while preparing: never submitted
            self._unprepare()
        return self

    def start(self) -> "RemoteRun":
        """Submit the run (preparing it first unless :meth:`prepare` did); returns self. ValueError
        (nothing created) when the config or its memory estimate is refused; RuntimeError when
        already started. A run stopped before it started stays stopped."""
        with self._lock:
            if self._start_claimed:
                raise RuntimeError(f"{self.id}: already started")
            self._start_claimed = True
            ready = self._ready
        if not ready:
            try:
                self.prepare()
            except BaseException:
                self._start_claimed = False
                raise
        with self._lock:
            if self.status in DONE or not self._ready:
                return self
            self._submitting = True
            self.started_at = time.time()
        run_id = self.id
        future = self._client.submit(run_on_worker, *self._task_args, key=f"qatlab-run-{run_id}",
                                     pure=False, retries=0)
        with self._lock:
            self._future, self._submitting = future, False
            stop_now = self._stop_when_submitted
        future.add_done_callback(self._on_task_done)
        _active.add(self)
        threading.Thread(target=self._monitor, name=f"qatlab-remote-{run_id[:8]}", daemon=True).start()
        if stop_now:
            self.stop()
        return self

    def stop(self) -> None:
        """Ask the worker to stop after the current step (status ``stopped``); a run still queued is
        cancelled, one never submitted is ``stopped`` at once."""
        with self._lock:
            if self.status in DONE:
                return
            if self._submitting:              # start() is submitting it: stopped right after
                self._stop_when_submitted = True
                return
            never_submitted, prepared, queued = self._future is None, self._ready, not self._on_worker
            if never_submitted:
                self.status, self.message = "stopped", "stopped before it started"
                self.finished_at = time.time()
                self._ended.set()
        if never_submitted:
            if prepared:
                self._unprepare()
        elif queued:        # one round trip; a worker that has just started it sees the task cancelled
            self._future.cancel()
        else:
            self._control.set("stop")

    def _unprepare(self) -> None:
        """A prepared run stopped before it was submitted: its stored status, no topic or control."""
        self._store.set_status(self.id, self.status, self.message)
        if self._ready:
            self._forget()

    def pause(self) -> None:
        """Hold the run between steps (a queued run waits at its first step)."""
        with self._lock:
            if self._future is None or self.status not in ("created", "running"):
                return
            self.status, self._status_changed = "paused", True
            self._pause_began()                   # the rate and ETA hold still while paused
        self._control.set("pause")
        self._wake.set()

    def resume(self) -> None:
        """Continue a paused run."""
        with self._lock:
            if self.status != "paused":
                return
            self.status, self._status_changed = ("running" if self._on_worker else "created"), True
            self._pause_ended()
        self._control.set("run")
        self._wake.set()

    def join(self, timeout: float | None = None) -> bool:
        """Wait until the run has ended and its result is stored; True if it has, or if it was never
        started nor prepared (a prepared run waits for its start, or a stop)."""
        if self.id is None and self.status not in DONE:
            return True
        return self._ended.wait(timeout)

    # ------------------------------------------------------------------ what arrived

    @property
    def task_ended(self) -> bool:
        """Whether the run no longer holds a worker slot (its task ended; the result may still be
        on its way to the store), or it never got one."""
        return self._future.done() if self._future is not None else True

    @property
    def done(self) -> bool:
        return self.status in DONE

    @property
    def submitted_at(self) -> float | None:
        """When start() submitted the run (time.time()); the same as ``started_at``."""
        return self.started_at

    def history(self) -> dict:
        """The rows received so far, ``{column: float64 array}`` (as ``MetricsLog.columns()``)."""
        return self.log.columns()

    def rows_since(self, cursor: int = 0) -> tuple[dict, int]:
        """Rows with ``row_id >= cursor`` and the next cursor (:meth:`MetricsLog.since`)."""
        return self.log.since(cursor)

    def result(self):
        """The RunResult once the run has ended (None before): history, final, model, status, message."""
        return self._result

    def release(self) -> None:
        """Drop an ended run's model and weight snapshot from this process (history, final metrics
        and the stored model stay: ``store.load_model(run.id)``); no-op while the run is active."""
        with self._lock:
            if self.status in DONE:
                self._weights = self._weights_packed = None
                if self._result is not None:
                    self._result.model = None

    def may_change(self, owner) -> bool:
        """Whether a page of ``owner`` may stop, pause, rename or delete this run: the runs it
        started always; any other run only once it has ended (it is read-only while it runs)."""
        return self.done or (self.owner is not None and self.owner == owner)

    def weight_snapshot(self) -> dict | None:
        """The latest ``{layer<i>: (latent W, quantized W)}`` the worker published (flat float32
        arrays of at most ``WEIGHTS_POINTS`` evenly strided weights), read from the scheduler at most
        every ``WEIGHTS_SECONDS`` while the run trains; the same object until a new one arrives."""
        now = time.monotonic()
        if self.done and self._weights is None and self._weights_packed:     # the last one, from the result
            self._weights = unpack_weights(self._weights_packed)
        if self.done or not self._weights_published or now - self._weights_read < WEIGHTS_SECONDS:
            return self._weights
        self._weights_read = now
        from distributed import Variable
        try:
            packed = Variable(weights_name(self.id), client=self._client).get(timeout=1)
        except Exception:          # the scheduler is gone: keep the last one
            return self._weights
        if packed != self._weights_packed:
            self._weights, self._weights_packed = unpack_weights(packed), packed
        return self._weights

    def __repr__(self) -> str:
        return f"RemoteRun({self.id!r}, status={self.status!r}, steps={self.steps_done}/{self.total_steps})"

    # ------------------------------------------------------------------ client side plumbing

    def _on_task_done(self, _future) -> None:
        self._wake.set()
        if self._on_task_end is not None:
            self._on_task_end()

    def _on_event(self, event) -> None:
        """A message from the worker (on the client's event loop: no I/O here)."""
        _, msg = event
        with self._lock:
            if msg.get("kind") == "start":
                self.worker, self.worker_pid, self._on_worker = msg["worker"], msg.get("pid"), True
                if self.status == "created":
                    self.status = "running"
                self._status_changed = True
            elif msg.get("kind") == "rows":
                self._take(msg)
            elif msg.get("kind") == "weights":
                self._weights_published = True
        self._wake.set()

    def _take(self, msg: dict) -> None:
        seq, rows = msg["seq"], msg["rows"]
        if "meta" in msg:
            self.log.meta.update(msg["meta"])
        if seq + len(rows) <= self._received and rows:
            return                                   # already have them
        if seq > self._received:
            self._early[seq] = msg                   # wait for the batch before it
            return
        rows = rows[self._received - seq:]
        for row in rows:
            self.log.append(row)
        self._pending.extend(rows)
        self._received += len(rows)
        if msg["done"] >= self.steps_done:           # (a replayed old batch must not move it back)
            self.steps_done, self.total_steps = msg["done"], msg["total"]
        if self._received in self._early:
            self._take(self._early.pop(self._received))

    def _flush(self) -> None:
        with self._lock:
            rows, self._pending = self._pending, []
        if rows:
            try:
                self._store.append_rows(self.id, rows)
            except BaseException:           # (locked: they go with the next flush)
                with self._lock:
                    self._pending[:0] = rows
                raise

    def _sync_status(self) -> None:
        with self._lock:
            if not self._status_changed or self.status in DONE:
                return
            self._status_changed = False
            try:
                if self._on_worker and self.worker is not None:
                    self._store.set_worker(self.id, self.worker)
                self._store.set_status(self.id, self.status)
            except BaseException:           # (locked: written on the next pass)
                self._status_changed = True
                raise

    def _monitor(self) -> None:
        last_flush = last_beat = time.monotonic()
        dropped = 0                         # rows whose batches the scheduler no longer holds
        try:
            while not self._future.done():
                self._wake.wait(WAKE_SECONDS)
                self._wake.clear()
                now = time.monotonic()
                if self._received - dropped >= DROP_ROWS:
                    dropped = self._received
                    self._drop_received(dropped)
                try:
                    self._sync_status()
                    if now - last_flush >= FLUSH_SECONDS:
                        last_flush = now
                        self._flush()
                    if now - last_beat >= HEARTBEAT_SECONDS:
                        last_beat = now
                        self._store.heartbeat(self.id)
                except StoreLockedError:    # another connection holds the store: the rows wait here
                    log.warning("qatlab: run %s: the run store is locked; its rows wait in memory", self.id)
            self._finish()
        except Exception as exc:            # the store failed (locked, disk full): the run ends here
            log.exception("qatlab: run %s: keeping its rows or result failed", self.id)
            from ..runs import failure_message
            with self._lock:
                self.status, self.message = "failed", failure_message(exc)
        finally:
            self._cleanup()
            self.finished_at = self.finished_at or time.time()
            self._ended.set()

    def _drop_received(self, received: int) -> None:
        try:
            self._client.run_on_scheduler(drop_received_rows, name=topic(self.id), received=received)
        except Exception:           # the scheduler is busy or gone: they are dropped at the end
            log.debug("qatlab: run %s: could not drop its received rows from the scheduler", self.id)

    def _finish(self) -> None:
        """The task ended: the status is known at once (the run has stopped training); then the rows
        still on their way, the store's copy, and the result."""
        from ..runs import failure_message
        from ..train.result import RunResult
        fut = self._future
        out = None
        if fut.cancelled():          # stop() of a queued run, or this client closed under a started one
            status = "stopped"
            message = "stopped: its Dask client closed" if self._on_worker else "stopped before it started"
        elif fut.status == "error":
            self.error = fut.exception()
            status, message = "failed", self._failure(self.error, failure_message)
        else:
            out = fut.result()
            status, message = out["status"], out["message"]
        with self._lock:
            self.status, self.message, self.finished_at = status, message, time.time()
        if out is not None:
            self._await_rows(out["rows"])
            self.log.meta.update(out["meta"])
            self.worker = self.worker or out["worker"]
            if out.get("weights") and out["weights"] != self._weights_packed:
                self._weights, self._weights_packed = None, out["weights"]
        elif self.error is not None:
            self._await_rows(None)
        result = RunResult(history=self.log.columns(), final=dict(out["final"]) if out else {},
                           model=out["model"] if out else None, status=status, message=message,
                           config=self.config.to_dict())
        when_unlocked(self._flush)
        when_unlocked(lambda: self._store.finish(self.id, result))   # (not under the lock: the client's loop takes it)
        if not self.keep_model:
            result.model = None
        self._result = result

    @staticmethod
    def _failure(exc: BaseException, failure_message) -> str:
        from distributed.scheduler import KilledWorker
        if isinstance(exc, KilledWorker):
            return "worker lost: the worker training the run died (runs are never retried)"
        if isinstance(exc, WorkerLost):
            return str(exc)
        return failure_message(exc)

    def _await_rows(self, expected: int | None) -> None:
        """Wait (briefly) for rows still on their way; then take any the scheduler still holds."""
        deadline = time.monotonic() + ROWS_WAIT_SECONDS
        while expected is not None and self._received < expected and time.monotonic() < deadline:
            self._wake.wait(WAKE_SECONDS)
            self._wake.clear()
        if expected is None or self._received < expected:
            try:
                for event in self._client.get_events(topic(self.id)):
                    self._on_event(event)
            except Exception:       # the scheduler is gone: keep what arrived
                log.warning("qatlab: run %s: could not fetch its missing rows from the scheduler", self.id)
        if expected is not None and self._received < expected:
            log.warning("qatlab: run %s: %d of %d rows arrived", self.id, self._received, expected)

    def _cleanup(self) -> None:
        """Forget the run on the scheduler: topic, its stored events, Variables, the task's result."""
        _active.discard(self)
        self._forget()

    def _forget(self) -> None:
        client, run_id = self._client, self.id
        if client.status != "running":     # a closed client's calls can wait for a reconnect forever
            return
        from distributed import Variable
        for step in (lambda: client.unsubscribe_topic(topic(run_id)),
                     self._control.delete,
                     *([lambda: Variable(weights_name(run_id), client=client).delete()]
                       if self._weights_published or self._weights_packed else []),
                     *([self._future.release] if self._future is not None else []),
                     lambda: client.run_on_scheduler(forget_topics, names=run_topics(run_id))):
            try:
                step()
            except Exception:       # a closed client or scheduler: nothing left to forget
                pass


class _EventsTo:
    """A run topic's handler that forwards events to the run while it exists: the Dask client keeps
    every handler it was given, even after ``unsubscribe_topic``, so it must not keep the run (its
    rows, model and Dask future) alive."""

    __slots__ = ("run",)

    def __init__(self, run: RemoteRun):
        self.run = weakref.ref(run)

    def __call__(self, event) -> None:
        run = self.run()
        if run is not None:
            run._on_event(event)


def _stop_active() -> None:
    """At shutdown: stop this process's runs that are not keep_alive and wait for their results."""
    runs = [run for run in active_runs() if not run.keep_alive]
    for run in runs:
        run.stop()
    deadline = time.monotonic() + SHUTDOWN_JOIN_SECONDS
    for run in runs:
        run.join(max(0.0, deadline - time.monotonic()))


cluster._before_shutdown.append(_stop_active)
