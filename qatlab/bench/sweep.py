"""``python -m qatlab.bench sweep``: a sweep of 16 digits runs on 1 and on 2 single-threaded workers.

Two LocalClusters (1 worker, 2 workers; one thread each) are started and warmed first; then the
same sweep (4 STE kinds x 4 seeds, digits, MLP 64-256-10, ternary weights) runs on each in turn,
three times interleaved (once with ``--quick``), each time under a new sweep name
in a temporary store. Reported per cluster, from its repeat with the shortest wall time:

* **wall**: from ``Sweep.submit`` until every run's result is in the store;
* **speedup**: 1-worker wall / 2-worker wall (goal >= 1.7x);
* **run slowdown**: a run's mean training-loop seconds on this cluster over the 1-worker one's: 1.0
  when the machine gives each worker a core of its own, more when other processes compete (then
  the speedup cannot reach 2 / slowdown);
* **overhead per run** (goal < 50 ms): what a worker slot spends per run beyond the run's own
  training loop (``final["seconds"]``, the trainer's clock on the worker): the sweep handing it
  the run, Dask scheduling, the worker building the data and model. Read from Dask's task stream:
  for each worker, from ``Sweep.submit`` to the end of its last run, minus its runs' training
  seconds; summed over workers, over the runs. The time a worker sits idle at the end because no
  run is left for it (16 runs of unequal length on 2 workers) is not counted; it is in
* **wall overhead per run**: ``(wall - sum(run seconds) / workers) / (runs / workers)``, everything
  beyond training, that idle end and the last result's storing included;
* **submit -> start**: median time from ``RemoteRun`` submission to the run's start stamp in the
  store (the worker's start message, written by the client within its 0.1 s monitor tick).

Every worker first trains one short run of each STE kind (its kernels compiled or loaded from
Numba's cache: not counted as overhead), then a 2-run warm-up sweep goes through each cluster.

Bit-identity: the history of one point (identity STE, seed 0) from each cluster is compared with
``ql.run_experiment`` of the same config in this process, every column but ``time`` and
``steps_per_second``. ``--sizes N`` sets the epochs of each run (default 60).

The Sweeps tab with 200 runs (:mod:`qatlab.ui.sweep_bench`): a temporary store holds 200 finished
runs of one sweep (synthetic metric values); the tab's view, rendered into a Bokeh Document, reads
them and then applies selections the three ways a page makes them (ticking table rows, tapping a
line, tapping a heatmap cell); reported: the slowest selection (goal < 0.5 s) and the growth of
the process's resident memory over 300 refreshes with metric switches and selections (goal < 5 MB).
"""
from __future__ import annotations

import statistics
import tempfile
import time
from pathlib import Path

import numpy as np

from .kit import BenchOptions, Column, Goal, SuiteResult, Table, suite

EPOCHS = 60
KINDS = ("identity", "clipped_identity", "tanh", "hard_tanh")
SEEDS = (0, 1, 2, 3)
WORKERS = (1, 2)
TIME_COLUMNS = ("time", "steps_per_second")
GOAL_SPEEDUP = 1.7
GOAL_OVERHEAD_MS = 50.0
VIEW_RUNS = 200
GOAL_SELECT_S = 0.5
GOAL_RSS_GROWTH_MB = 5.0

COLUMNS = [Column("workers", "workers"), Column("runs", "runs"), Column("wall_s", "wall s", "{:.2f}"),
           Column("train_s", "sum train s", "{:.2f}"), Column("slowdown", "run slowdown", "{:.2f}x"),
           Column("speedup", "speedup", "{:.2f}x"),
           Column("overhead_ms", "overhead/run ms", "{:.0f}"),
           Column("wall_overhead_ms", "wall overhead/run ms", "{:.0f}"),
           Column("submit_start_ms", "submit->start ms", "{:.0f}"), Column("statuses", "statuses"),
           Column("identical", "bit-identical to in-process")]


def base_config(epochs: int):
    from ..config import ExperimentConfig
    cfg = ExperimentConfig()
    cfg.optim.epochs = epochs
    cfg.model.hidden = [256]
    return cfg


VIEW_COLUMNS = [Column("runs", "runs"), Column("load_s", "read + first draw s", "{:.2f}"),
                Column("table_median_ms", "tick rows ms (median)", "{:.1f}"),
                Column("chart_median_ms", "tap line ms (median)", "{:.1f}"),
                Column("heatmap_median_ms", "tap cell ms (median)", "{:.1f}"),
                Column("worst_ms", "slowest selection ms", "{:.1f}"),
                Column("rss_growth_mb", "RSS growth MB (300 refreshes)", "{:.2f}")]


