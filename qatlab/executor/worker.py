"""The task a Dask worker runs: one experiment, its rows sent back as it trains.

:func:`run_on_worker` trains with :func:`qatlab.train.trainer.train_experiment`, the in-process
trainer, so a run's history is the one ``ql.run_experiment`` gives. Rows leave in batches through
``Worker.log_event`` on the run's topic (:func:`topic`), each batch numbered by its first row, so
the client orders them and notices a gap; nothing goes through a shared disk. The client's
requests (``"run"``, ``"pause"``, ``"stop"``) sit in a ``distributed.Variable`` (:func:`control_name`)
that a thread polls every :data:`POLL_SECONDS`; the trainer's ``report`` callback reads only a
local flag, so a step never waits for the scheduler.
"""
from __future__ import annotations

import math
import os
import socket
import threading
import time

import numpy as np

from ..data import check_data_here
from ..metrics import MetricsLog

#: A batch of rows leaves once per slot of this many seconds of wall-clock time (and at the end): a
#: live curve can move about 5.5 times a second (the page's goal is 5 updates/s; each update costs
#: the browser a repaint on the cores the runs train on), and rows are seen within ~0.3 s. Slots of
#: the clock, not of the run: runs training at once send together, so a page showing them draws
#: one update where unaligned batches made it draw one per run.
SEND_SECONDS = 0.18
#: The control Variable is read this often.
POLL_SECONDS = 0.1
#: The latest weights (for the Quantization tab's histograms) are published at most this often, as at
#: most this many evenly strided weights per layer: a Variable holds only the latest, so the
#: scheduler's memory does not grow with the run.
WEIGHTS_SECONDS = 1.0
WEIGHTS_POINTS = 16_384
CONTROL_STATES = ("run", "pause", "stop")


class WorkerLost(RuntimeError):
    """The run was started again after the worker that trained it died (never retried)."""


def topic(run_id: str) -> str:
    return f"qatlab-rows-{run_id}"


def control_name(run_id: str) -> str:
    return f"qatlab-control-{run_id}"


def weights_name(run_id: str) -> str:
    return f"qatlab-weights-{run_id}"


