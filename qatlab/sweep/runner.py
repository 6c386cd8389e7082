"""Sweep: many runs over config fields and seeds on the Dask executor; SweepHandle: the running sweep.

``Sweep(...)`` expands and checks every point (config rules and the memory estimate) when it is
made, so a bad field or value raises before anything is submitted. ``submit()`` starts a
dispatcher thread that keeps at most ``max_concurrent`` runs (default: the cluster's worker
threads) on the workers as :class:`~qatlab.executor.RemoteRun` s tagged with the sweep's id (its
name) and point; ``run()`` waits with a progress bar. A sweep started again with the same name and
store skips the configs that already finished there.
"""
from __future__ import annotations

import logging
import math
import shutil
import sys
import threading
import time
import uuid
from dataclasses import dataclass, field

from ..config import ExperimentConfig
from .points import config_key, expand
from .pruning import MedianStopping
from .result import SweepResult

log = logging.getLogger(__name__)

TICK_SECONDS = 0.1       # the dispatcher's longest sleep (a run whose task ends wakes it at once)
JUDGE_SECONDS = 0.25     # how often running runs are judged by the early-stopping rule


@dataclass
class EndedRun:
    """What a sweep keeps of a run once it ended and its result is in the store: no rows, no model,
    so a long sweep's handle (and a page showing it) holds the same memory after 200 runs as after 2."""

    id: str
    name: str
    status: str
    message: str
    point: dict | None
    final: dict = field(default_factory=dict)
    worker: str | None = None
    submitted_at: float | None = None
    finished_at: float | None = None
    steps_done: int = 0
    total_steps: int = 0
    done: bool = True
    progress: float = 1.0

    @classmethod
    def of(cls, run) -> "EndedRun":
        result = run.result()
        return cls(id=run.id, name=run.name, status=run.status, message=run.message, point=run.point,
                   final=dict(result.final) if result is not None else {}, worker=run.worker,
                   submitted_at=run.submitted_at, finished_at=run.finished_at, steps_done=run.steps_done,
                   total_steps=run.total_steps)

    def join(self, timeout: float | None = None) -> bool:
        return True


def default_name() -> str:
    return f"sweep-{uuid.uuid4().hex[:8]}"


class Sweep:
    """Runs of ``base`` over a grid and/or random draws of config fields, times ``seeds``.

    Args:
        base: the ExperimentConfig every point starts from (copied).
        grid: ``{"quant.ste": ["identity", "hard_tanh"], "quant.weight_bits": [2, 4]}``: every combination.
        random: ``{"n": 8, "seed": 0, "fields": {"optim.lr": ("log_uniform", 1e-4, 1e-1),
            "quant.ste": ["identity", "tanh"]}}``: n draws (ranges: uniform, log_uniform, int; or choices).
            With a grid too, every grid point is combined with every draw.
        seeds: values of ``optim.seed`` (init and batch order; the split stays ``data.seed``'s).
        name: the sweep's name, also its id in the store (default ``sweep-<8 hex>``); a sweep run
            again under the same name in the same store skips the configs that finished there.
        early_stopping: None, a :class:`MedianStopping` or a dict of its fields.
        max_concurrent: runs on the workers at once (default: the cluster's worker threads).
    """

    def __init__(self, base: ExperimentConfig, grid=None, random=None, seeds=(0,), name: str | None = None,
                 early_stopping=None, max_concurrent: int | None = None):
        from ..runs import checked_name
        if max_concurrent is not None and (isinstance(max_concurrent, bool) or not isinstance(max_concurrent, int)
                                           or not 1 <= max_concurrent <= 10_000):
            raise ValueError(f"max_concurrent: expected an int in [1, 10000] or None, got {max_concurrent!r}")
        self.name = default_name() if name is None else checked_name(name)
        self.early_stopping = MedianStopping.of(early_stopping)
        self.max_concurrent = max_concurrent
        self.base = base.copy() if isinstance(base, ExperimentConfig) else base
        self.grid, self.random = grid, random
        self.points = expand(base, grid, random, seeds)
        self.seeds = sorted({p.seed for p in self.points})
        self._check_resources()

    def _check_resources(self) -> None:
        from ..executor.remote import check_resources
        for p in self.points:
            try:
                check_resources(p.config)
            except (ValueError, TypeError) as exc:
                raise ValueError(f"point {p.index} {p.point}: {' '.join(str(exc).split())}") from None

    def __len__(self) -> int:
        return len(self.points)

    def __repr__(self) -> str:
        return f"Sweep({self.name!r}, {len(self.points)} runs)"

    @property
    def keys(self) -> list[str]:
        """The config key of every planned run (see :func:`~qatlab.sweep.points.config_key`)."""
        return [p.key for p in self.points]

    def submit(self, store=None, client=None, owner=None) -> "SweepHandle":
        """Start the sweep and return its handle at once (``stop()``, ``join()``, ``done``, ``result()``).
        owner: the store's owner of its runs (None: this process; a page id: a dashboard page)."""
        return SweepHandle(self, store, client, owner)

    def run(self, store=None, client=None, progress: bool = True, owner=None) -> SweepResult:
        """Run the sweep to its end (a progress bar on stderr with ``progress``); Ctrl-C stops it."""
        handle = self.submit(store, client, owner)
        bar = _Progress() if progress else None
        try:
            while not handle.join(0.2):
                if bar is not None:
                    bar.draw(handle)
        except KeyboardInterrupt:
            handle.stop()
            handle.join()
        if bar is not None:
            bar.draw(handle, final=True)
        if handle.error is not None:
            raise handle.error
        return handle.result()