def warm_kinds() -> None:
    """On a worker: one short run of each STE kind, so no kernel is compiled during a measured sweep."""
    from ..runs import run_experiment
    for kind in KINDS:
        cfg = base_config(1)
        cfg.quant.ste = kind
        run_experiment(cfg)


def _cluster(n: int):
    from ..executor import WarmWorker, local_cluster
    from ..executor.cluster import local_client
    cluster = local_cluster(n)
    client = local_client(cluster, timeout="60s")
    client.register_plugin(WarmWorker(warm=True))
    client.wait_for_workers(n, timeout=120)
    for address in client.nthreads():
        client.submit(warm_kinds, workers=[address], allow_other_workers=False, pure=False).result()
    return cluster, client


def view_part() -> dict:
    """The Sweeps tab's view over a temporary store of VIEW_RUNS finished runs (see the module doc)."""
    from ..store import RunStore
    from ..ui.sweep_bench import fill_store, measure_view
    with tempfile.TemporaryDirectory(prefix="qatlab-bench-sweep-view-") as tmp:
        with RunStore(Path(tmp) / "runs.sqlite") as store:
            return measure_view(store, fill_store(store, VIEW_RUNS))


def one_sweep(name: str, epochs: int, store, client, runs_grid=KINDS, seeds=SEEDS) -> dict:
    """Run the bench sweep once on ``client``; its wall time and what the store says of its runs."""
    from distributed import get_task_stream

    from ..sweep import Sweep
    sweep = Sweep(base_config(epochs), grid={"quant.ste": list(runs_grid)}, seeds=list(seeds), name=name)
    with get_task_stream(client=client) as stream:
        t0, submit_time = time.perf_counter(), time.time()
        handle = sweep.submit(store=store, client=client)
        handle.join()
        wall = time.perf_counter() - t0
    if handle.error is not None:
        raise handle.error
    records = store.runs(sweep_id=name)
    submitted = {run.id: run.submitted_at for run in handle.runs}
    starts = [(r.started.timestamp() - submitted[r.id]) for r in records
              if r.started is not None and submitted.get(r.id)]
    return {"wall_s": wall, "records": records, "train_s": sum(r.final.get("seconds", 0.0) for r in records),
            "slot_overhead_s": slot_overhead(stream.data, records, submit_time),
            "submit_start_ms": 1e3 * statistics.median(starts) if starts else None,
            "statuses": ", ".join(f"{n} {s}" for s, n in sorted(_count(r.status for r in records).items()))}


def slot_overhead(tasks: list[dict], records, submitted: float) -> float:
    """Seconds per run that workers spent beyond training, up to each one's last run (module doc)."""
    seconds = {f"qatlab-run-{r.id}": r.final.get("seconds", 0.0) for r in records}
    last_end: dict[str, float] = {}
    trained: dict[str, float] = {}
    for task in tasks:
        key = str(task["key"])
        if key not in seconds:
            continue
        end = max(part["stop"] for part in task["startstops"] if part["action"] == "compute")
        last_end[task["worker"]] = max(last_end.get(task["worker"], end), end)
        trained[task["worker"]] = trained.get(task["worker"], 0.0) + seconds[key]
    busy = sum(last_end[w] - submitted - trained[w] for w in last_end)
    return busy / max(1, len(records))


def _count(items) -> dict:
    out: dict = {}
    for item in items:
        out[item] = out.get(item, 0) + 1
    return out


def identical_to_in_process(store, record, reference: dict) -> str:
    got = store.history(record.id)
    keys = [k for k in reference if k not in TIME_COLUMNS]
    same = [k for k in keys if k in got and np.array_equal(got[k], reference[k], equal_nan=True)]
    return "yes" if len(same) == len(keys) else f"NO ({len(keys) - len(same)} of {len(keys)} columns differ)"


@suite("sweep", description="a 16-run digits sweep on 1 vs 2 single-threaded Dask workers: speedup, "
                            "per-run overhead, bit-identity")