def pack_weights(weights: dict) -> dict:
    """``{layer: (latent W, quantized W)}`` as ``{layer: [latent bytes, quantized bytes]}`` of at most
    :data:`WEIGHTS_POINTS` float32 values each (the same evenly strided positions in both)."""
    out = {}
    for name, (latent, quantized) in weights.items():
        latent, quantized = np.asarray(latent).ravel(), np.asarray(quantized).ravel()
        stride = max(1, -(-latent.size // WEIGHTS_POINTS))
        out[name] = [np.ascontiguousarray(latent[::stride], np.float32).tobytes(),
                     np.ascontiguousarray(quantized[::stride], np.float32).tobytes()]
    return out


def unpack_weights(packed: dict) -> dict:
    """The inverse of :func:`pack_weights`: ``{layer: (latent, quantized)}`` float32 arrays."""
    return {name: (np.frombuffer(a, np.float32), np.frombuffer(b, np.float32)) for name, (a, b) in packed.items()}


class _RowLog(MetricsLog):
    """The trainer's MetricsLog, also queueing each row as plain Python numbers (msgpack-ready)."""

    def __init__(self):
        super().__init__()
        self.pending: list[dict] = []

    def append(self, row: dict) -> None:
        super().append(row)
        self.pending.append({k: (v.item() if isinstance(v, np.generic) else v) for k, v in row.items()})


#: MetricsLog.meta entries the trainer sets once it has built the model, sent with the next batch.
LIVE_META = ("n_layers", "sizes", "total_steps", "phase_history")


class _Sender:
    """Sends the queued rows with the progress as one event (and :data:`LIVE_META` once it is
    known); ``sent`` counts the rows sent."""

    def __init__(self, worker, run_topic: str):
        self.worker, self.topic = worker, run_topic
        self.sent, self.slot = 0, None
        self.done = self.total = 0
        self.meta_sent = False

    def event(self, msg: dict) -> None:
        self.worker.log_event(self.topic, msg)

    def send(self, log: _RowLog, force: bool = False) -> None:
        slot = math.floor(time.time() / SEND_SECONDS)
        if not force and slot == self.slot:
            return
        rows, log.pending = log.pending, []
        msg = {"kind": "rows", "seq": self.sent, "rows": rows, "done": self.done, "total": self.total,
               "sent": time.time()}
        if not self.meta_sent and "total_steps" in log.meta:
            msg["meta"] = {k: log.meta[k] for k in LIVE_META if k in log.meta}
            self.meta_sent = True
        self.event(msg)
        self.sent += len(rows)
        self.slot = slot


class _Control:
    """The client's latest request for the run, polled from its Variable on a daemon thread;
    ``"stop"`` too once ``abandoned()`` says the task was released (its client is gone), so a
    paused or long run never holds the worker for nobody.

    The thread first calls ``first()`` (the run's first-start check and its "start" event) and
    reads the request once, while the worker builds the model; :meth:`proceed` waits for that and
    raises what ``first()`` raised."""

    def __init__(self, variable, first=lambda: None, abandoned=lambda: False):
        self.variable, self.first, self.abandoned = variable, first, abandoned
        self.state = "run"
        self.error: BaseException | None = None
        self._ready, self._closed = threading.Event(), threading.Event()
        self._thread = threading.Thread(target=self._poll, name="qatlab-control", daemon=True)
        self._thread.start()

    def _read(self, timeout: float) -> str:
        state = self.variable.get(timeout=timeout)
        return state if state in CONTROL_STATES else "run"

    def _poll(self) -> None:
        try:
            self.first()
            self.state = self._read(timeout=30)
        except BaseException as exc:        # (proceed() raises it in the task's thread)
            self.error = exc
            return
        finally:
            self._ready.set()
        while not self._closed.wait(POLL_SECONDS):
            if self.abandoned():
                self.state = "stop"
                return
            try:
                self.state = self._read(timeout=5)
            except Exception:       # scheduler briefly unreachable: keep the last request
                pass

    def proceed(self) -> bool:
        """Blocks while paused; False once a stop was requested."""
        self._ready.wait()
        if self.error is not None:
            raise self.error
        while self.state == "pause" and not self._closed.is_set():
            time.sleep(POLL_SECONDS / 2)
        return self.state != "stop"

    def close(self) -> None:
        self._closed.set()


def _check_first_start(client, run_id: str) -> None:
    """WorkerLost if the run was started before (its topic holds a "start" event: the worker that
    trained it died and the scheduler gave the task to another one)."""
    for _, msg in client.get_events(topic(run_id)):
        if isinstance(msg, dict) and msg.get("kind") == "start":
            raise WorkerLost(f"worker lost: the run started on {msg.get('worker')}, which died; it is not run twice")


def run_on_worker(config: dict, run_id: str, weights: bool = True) -> dict:
    """Train ``config`` (an ExperimentConfig dict) as run ``run_id``, publishing weight snapshots
    with ``weights``; returns its end:
    ``{"status", "message", "final", "rows" (rows sent), "model", "meta", "worker", "weights" (the
    last weights published, :func:`pack_weights`, or None)}``."""
    from distributed import Variable, get_client, get_worker

    from ..config import ExperimentConfig
    from ..train.trainer import train_experiment
    worker, client = get_worker(), get_client()
    log, sender = _RowLog(), _Sender(worker, topic(run_id))
    key = worker.get_current_task()

    def first() -> None:           # (on the control thread, while this one builds the run)
        _check_first_start(client, run_id)
        sender.event({"kind": "start", "worker": worker.address, "pid": os.getpid(), "host": socket.gethostname()})

    def abandoned() -> bool:       # the scheduler released the task: its client closed or died
        task = worker.state.tasks.get(key)
        return task is None or task.state == "cancelled"

    control = _Control(Variable(control_name(run_id), client=client), first, abandoned)
    try:
        cfg = ExperimentConfig.from_dict(config)
        cfg.validate()
        check_data_here(cfg.data, f"worker {worker.address}")
    except BaseException:
        control.close()
        raise
    weights_var, last_weights = Variable(weights_name(run_id), client=client), [-math.inf, None]   # (when, packed)

    def report(done: int, total: int) -> bool:
        go_on = control.proceed()          # (after the "start" event: rows follow it)
        sender.done, sender.total = done, total
        sender.send(log)
        return go_on

    def publish_weights(snapshot: dict) -> None:
        now = time.monotonic()
        if now - last_weights[0] >= WEIGHTS_SECONDS:
            announce = last_weights[1] is None
            last_weights[:] = now, pack_weights(snapshot)
            weights_var.set(last_weights[1])
            if announce:            # the client reads the Variable only once it exists
                sender.event({"kind": "weights"})

    try:
        result = train_experiment(cfg, log, report=report, publish_weights=publish_weights if weights else None)
    finally:
        control.close()
        sender.send(log, force=True)      # the last rows (also those before an exception)
    return {"status": result.status, "message": result.message, "final": result.final, "rows": sender.sent,
            "model": result.model, "meta": log.meta, "worker": worker.address, "weights": last_weights[1]}


def drop_received_rows(dask_scheduler, name: str, received: int) -> None:
    """Drop from the scheduler's memory the row batches of topic ``name`` that hold only rows below
    ``received`` (the client has them), keeping the other events: the first-start check reads the
    "start" one. Dask keeps up to 1000 events per topic, so a run logging every step would
    otherwise hold all its rows there (run with ``Client.run_on_scheduler``; private, as in
    :func:`forget_topics`)."""
    held = dask_scheduler._broker._topics.get(name)
    if held is None:
        return
    kept = [event for event in held.events if not _rows_below(event[1], received)]
    held.events.clear()
    held.events.extend(kept)


def _rows_below(msg, received: int) -> bool:
    return isinstance(msg, dict) and msg.get("kind") == "rows" and msg["seq"] + len(msg["rows"]) <= received


def run_topics(run_id: str) -> list[str]:
    """Every scheduler topic a run makes: its rows, and the one Dask logs each of its Variables'
    removal on (a Variable is a client to the scheduler)."""
    return [topic(run_id), f"variable-{control_name(run_id)}", f"variable-{weights_name(run_id)}"]


def forget_topics(dask_scheduler, names: list[str]) -> None:
    """Drop a finished run's events, and each topic once nobody subscribes, from the scheduler's memory
    (run with ``Client.run_on_scheduler``; Dask has no public call for it, so the client treats a
    failure here as harmless)."""
    broker = dask_scheduler._broker
    for name in names:
        broker.truncate(name)
        held = broker._topics.get(name)
        if held is not None and not held.subscribers:
            del broker._topics[name]
