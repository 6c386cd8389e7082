"""SweepResult: a sweep's runs as a table (one row per run) and a summary (one row per point).

The summary's statistics of each final metric (``<metric>_mean``, ``_std`` (sample std, ddof 1;
0 for one value), ``_min``, ``_max``, ``_count``) come from the point's FINISHED runs only; runs
that failed, diverged, were pruned, stopped or interrupted are counted (``n_failed`` ...) and
listed in the table, never averaged in. A config run more than once (a sweep resumed after a
failure) appears once: its finished run if there is one, else its latest attempt; the attempts it
replaced are counted in ``n_superseded``.
"""
from __future__ import annotations

import math
import numbers
from dataclasses import dataclass, field

import numpy as np

from .points import config_key

COUNTED = ("failed", "diverged", "pruned", "stopped", "interrupted")
ACTIVE = ("created", "running", "paused")
STATS = ("mean", "std", "min", "max", "count")


def _number(value) -> bool:
    return isinstance(value, numbers.Real) and not isinstance(value, bool) and math.isfinite(value)


def _seconds(record) -> float | None:
    seconds = record.final.get("seconds")
    if _number(seconds):
        return float(seconds)
    if record.started is not None and record.ended is not None:
        return (record.ended - record.started).total_seconds()
    return None


def _pick(records) -> tuple[list, dict]:
    """One record per config (its finished run, else its latest attempt) and how many each replaced."""
    by_key: dict[str, list] = {}
    for r in records:                       # records come oldest first
        by_key.setdefault(config_key(r.config_dict), []).append(r)
    chosen, replaced = [], {}
    for attempts in by_key.values():
        finished = [r for r in attempts if r.status == "finished"]
        pick = finished[-1] if finished else attempts[-1]
        chosen.append(pick)
        replaced[pick.id] = len(attempts) - 1
    return chosen, replaced


