"""Runs: an experiment training in a background thread, the process-wide registry, compare_ste().

A :class:`LocalRun` snapshots its config, trains in a daemon thread and writes rows
into its :class:`~qatlab.metrics.MetricsLog`; views read the log and call only
``start/stop/pause/resume``. Kernels release the GIL, so several runs train at
once. Status moves ``created -> running (<-> paused) -> finished | stopped |
diverged | failed``; a diverging loss or an exception never escapes the thread: ``diverged``
is a numeric blow-up, ``failed`` a bug, whose message is one line (``TypeName: why``) while the
traceback goes to the ``qatlab.runs`` logger.

Memory: an ended run keeps its model and last weight snapshot until :meth:`LocalRun.release` (or
:func:`release_ended`, called as each registered run ends, keeping the :data:`KEEP_MODELS`
latest); its log, final metrics and config stay. :func:`delete_run` removes a run from the
registry. Who may change a run from a page: :meth:`LocalRun.may_change`.
"""
from __future__ import annotations

import itertools
import logging
import threading
import time

import numpy as np

from .config import ExperimentConfig
from .metrics import MetricsLog
from .progress import RunProgress
from .quant.ste import SteKind
from .train.result import RunResult

log = logging.getLogger(__name__)

ACTIVE = ("running", "paused")
DONE = ("finished", "stopped", "diverged", "failed")
KEEP_MODELS = 8        # ended registered runs whose model stays in memory (the latest ones)
NAME_LIMIT = 80        # characters of a run name
MESSAGE_LIMIT = 240    # characters of a failed run's message


def failure_message(exc: BaseException, limit: int = MESSAGE_LIMIT) -> str:
    """One readable line for a failed run: ``TypeName: message`` (whitespace folded), at most ``limit`` chars."""
    text = " ".join(str(exc).split())
    line = f"{type(exc).__name__}: {text}" if text else type(exc).__name__
    return line if len(line) <= limit else line[: limit - 1] + "\u2026"


def checked_name(name) -> str:
    """A valid run name (stripped): 1..NAME_LIMIT printable characters, no ``<`` or ``>`` (pages
    show names to every other page, some as Markdown); else TypeError/ValueError."""
    if not isinstance(name, str):
        raise TypeError(f"name: expected a str, got {type(name).__name__}")
    text = name.strip()
    if not text or len(text) > NAME_LIMIT or not text.isprintable() or "<" in text or ">" in text:
        raise ValueError(f"name: expected 1 to {NAME_LIMIT} printable characters other than < and >, "
                         f"got {name!r:.100}")
    return text


class RunControl:
    """Stop/pause flags shared by a LocalRun and its training loop."""

    def __init__(self):
        self.stop_requested = threading.Event()
        self._running = threading.Event()
        self._running.set()

    def checkpoint(self) -> bool:
        """Called by the loop between steps: blocks while paused; False once a stop was requested."""
        while not self._running.wait(0.05):
            if self.stop_requested.is_set():
                return False
        return not self.stop_requested.is_set()


_ids = itertools.count(1)
_registry: list["LocalRun"] = []
_registry_lock = threading.Lock()


def all_runs() -> list["LocalRun"]:
    """Every LocalRun created in this process, oldest first."""
    with _registry_lock:
        return list(_registry)


def get_run(run_id: str) -> "LocalRun":
    """The LocalRun with this id; ``KeyError`` if none."""
    for run in all_runs():
        if run.id == run_id:
            return run
    raise KeyError(f"run_id: no run {run_id!r}")


def delete_run(run) -> "LocalRun":
    """Remove ``run`` (a LocalRun or a run id) from the registry and return it; ``KeyError`` if not listed.

    An active run is stopped first; its model is released once it has ended (at once if it has)."""
    if not isinstance(run, (LocalRun, str)):
        raise TypeError(f"run: expected a LocalRun or a run id, got {type(run).__name__}")
    with _registry_lock:
        found = next((r for r in _registry if r is run or r.id == run), None)
        if found is None:
            raise KeyError(f"run: no run {run!r} in the registry")
        _registry.remove(found)
        found._registered = False
    found.stop()
    with found._status_lock:
        found._release_when_done = True
        ended = found.done
    if ended:
        found.release()
    return found


def release_ended(keep: int = KEEP_MODELS) -> list["LocalRun"]:
    """Release the models of the registry's ended runs except the ``keep`` that ended last; returns
    the runs released now."""
    if isinstance(keep, bool) or not isinstance(keep, int) or keep < 0:
        raise ValueError(f"keep: expected an int >= 0, got {keep!r}")
    held = sorted((r for r in all_runs() if r.done and not r.released), key=lambda r: r.finished_at or 0.0)
    old = held[: max(len(held) - keep, 0)]
    for run in old:
        run.release()
    return old