class SweepHandle:
    """A sweep started by :meth:`Sweep.submit`: ``runs`` (its runs so far, in start order: a RemoteRun
    while it is active, an :class:`EndedRun` once its result is stored), ``skipped``
    (configs that had finished in the store before), ``stop()``, ``join()``, ``done``, ``result()``."""

    def __init__(self, sweep: Sweep, store=None, client=None, owner=None):
        from ..executor import cluster
        from ..executor.remote import default_store
        from ..store import RunStore
        if store is not None and not isinstance(store, RunStore):
            raise TypeError(f"store: expected a RunStore or None, got {type(store).__name__}")
        self.sweep, self.owner = sweep, owner
        self.store = store if store is not None else default_store()
        self.client = client if client is not None else cluster.connect()
        # (No run is submitted ahead of a free slot: Dask would hand it to a worker's queue, and a
        # worker that dies fails every run it was given, started or not, since none is retried.)
        self.cap = sweep.max_concurrent or max(1, sum(self.client.nthreads().values()))
        finished = {config_key(r.config_dict) for r in self.store.runs(sweep_id=sweep.name, status="finished")}
        self.todo = [p for p in sweep.points if p.key not in finished]
        self.skipped = len(sweep.points) - len(self.todo)
        self.runs: list = []
        self.pruned: dict[str, float] = {}       # run id -> step it was pruned at
        self.error: BaseException | None = None
        self.started_at = time.monotonic()
        self._active: list = []
        self._to_prune: dict = {}                 # RemoteRun -> step
        self._curves: dict = {}                   # run id -> (rows seen, Curve)
        self._stop = threading.Event()
        self._slot_freed = threading.Event()      # a run's task ended: the dispatcher starts the next
        self._ended = threading.Event()
        self._lock = threading.Lock()
        self._thread = threading.Thread(target=self._main, name=f"qatlab-sweep-{sweep.name[:20]}", daemon=True)
        self._thread.start()

    # ------------------------------------------------------------------ control and state

    def stop(self) -> None:
        """Start no more runs and stop the running ones (they end ``stopped``)."""
        self._stop.set()
        self._slot_freed.set()
        with self._lock:
            active = list(self._active)
        for run in active:
            run.stop()

    def join(self, timeout: float | None = None) -> bool:
        """Wait for every started run to end; True if the sweep is over."""
        return self._ended.wait(timeout)

    @property
    def done(self) -> bool:
        return self._ended.is_set()

    @property
    def total(self) -> int:
        """Runs this sweep starts (the planned ones minus those finished before)."""
        return len(self.todo)

    def counts(self) -> dict:
        """Runs by status so far (pruned ones as ``pruned``), with ``queued`` for those not started."""
        out: dict[str, int] = {}
        for run in list(self.runs):
            status = "pruned" if run.id in self.pruned else run.status
            out[status] = out.get(status, 0) + 1
        out["queued"] = 0 if self._stop.is_set() else len(self.todo) - len(self.runs)
        return out

    def progress(self) -> float:
        """Share of this sweep's runs done, 0..1 (running ones count by their steps)."""
        if not self.todo:
            return 1.0
        runs = list(self.runs)
        return sum(1.0 if r.done else r.progress for r in runs) / len(self.todo)

    def result(self) -> SweepResult:
        """The sweep's runs from the store (also those finished before it was resumed)."""
        records = self.store.runs(sweep_id=self.sweep.name)
        return SweepResult.from_records(self.sweep.name, records, keys=self.sweep.keys)

    # ------------------------------------------------------------------ the dispatcher

    def _main(self) -> None:
        queue = list(self.todo)
        ready = None             # the next run, prepared while every slot is busy (start() only submits)
        last_judge = 0.0
        try:
            while True:
                while (ready or queue) and self._busy() < self.cap and not self._stop.is_set():
                    run, ready = ready or self._new_run(queue.pop(0)), None
                    with self._lock:
                        self.runs.append(run)
                        self._active.append(run)
                    run.start()
                self._reap()
                if ready is None and queue and not self._stop.is_set():
                    ready = self._new_run(queue.pop(0)).prepare()
                if self._stop.is_set() and ready is not None:    # never submitted: leaves no trace
                    ready.stop()
                    self.store.delete(ready.id)
                    ready = None
                if not self._active and (not (queue or ready) or self._stop.is_set()):
                    break
                now = time.monotonic()
                if self.sweep.early_stopping is not None and now - last_judge >= JUDGE_SECONDS:
                    self._judge()
                    last_judge = now
                self._slot_freed.wait(TICK_SECONDS)
                self._slot_freed.clear()
        except BaseException as exc:         # the store or the client failed: stop what runs, keep the error
            log.exception("qatlab: sweep %s stopped by an error", self.sweep.name)
            self.error = exc
            self.stop()
            if ready is not None:
                ready.stop()
            for run in list(self._active):
                run.join(30)
            self._reap()
        finally:
            self._ended.set()

    def _new_run(self, point):
        from ..executor import RemoteRun
        return RemoteRun(point.config, name=point.label(), store=self.store, client=self.client, owner=self.owner,
                         sweep_id=self.sweep.name, point=point.point, weights=False,
                         on_task_end=self._slot_freed.set)

    def _busy(self) -> int:
        """Runs holding a worker slot: a run whose task has ended frees its slot while its result is
        still being fetched and stored, so the next run starts that much sooner."""
        return sum(not run.task_ended for run in self._active)

    def _reap(self) -> None:
        """Forget ended runs (``runs`` keeps an :class:`EndedRun` in their place); a run stopped by
        the rule is stored as ``pruned``."""
        for run in list(self._active):
            if not run.join(0):
                continue
            step = self._to_prune.pop(run, None)
            if step is not None and run.status == "stopped":
                self.store.set_status(run.id, "pruned", f"pruned by median rule at step {step:g}")
                self.pruned[run.id] = step
            if self.sweep.early_stopping is not None and run.id not in (None, "starting"):
                self._curve(run)                 # its curve stays a reference for the rule
            ended = EndedRun.of(run)
            if run.id in self.pruned:
                ended.status, ended.message = "pruned", f"pruned by median rule at step {self.pruned[run.id]:g}"
            with self._lock:
                self._active.remove(run)
                self.runs[self.runs.index(run)] = ended

    def _curve(self, run):
        seen, curve = self._curves.get(run.id, (-1, None))
        if isinstance(run, EndedRun):
            return curve
        if seen != len(run.log):
            seen, curve = len(run.log), self.sweep.early_stopping.curve(run.history())
            self._curves[run.id] = (seen, curve)
        return curve

    def _judge(self) -> None:
        """Apply the early-stopping rule to every running run (references: all runs that did not fail)."""
        rule = self.sweep.early_stopping
        refs = {run.id: self._curve(run) for run in list(self.runs)
                if run.id not in (None, "starting") and run.status not in ("failed", "diverged")}
        refs = {rid: c for rid, c in refs.items() if c is not None}
        for run in list(self._active):
            if run.status != "running" or run in self._to_prune or run.id not in refs:
                continue
            step = rule.judge(refs[run.id], [c for rid, c in refs.items() if rid != run.id])
            if step is not None:
                self._to_prune[run] = step
                run.stop()