@dataclass
class SweepResult:
    """A sweep's runs: ``table`` (one dict per run), ``summary`` (one dict per point), ``best()``."""

    name: str
    records: list = field(repr=False)            # the RunRecords shown in the table (one per config)
    fields: list = field(default_factory=list)   # the dotted fields that vary between points
    superseded: dict = field(default_factory=dict, repr=False)   # run id -> attempts it replaced

    @classmethod
    def from_records(cls, name: str, records, keys=None) -> "SweepResult":
        """From a sweep's RunRecords; ``keys``: only runs of these config keys (a sweep's plan)."""
        if keys is not None:
            keys = set(keys)
            records = [r for r in records if config_key(r.config_dict) in keys]
        chosen, replaced = _pick(records)
        chosen.sort(key=lambda r: (r.created, r.id))
        fields = []
        for r in chosen:
            for path in (r.point or {}):
                if path != "seed" and path not in fields:
                    fields.append(path)
        return cls(name=name, records=chosen, fields=fields, superseded=replaced)

    @classmethod
    def from_store(cls, store, sweep: str) -> "SweepResult":
        """The result of the sweep named (or with id) ``sweep`` in ``store``; KeyError if it has no runs."""
        if not isinstance(sweep, str) or not sweep:
            raise ValueError(f"sweep: expected a sweep name or id, got {sweep!r}")
        records = store.runs(sweep_id=sweep)
        if not records:
            raise KeyError(f"sweep: no runs of a sweep {sweep!r} in {store.path}")
        return cls.from_records(sweep, records)

    # ------------------------------------------------------------------ views

    @property
    def table(self) -> list[dict]:
        """One dict per run: the point's fields, seed, final metrics, status, message, seconds, run_id, name."""
        rows = []
        for r in self.records:
            point = dict(r.point or {})
            seed = point.pop("seed", None)
            rows.append({**point, "seed": seed, **r.final, "status": r.status, "message": r.message,
                         "seconds": _seconds(r), "run_id": r.id, "name": r.name, "worker": r.worker})
        return rows

    @property
    def metrics(self) -> list[str]:
        """The numeric final metrics of the finished runs, in first-seen order."""
        out = []
        for r in self.records:
            if r.status == "finished":
                out += [k for k, v in r.final.items() if _number(v) and k not in out]
        return out

    @property
    def summary(self) -> list[dict]:
        """One dict per point (fields without the seed): seeds, ``n_runs``, ``n_finished``, a count per
        other status, and ``<metric>_mean/_std/_min/_max/_count`` over the finished runs."""
        groups: dict[str, dict] = {}
        for r in self.records:             # a point = the config but its seed (runs of another base stay apart)
            point = {k: v for k, v in (r.point or {}).items() if k != "seed"}
            key = config_key(_without_seed(r.config_dict))
            g = groups.setdefault(key, {"point": point, "records": []})
            g["records"].append(r)
        metrics = self.metrics
        out = []
        for g in groups.values():
            recs = g["records"]
            row = {**g["point"], "seeds": [(r.point or {}).get("seed") for r in recs], "n_runs": len(recs),
                   "n_finished": sum(r.status == "finished" for r in recs)}
            for status in COUNTED:
                row[f"n_{status}"] = sum(r.status == status for r in recs)
            row["n_active"] = sum(r.status in ACTIVE for r in recs)
            row["n_superseded"] = sum(self.superseded.get(r.id, 0) for r in recs)
            done = [r for r in recs if r.status == "finished"]
            for m in metrics:
                row.update(_stats(m, [r.final.get(m) for r in done]))
            out.append(row)
        return out

    def best(self, metric: str, mode: str = "max") -> dict | None:
        """The summary row with the best ``<metric>_mean`` (``mode`` "max" or "min"); None if no point
        has a finished run with that metric."""
        if mode not in ("max", "min"):
            raise ValueError(f"mode: expected 'max' or 'min', got {mode!r}")
        if not isinstance(metric, str):
            raise TypeError(f"metric: expected a str, got {type(metric).__name__}")
        if self.records and metric not in self.metrics and any(r.status == "finished" for r in self.records):
            raise ValueError(f"metric: {metric!r} is not a final metric of this sweep; it has: {', '.join(self.metrics)}")
        rows = [row for row in self.summary if row.get(f"{metric}_count", 0) > 0]
        if not rows:
            return None
        pick = max if mode == "max" else min
        return pick(rows, key=lambda row: row[f"{metric}_mean"])

    def format_summary(self, metrics=("test_accuracy", "test_loss")) -> str:
        """The summary as an aligned text table (the CLI prints this)."""
        metrics = [m for m in metrics if m in self.metrics]
        head = self.fields + ["runs", "ok", "failed", "diverged", "pruned", "stopped"] + \
            [f"{m} mean+-std (n)" for m in metrics]
        rows = []
        for s in self.summary:
            cells = [str(s.get(f)) for f in self.fields]
            cells += [str(s[k]) for k in ("n_runs", "n_finished", "n_failed", "n_diverged", "n_pruned", "n_stopped")]
            for m in metrics:
                n = s.get(f"{m}_count", 0)
                cells.append(f"{s[f'{m}_mean']:.4f} +- {s[f'{m}_std']:.4f} ({n})" if n else "-")
            rows.append(cells)
        widths = [max(len(h), *(len(r[i]) for r in rows)) if rows else len(h) for i, h in enumerate(head)]
        lines = ["  ".join(h.ljust(w) for h, w in zip(head, widths))]
        lines += ["  ".join(c.ljust(w) for c, w in zip(r, widths)) for r in rows]
        return "\n".join(lines)


def _without_seed(config_dict: dict) -> dict:
    optim = {k: v for k, v in config_dict.get("optim", {}).items() if k != "seed"}
    return {**config_dict, "optim": optim}


def _stats(metric: str, values) -> dict:
    xs = np.array([float(v) for v in values if _number(v)], dtype=np.float64)
    n = len(xs)
    if n == 0:
        return {f"{metric}_{s}": (0 if s == "count" else math.nan) for s in STATS}
    return {f"{metric}_mean": float(xs.mean()), f"{metric}_std": float(xs.std(ddof=1)) if n > 1 else 0.0,
            f"{metric}_min": float(xs.min()), f"{metric}_max": float(xs.max()), f"{metric}_count": n}
