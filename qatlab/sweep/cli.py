"""``python -m qatlab sweep SWEEP.json [--store PATH] [--scheduler ADDR]``: run a sweep file, print its summary.

The file holds ``{"name": ..., "base": {config dict}, "grid": {...}, "random": {...}, "seeds": [...],
"early_stopping": {...}, "max_concurrent": N}`` (only ``base`` plus a grid or random part are needed;
``base`` may leave fields out: they keep their defaults). Random ranges are JSON lists
(``["log_uniform", 1e-4, 0.1]``).
"""
from __future__ import annotations

import json
import sys

SWEEP_KEYS = ("name", "base", "grid", "random", "seeds", "early_stopping", "max_concurrent")


def add_parser(sub, store_help: str) -> None:
    p = sub.add_parser("sweep", help="run the sweep in SWEEP.json on the Dask executor",
                       description=__doc__.split("\n\n", 1)[1] if __doc__ else None)
    p.add_argument("spec", metavar="SWEEP.json", help="the sweep: name, base config, grid/random, seeds")
    p.add_argument("--store", metavar="PATH", help=store_help)
    p.add_argument("--scheduler", metavar="ADDR", help="Dask scheduler, e.g. tcp://host:8786 "
                   "(default: $QATLAB_SCHEDULER, else a local cluster)")


def load_sweep(path: str, usage_error):
    """The Sweep a JSON file describes; ``usage_error(text)`` for anything wrong with it."""
    from ..config import ExperimentConfig
    from .runner import Sweep
    try:
        with open(path, encoding="utf-8") as f:
            spec = json.load(f)
    except OSError as exc:
        raise usage_error(f"{path}: cannot read the sweep ({exc.strerror or exc})") from None
    except json.JSONDecodeError as exc:
        raise usage_error(f"{path}: not valid JSON (line {exc.lineno}, column {exc.colno}: {exc.msg})") from None
    if not isinstance(spec, dict):
        raise usage_error(f"{path}: expected a JSON object with keys {', '.join(SWEEP_KEYS)}")
    unknown = set(spec) - set(SWEEP_KEYS)
    if unknown:
        raise usage_error(f"{path}: unknown keys {sorted(unknown)}; allowed: {', '.join(SWEEP_KEYS)}")
    if not isinstance(spec.get("base", {}), dict):
        raise usage_error(f"{path}: 'base' must be a config object")
    try:
        base = ExperimentConfig.from_dict(spec.get("base", {}))
        return Sweep(base, grid=spec.get("grid"), random=spec.get("random"), seeds=spec.get("seeds", [0]),
                     name=spec.get("name"), early_stopping=spec.get("early_stopping"),
                     max_concurrent=spec.get("max_concurrent"))
    except (ValueError, TypeError) as exc:
        raise usage_error(f"{path}: bad sweep: {' '.join(str(exc).split())}") from None


def cmd_sweep(args, open_store, usage_error) -> int:
    """Run the sweep; exit 0 when every run finished or was pruned, 1 otherwise."""
    sweep = load_sweep(args.spec, usage_error)
    store = open_store(args.store)
    from ..executor import connect
    try:
        client = connect(args.scheduler)
    except (ValueError, OSError) as exc:
        raise usage_error(f"--scheduler: {' '.join(str(exc).split())}") from None
    print(f"sweep {sweep.name}: {len(sweep)} runs -> {store.path}", file=sys.stderr)
    result = sweep.run(store=store, client=client)
    print(result.format_summary())
    bad = [row for row in result.table if row["status"] not in ("finished", "pruned")]
    for row in bad:
        print(f"run {row['run_id'][:8]} ({row['name']}) {row['status']}: {row['message']}", file=sys.stderr)
    return 1 if bad else 0