class LocalRun(RunProgress):
    """One experiment in a background thread.

    Args:
        config: an ExperimentConfig; it is validated and copied, later edits do not leak in.
        name: label shown in tables and legends (default: the run id).
        owner: who started it (a session id); ``keep_alive`` says whether it outlives the owner.
    """

    def __init__(self, config: ExperimentConfig, name: str | None = None, owner: str | None = None,
                 keep_alive: bool = False, log_capacity: int | None = None, register: bool = True):
        if not isinstance(config, ExperimentConfig):
            raise TypeError(f"config: expected an ExperimentConfig, got {type(config).__name__}")
        config.validate()
        self.config = config.copy()
        self.id = f"run-{next(_ids):04d}"
        self._name = self.id if name is None else checked_name(name)
        self.owner = owner
        self.keep_alive = keep_alive
        self.log = MetricsLog() if log_capacity is None else MetricsLog(log_capacity)
        self.log.meta["config"] = self.config.to_dict()
        self.status = "created"
        self.message = ""
        self.result: RunResult | None = None
        self.created_at = time.time()
        self.started_at: float | None = None
        self.finished_at: float | None = None
        self.total_steps = 0
        self.steps_done = 0
        self._control = RunControl()
        self._status_lock = threading.Lock()   # status check-and-set vs. the thread's final status
        self._thread: threading.Thread | None = None
        self._snapshot_lock = threading.Lock()
        self._weights: dict | None = None
        self.released = False             # model and weight snapshot dropped (release())
        self._release_when_done = False   # deleted while active: release once ended
        self._registered = register
        if register:  # listed by all_runs() (the dashboard's Runs table) until delete_run()
            with _registry_lock:
                _registry.append(self)

    @property
    def name(self) -> str:
        """Label shown in tables and legends; settable (1..NAME_LIMIT printable characters)."""
        return self._name

    @name.setter
    def name(self, value) -> None:
        self._name = checked_name(value)

    def may_change(self, owner) -> bool:
        """Whether a page of ``owner`` may stop, pause, rename or delete this run: the runs it
        started always; any other run only once it has ended (it is read-only while it runs)."""
        return self.done or (self.owner is not None and self.owner == owner)

    def release(self) -> None:
        """Drop the model and the weight snapshot of an ended run (history, final metrics and
        config stay); ``RuntimeError`` while it is active. Idempotent."""
        with self._status_lock:
            if not self.done:
                raise RuntimeError(f"{self.id}: only an ended run can be released, status is {self.status}")
            if self.result is not None:
                self.result.model = None
            with self._snapshot_lock:
                self._weights = None
            self.released = True

    # ------------------------------------------------------------------ control

    def start(self) -> "LocalRun":
        """Begin training in a daemon thread; returns self. A run starts once (a second call,
        from any thread, raises ``RuntimeError``); a run stopped before it started stays
        stopped (the call does nothing)."""
        with self._status_lock:   # check-and-start in one step: concurrent calls start one thread
            if self._thread is not None:
                raise RuntimeError(f"{self.id}: already started")
            if self.status in DONE:
                return self
            self.status = "running"
            self.started_at = time.time()
            self._thread = threading.Thread(target=self._main, name=self.id, daemon=True)
            self._thread.start()
        return self

    def stop(self) -> None:
        """Ask the loop to stop after the current step (status becomes ``stopped``); a run not
        started yet is ``stopped`` at once and never starts."""
        self._control.stop_requested.set()
        self._control._running.set()
        with self._status_lock:
            if self._thread is None and self.status == "created":
                self.status, self.message, self.finished_at = "stopped", "stopped before it started", time.time()

    def pause(self) -> None:
        """Hold the loop between steps."""
        with self._status_lock:
            if self.status == "running":
                self._control._running.clear()
                self.status = "paused"
                self._pause_began()

    def resume(self) -> None:
        """Continue a paused run."""
        with self._status_lock:
            if self.status == "paused":
                self._pause_ended()
                self.status = "running"
                self._control._running.set()

    def join(self, timeout: float | None = None) -> bool:
        """Wait for the thread; True when it has ended (or never started)."""
        if self._thread is None:
            return True
        self._thread.join(timeout)
        return not self._thread.is_alive()

    @property
    def done(self) -> bool:
        return self.status in DONE

    # ------------------------------------------------------------------ trainer side

    def _report(self, steps_done: int, total_steps: int) -> bool:
        """Called by the loop each step; returns False when the loop must stop."""
        self.steps_done, self.total_steps = steps_done, total_steps
        return self._control.checkpoint()

    def _publish_weights(self, weights: dict) -> None:
        with self._snapshot_lock:
            self._weights = weights

    def weight_snapshot(self) -> dict | None:
        """Latest ``{layer: (latent W, quantized W)}`` copies published by the loop (None before)."""
        with self._snapshot_lock:
            return self._weights

    def _main(self) -> None:
        from .train.trainer import train_experiment
        try:
            self.result = train_experiment(self.config, self.log, report=self._report,
                                           publish_weights=self._publish_weights)
            status, message = self.result.status, self.result.message
        except Exception as exc:  # a failed run must never take the process down
            log.exception("qatlab: run %s (%s) failed", self.id, self._name)
            status, message = "failed", failure_message(exc)
        with self._status_lock:  # a concurrent pause()/resume() must not overwrite the final status
            self.finished_at = time.time()
            self.message = message
            self.status = status
            release = self._release_when_done
        if release:
            self.release()
        elif self._registered:
            release_ended()

    def summary(self) -> dict:
        """One table row: id, name, status, progress and final metrics plus flattened config."""
        row = {"id": self.id, "name": self.name, "status": self.status, "progress": round(self.progress, 3),
               "steps": self.steps_done, "seconds": round(self.elapsed, 2)}
        final = self.result.final if self.result else {}
        for key in ("train_loss", "test_loss", "test_accuracy", "steps_per_second"):
            row[key] = final.get(key, np.nan)
        cfg = self.config
        row.update(dataset=cfg.data.dataset, hidden="-".join(map(str, cfg.model.hidden)),
                   weights=cfg.quant.weights, bits=cfg.quant.weight_bits, ste=cfg.quant.ste,
                   optimizer=cfg.optim.optimizer, lr=cfg.optim.lr, epochs=cfg.optim.epochs,
                   phase=cfg.phase.enabled)
        return row

    def __repr__(self) -> str:
        return f"LocalRun({self.id!r}, status={self.status!r}, steps={self.steps_done}/{self.total_steps})"