class _Progress:
    """One line on stderr: runs done of the total, by status (in place on a terminal, else every 5 s)."""

    def __init__(self, stream=None):
        self.stream = stream if stream is not None else sys.stderr
        self.tty = self.stream.isatty()
        self.last = -math.inf

    def draw(self, handle: SweepHandle, final: bool = False) -> None:
        now = time.monotonic()
        if not final and now - self.last < (0.2 if self.tty else 5.0):
            return
        self.last = now
        counts, share = handle.counts(), handle.progress()
        ended = sum(v for k, v in counts.items() if k not in ("queued", "created", "running", "paused"))
        elapsed = now - handle.started_at
        eta = f"{elapsed * (1 - share) / share:.0f}s" if 0 < share < 1 else "-"
        shown = ", ".join(f"{v} {k}" for k, v in sorted(counts.items()) if v and k != "queued")
        text = (f"{ended}/{handle.total} runs ({shown or 'starting'}; {handle.skipped} done before)  "
                f"{elapsed:.0f}s  eta {eta}")
        width = max(10, min(30, shutil.get_terminal_size().columns - len(text) - 4))
        fill = int(share * width)
        line = f"[{'#' * fill}{'.' * (width - fill)}] {text}"
        self.stream.write(("\r" + line + ("\n" if final else "")) if self.tty else line + "\n")
        self.stream.flush()