def run(opts: BenchOptions) -> SuiteResult:
    """Run the sweep suite (see the module docstring)."""
    from ..runs import run_experiment
    from ..store import RunStore
    epochs = EPOCHS if opts.sizes is None else opts.sizes[0]
    repeats = 1 if opts.quick else 3
    clusters = {n: _cluster(n) for n in WORKERS}
    samples: dict[int, list[dict]] = {n: [] for n in WORKERS}
    tmp = tempfile.TemporaryDirectory(prefix="qatlab-bench-sweep-")
    try:
        store = RunStore(Path(tmp.name) / "runs.sqlite")
        for n, (_, client) in clusters.items():      # warm-up: every worker loads its kernels and data
            one_sweep(f"warm-{n}w", 1, store, client, runs_grid=KINDS[:2], seeds=(0,))
        for rep in range(repeats):
            for n, (_, client) in clusters.items():
                samples[n].append(one_sweep(f"bench-{n}w-{rep}", epochs, store, client))
        point = base_config(epochs)
        reference = run_experiment(point).history
        rows = {}
        for n in WORKERS:
            med = min(samples[n], key=lambda s: s["wall_s"])
            runs = len(med["records"])
            first = next(r for r in med["records"] if r.point == {"quant.ste": "identity", "seed": 0})
            rows[n] = {"workers": n, "runs": runs, "wall_s": med["wall_s"],
                       "wall_samples_s": [s["wall_s"] for s in samples[n]], "train_s": med["train_s"],
                       "overhead_ms": 1e3 * med["slot_overhead_s"],
                       "wall_overhead_ms": 1e3 * (med["wall_s"] - med["train_s"] / n) / (runs / n),
                       "submit_start_ms": med["submit_start_ms"], "statuses": med["statuses"],
                       "identical": identical_to_in_process(store, first, reference),
                       "worker_of_checked_run": first.worker}
        store.close()
    finally:
        for cluster, client in clusters.values():
            client.close(timeout=30)
            cluster.close(timeout=30)
        tmp.cleanup()
    view = view_part()
    speedup = rows[1]["wall_s"] / rows[2]["wall_s"]
    for n in WORKERS:
        rows[n]["slowdown"] = rows[n]["train_s"] / rows[1]["train_s"]
    rows[2]["speedup"] = speedup
    rows[1]["speedup"] = 1.0
    worst = max(r["overhead_ms"] for r in rows.values())
    goals = [Goal("2 workers vs 1: sweep speedup", speedup >= GOAL_SPEEDUP, f"{speedup:.2f}x", f">= {GOAL_SPEEDUP}x"),
             Goal("per-run overhead (worst cluster)", worst < GOAL_OVERHEAD_MS, f"{worst:.0f} ms",
                  f"< {GOAL_OVERHEAD_MS:.0f} ms"),
             Goal("history bit-identical to ql.run_experiment (time columns aside)",
                  all(r["identical"] == "yes" for r in rows.values()),
                  "; ".join(f"{n} worker(s): {r['identical']}" for n, r in rows.items()), "both clusters"),
             Goal(f"Sweeps tab, {VIEW_RUNS} runs: slowest selection applied", view["worst_ms"] < 1e3 * GOAL_SELECT_S,
                  f"{view['worst_ms']:.0f} ms", f"< {GOAL_SELECT_S} s"),
             Goal(f"Sweeps tab, {VIEW_RUNS} runs: server memory flat over 300 refreshes",
                  view["rss_growth_mb"] < GOAL_RSS_GROWTH_MB, f"{view['rss_growth_mb']:+.2f} MB",
                  f"< {GOAL_RSS_GROWTH_MB:.0f} MB")]
    notes = [f"sweep: quant.ste x {len(KINDS)} kinds x seeds {list(SEEDS)} = {len(KINDS) * len(SEEDS)} runs of digits, "
             f"MLP 64-256-10, ternary weights, Adam, {epochs} epochs; {repeats} repeat(s) per cluster, interleaved; "
             "each cluster's row is its repeat with the shortest wall",
             "overhead/run = sum over workers of (its last run's end - submit - its runs' training-loop seconds) "
             "/ runs (Dask's task stream); wall overhead/run = (wall - sum of training-loop seconds / workers) "
             "/ (runs / workers), which also holds the idle end and the last result's storing",
             "submit->start = median over runs of (store's start stamp - RemoteRun submission); the stamp is "
             "written within the client's 0.1 s monitor tick of the worker's start message",
             "speedup of each repeat (1-worker wall / 2-worker wall, in order): "
             + ", ".join(f"{a['wall_s'] / b['wall_s']:.2f}x" for a, b in zip(samples[1], samples[2])),
             f"Sweeps tab: {VIEW_RUNS} stored runs (synthetic metrics, 60 rows each); a selection's time is the "
             "server's: the table, both charts' sources and the config diff updated in a Bokeh Document"]
    return SuiteResult(tables=[Table(f"sweep of {len(KINDS) * len(SEEDS)} runs on 1 vs 2 single-threaded "
                                     "workers (LocalCluster)", COLUMNS, list(rows.values())),
                               Table(f"Sweeps tab with {VIEW_RUNS} finished runs (server side)", VIEW_COLUMNS, [view])],
                       goals=goals, notes=notes, extra={"epochs": epochs, "repeats": repeats})