def run_experiment(config: ExperimentConfig) -> RunResult:
    """Train ``config`` and return its RunResult (history, final, model); blocks until done.

    Training runs on a worker thread (not listed in ``all_runs()``); Ctrl-C stops it cleanly.
    """
    run = LocalRun(config, register=False)
    run.start()
    _join_or_stop([run])
    if run.result is None:
        return RunResult(history=run.log.columns(), final={}, status=run.status, message=run.message,
                         config=run.config.to_dict())
    return run.result


def _join_or_stop(runs) -> None:
    """Wait for every run; on KeyboardInterrupt stop and join them all, then re-raise."""
    try:
        for run in runs:
            run.join()
    except KeyboardInterrupt:
        for run in runs:
            run.stop()
        for run in runs:
            run.join()
        raise


def start_ste_comparison(config: ExperimentConfig, kinds=None, owner: str | None = None,
                         group: str | None = None, register: bool = True, start: bool = True) -> dict[SteKind, LocalRun]:
    """Start one LocalRun per SteKind (same seed and data; only ``quant.ste`` differs), concurrently.

    kinds: None (all four), one SteKind/name, or a list of them. ``start=False`` returns the runs
    created but not started (call ``run.start()`` on each, e.g. once a view shows them).
    """
    if kinds is None:
        kinds = list(SteKind)
    elif isinstance(kinds, str):
        kinds = [kinds]
    kinds = list(dict.fromkeys(SteKind(k) for k in kinds))
    if not kinds:
        raise ValueError("kinds: give at least one SteKind")
    runs = {}
    for kind in kinds:
        cfg = config.copy()
        cfg.quant.ste = kind.value
        name = f"{group + ' ' if group else ''}{kind.value}"
        runs[kind] = LocalRun(cfg, name=name, owner=owner, register=register)
    if start:
        for run in runs.values():
            run.start()
    return runs


def compare_ste(config: ExperimentConfig, kinds=None) -> dict[SteKind, RunResult]:
    """Train ``config`` once per SteKind concurrently and return ``{SteKind: RunResult}``."""
    runs = start_ste_comparison(config, kinds, register=False)
    _join_or_stop(runs.values())
    results = {}
    for kind, run in runs.items():
        results[kind] = run.result or RunResult(history=run.log.columns(), final={}, status=run.status,
                                                message=run.message)
    return results
