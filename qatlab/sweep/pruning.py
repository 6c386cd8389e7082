"""The median stopping rule: a run whose best metric so far is worse than the median of the other
runs' best at the same step is stopped and kept as ``pruned``.

A run is judged at the latest step of its metrics rows that at least ``min_others`` other runs of
the sweep have reached (running, finished or pruned ones; failed and diverged ones are not a
reference), once it has ``grace`` rows. Like Optuna's MedianPruner and Vizier's rule it prunes
up to about half of the runs whose curves differ only by noise; it is meant for points that are
plainly worse.
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np


@dataclass(frozen=True)
class Curve:
    """A run's metric over its rows: steps (increasing) and the best value up to each step."""

    steps: np.ndarray
    best: np.ndarray

    def __len__(self) -> int:
        return len(self.steps)

    def best_at(self, step: float) -> float | None:
        """The best value at or before ``step`` (None if the run has no row by then)."""
        i = int(np.searchsorted(self.steps, step, side="right"))
        return None if i == 0 else float(self.best[i - 1])


@dataclass(frozen=True)
class MedianStopping:
    """Median stopping rule settings.

    metric: a metrics-row column (e.g. ``"loss"``, ``"test_accuracy"``); mode: ``"min"`` or ``"max"``;
    grace: rows a run has before it may be pruned; min_others: other runs that must have reached
    the step for the median to count.
    """

    metric: str = "loss"
    mode: str = "min"
    grace: int = 5
    min_others: int = 2

    def __post_init__(self):
        if not isinstance(self.metric, str) or not self.metric:
            raise ValueError(f"early_stopping.metric: expected a metrics column name, got {self.metric!r}")
        if self.mode not in ("min", "max"):
            raise ValueError(f"early_stopping.mode: expected 'min' or 'max', got {self.mode!r}")
        for name in ("grace", "min_others"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or not 1 <= value <= 1_000_000:
                raise ValueError(f"early_stopping.{name}: expected an int in [1, 1000000], got {value!r}")

    @classmethod
    def of(cls, spec) -> "MedianStopping | None":
        """None, a MedianStopping, or a dict of its fields (``{"metric": "loss", "mode": "min", "grace": 5}``)."""
        if spec is None or isinstance(spec, cls):
            return spec
        if isinstance(spec, dict):
            unknown = set(spec) - {"rule", "metric", "mode", "grace", "min_others"}
            if unknown:
                raise ValueError(f"early_stopping: unknown keys {sorted(unknown)}; allowed: rule, metric, mode, "
                                 "grace, min_others")
            if spec.get("rule", "median") != "median":
                raise ValueError(f"early_stopping.rule: only 'median' is available, got {spec['rule']!r}")
            return cls(**{k: v for k, v in spec.items() if k != "rule"})
        raise TypeError(f"early_stopping: expected None, a MedianStopping or a dict, got {type(spec).__name__}")

    def curve(self, history: dict) -> Curve:
        """The metric's curve from a history ``{column: array}`` (rows without the metric are skipped)."""
        steps, values = history.get("step"), history.get(self.metric)
        if steps is None or values is None:
            return Curve(np.empty(0), np.empty(0))
        keep = np.isfinite(steps) & np.isfinite(values)
        steps, values = np.asarray(steps)[keep], np.asarray(values)[keep]
        order = np.argsort(steps, kind="stable")
        acc = np.minimum.accumulate if self.mode == "min" else np.maximum.accumulate
        return Curve(steps[order], acc(values[order]) if len(values) else values)

    def judge(self, own: Curve, others) -> float | None:
        """The step at which ``own`` is pruned given the other runs' curves, or None to let it go on."""
        if len(own) < self.grace:
            return None
        reach = sorted((c.steps[-1] for c in others if len(c)), reverse=True)
        if len(reach) < self.min_others:
            return None
        horizon = reach[self.min_others - 1]          # a step at least min_others others reached
        i = int(np.searchsorted(own.steps, horizon, side="right")) - 1
        if i < self.grace - 1:
            return None
        step = own.steps[i]
        ref = [b for c in others if len(c) and c.steps[-1] >= step and (b := c.best_at(step)) is not None]
        if len(ref) < self.min_others:
            return None
        median = float(np.median(ref))
        mine = float(own.best[i])
        worse = mine > median if self.mode == "min" else mine < median
        return float(step) if worse else None
