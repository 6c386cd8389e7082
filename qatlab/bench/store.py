"""``python -m qatlab.bench store``: what keeping runs in the SQLite run store costs.

* **Logging cost**: one digits run (MLP 64-256-10, ternary weights) trained by ``ql.run_experiment``
  (rows kept in memory only) and by ``python -m qatlab run`` (called in this process: the training
  thread's rows go to a temporary store every 0.5 s, with heartbeats), alternated ``--repeats`` times
  (default 7; 3 with ``--quick``), a metrics row every step and every 10 steps. A run's rate is its
  steps over its training-loop seconds (``final["train_seconds"]``); each side's median is compared
  (goal: logging costs <= 5% of the steps/s).
* **Reading a history**: a run of 100k rows with every column a default run logs (the rows of a real
  run repeated, steps renumbered) is appended 1000 rows at a time as a live run would, then read with
  ``store.history`` while it is live and again once ``finish`` merged its chunks (goal < 100 ms, the
  median of 5 reads each).
"""
from __future__ import annotations

import contextlib
import io
import json
import statistics
import tempfile
import time
from pathlib import Path

from .kit import BenchOptions, Column, Goal, SuiteResult, Table, suite

EPOCHS = 1000               # ~23k steps: a few seconds, many store flushes
ROWS_EVERY = (1, 10)
HISTORY_ROWS = 100_000
APPEND_ROWS = 1000
GOAL_COST = 0.05
GOAL_READ_MS = 100.0

LOG_COLUMNS = [Column("metrics_every", "row every (steps)"), Column("rows", "rows"),
               Column("plain_sps", "in memory steps/s", "{:.0f}"), Column("store_sps", "to the store steps/s", "{:.0f}"),
               Column("cost", "cost", "{:.1%}")]
READ_COLUMNS = [Column("state", "run"), Column("rows", "rows"), Column("columns", "columns"),
                Column("median_ms", "history() ms (median)", "{:.1f}"), Column("max_ms", "max ms", "{:.1f}")]


def bench_config(epochs: int, metrics_every: int):
    from ..config import ExperimentConfig
    cfg = ExperimentConfig()
    cfg.optim.epochs, cfg.metrics_every = epochs, metrics_every
    return cfg


def _rate(final: dict) -> float:
    return final["steps"] / final["train_seconds"]


def rate_in_memory(cfg) -> float:
    from ..runs import run_experiment
    return _rate(run_experiment(cfg).final)


def rate_to_store(cfg, tmp: Path) -> tuple[float, int]:
    """Train ``cfg`` with ``python -m qatlab run`` into a new store; (steps/s, rows stored)."""
    from ..__main__ import main
    from ..store import RunStore
    path, store_path = tmp / f"cfg-{time.monotonic_ns()}.json", tmp / f"runs-{time.monotonic_ns()}.sqlite"
    path.write_text(json.dumps(cfg.to_dict()))
    with contextlib.redirect_stderr(io.StringIO()):          # (the progress bar)
        code = main(["run", str(path), "--store", str(store_path)])
    with RunStore(store_path) as store:
        (record,) = store.runs()
    if code != 0 or record.status != "finished":
        raise RuntimeError(f"python -m qatlab run ended {record.status} (exit {code}): {record.message}")
    return _rate(record.final), record.n_rows


def logging_cost(epochs: int, repeats: int, tmp: Path) -> list[dict]:
    rows = []
    for every in ROWS_EVERY:
        cfg = bench_config(epochs, every)
        rate_in_memory(bench_config(1, every))                # kernels loaded before anything is timed
        plain, stored, n_rows = [], [], 0
        for _ in range(repeats):
            plain.append(rate_in_memory(cfg))
            rate, n_rows = rate_to_store(cfg, tmp)
            stored.append(rate)
        p, s = statistics.median(plain), statistics.median(stored)
        rows.append({"metrics_every": every, "rows": n_rows, "plain_sps": p, "store_sps": s, "cost": 1 - s / p,
                     "plain_samples": plain, "store_samples": stored})
    return rows


def _history_rows(n: int) -> list[dict]:
    """``n`` rows with a default run's columns: a real run's rows repeated, steps renumbered."""
    from ..runs import run_experiment
    history = run_experiment(bench_config(40, 1)).history
    keys = [k for k in history if k != "row_id"]
    real = [{k: float(history[k][i]) for k in keys if history[k][i] == history[k][i]}
            for i in range(len(history["step"]))]
    return [dict(real[i % len(real)], step=float(i + 1)) for i in range(n)]


def _read_ms(store, run_id: str, reads: int = 5) -> list[float]:
    out = []
    for _ in range(reads):
        t0 = time.perf_counter()
        store.history(run_id)
        out.append(1e3 * (time.perf_counter() - t0))
    return out


def history_reads(n_rows: int, tmp: Path) -> list[dict]:
    from ..train.result import RunResult
    from ..store import RunStore
    rows = _history_rows(n_rows)
    out = []
    with RunStore(tmp / "history.sqlite") as store:
        run_id = store.create_run(bench_config(40, 1), name="100k rows")
        store.set_status(run_id, "running")
        for i in range(0, n_rows, APPEND_ROWS):
            store.append_rows(run_id, rows[i:i + APPEND_ROWS])
        columns = len(store.history(run_id)) - 1          # (row_id aside)
        for state in ("live", "finished"):
            if state == "finished":
                store.finish(run_id, RunResult(history={}, final={}, status="finished"))
            times = _read_ms(store, run_id)
            out.append({"state": state, "rows": store.get(run_id).n_rows, "columns": columns,
                        "median_ms": statistics.median(times), "max_ms": max(times), "samples_ms": times})
    return out


@suite("store", description="the run store: logging cost on a run's steps/s, reading a 100k-row history")
def run(opts: BenchOptions) -> SuiteResult:
    """Run the store suite (see the module docstring)."""
    epochs = (EPOCHS // 4 if opts.quick else EPOCHS) if opts.sizes is None else opts.sizes[0]
    repeats = opts.repeats
    n_rows = HISTORY_ROWS // 10 if opts.quick else HISTORY_ROWS
    with tempfile.TemporaryDirectory(prefix="qatlab-bench-store-") as tmp:
        logged = logging_cost(epochs, repeats, Path(tmp))
        reads = history_reads(n_rows, Path(tmp))
    worst = max(r["cost"] for r in logged)
    slowest = max(r["median_ms"] for r in reads)
    goals = [Goal("logging to the store costs <= 5% of a run's steps/s (worst row rate)", worst <= GOAL_COST,
                  f"{worst:.1%}", f"<= {GOAL_COST:.0%}"),
             Goal(f"reading a {n_rows:,}-row history (live and finished, median)", slowest < GOAL_READ_MS,
                  f"{slowest:.0f} ms", f"< {GOAL_READ_MS:.0f} ms")]
    notes = [f"digits MLP 64-256-10, ternary weights, Adam, {epochs} epochs; {repeats} runs each way, alternated; "
             "steps/s = steps / training-loop seconds; medians",
             "to the store: `python -m qatlab run CONFIG.json --store TMP` in this process (rows flushed every 0.5 s)",
             f"history: {n_rows:,} rows appended {APPEND_ROWS} at a time, then read 5 times live and 5 times "
             "after finish() merged the chunks"]
    return SuiteResult(tables=[Table("logging to the run store vs rows kept in memory", LOG_COLUMNS, logged),
                               Table(f"reading a {n_rows:,}-row history from the store", READ_COLUMNS, reads)],
                       goals=goals, notes=notes, extra={"epochs": epochs, "repeats": repeats})
