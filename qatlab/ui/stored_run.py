"""A stored run seen as a run: what the Overview, Quantization and Phases tabs read, from the run store.

:class:`StoredRun` has the attributes the views read from a live run (``id name status message
config log owner done steps_done total_steps progress elapsed steps_per_second eta keep_alive``,
``weight_snapshot()``, ``join()``, ``result()``), filled once from a :class:`~qatlab.store.RunStore`:
its ``log`` (:class:`StoredLog`) holds ``store.history(id)``. It is a snapshot: ``done`` is True
(nothing more arrives to it), even for a run that another process is still training.

The page never shows a server file path: :func:`scrub_paths` cuts absolute paths in messages
down to their last part, :func:`public_config` does the same to ``data.path``.
"""
from __future__ import annotations

import copy
import math
import os
import re

import numpy as np

from ..metrics import MetricsLog
from ..progress import RunProgress

# An absolute path of two or more parts (not a URL's ``//host``, not ``steps/s``).
_PATH = re.compile(r"(?<![\w.:/~-])/(?:[^\s/'\"`]+/)+[^\s/'\"`]*")


def scrub_paths(text: str) -> str:
    """``text`` with every absolute file path replaced by its last part (``/home/u/x.npz`` -> ``x.npz``)."""
    return _PATH.sub(lambda m: os.path.basename(m.group(0).rstrip("/")) or "…", text or "")


def public_config(config: dict) -> dict:
    """A copy of a config dict that the page may show: ``data.path`` cut to the file's name."""
    out = copy.deepcopy(config)
    data = out.get("data")
    if isinstance(data, dict) and data.get("path"):
        data["path"] = os.path.basename(str(data["path"]))
    return out


class StoredLog(MetricsLog):
    """A MetricsLog holding a stored history (``{"row_id", column: float64 (n,)}``, as
    ``RunStore.history`` returns it), read-only.

    Filled in one go (a row-by-row ``append`` of a 100k-row history took seconds): the history's
    arrays become the log's column buffers, so every MetricsLog read (``since``, ``columns``,
    ``last``, ``keys``, ``total_rows``) works unchanged.
    """

    def __init__(self, history: dict):
        super().__init__()
        if "row_id" not in history:
            raise ValueError("history: expected RunStore.history() columns with a 'row_id' column")
        cols = {k: np.asarray(v, dtype=np.float64) for k, v in history.items()}
        n = len(cols["row_id"])
        if any(len(v) != n for v in cols.values()):
            raise ValueError("history: columns of different lengths")
        self._cols = {"row_id": cols.pop("row_id"), **cols}
        self._n = n
        self._next_id = int(self._cols["row_id"][-1]) + 1 if n else 0

    def append(self, row: dict) -> None:
        raise TypeError("StoredLog: a stored run's log is read-only")


def _last_finite(col) -> float:
    if col is None:
        return math.nan
    finite = col[np.isfinite(col)]
    return float(finite[-1]) if len(finite) else math.nan


def planned_steps(status: str, steps: int, last_epoch: float, epochs: int) -> int:
    """The run's planned steps: its steps when finished, else estimated from the fraction of an
    epoch reached (``step / epoch`` steps per epoch); ``steps`` when nothing tells."""
    if status == "finished" or not (math.isfinite(last_epoch) and last_epoch > 0):
        return steps
    return max(steps, int(round(steps / last_epoch * epochs)))


def _timestamp(dt) -> float | None:
    return None if dt is None else dt.timestamp()


class StoredRun(RunProgress):
    """One run of the store, read once: record and history (see the module doc).

    Args:
        store: a :class:`~qatlab.store.RunStore`.
        run_id: the run's id (``KeyError`` if the store has no such run).
    """

    keep_alive = False
    done = True

    def __init__(self, store, run_id: str):
        record = store.get(run_id)
        if record.config is None:
            raise ValueError(f"run_id: run {run_id!r} has a config this qatlab cannot read")
        self.record = record
        self.id, self.name, self.notes = record.id, record.name, record.notes
        self.status = record.status
        self.message = scrub_paths(record.message)
        self.config = record.config
        self.owner = record.owner.get("page")
        history = store.history(run_id)
        self.log = StoredLog(history)
        step = _last_finite(history.get("step"))
        final_steps = record.final.get("steps")
        self.steps_done = int(final_steps) if isinstance(final_steps, (int, float)) and math.isfinite(final_steps) \
            else (int(step) if math.isfinite(step) else 0)
        self.total_steps = planned_steps(self.status, self.steps_done, _last_finite(history.get("epoch")),
                                         self.config.optim.epochs)
        self.log.meta.update(config=public_config(record.config_dict), total_steps=self.total_steps)
        if self.config.phase.enabled and isinstance(record.final.get("history_bytes"), (int, float)):
            self.log.meta["phase_history"] = {"storage": self.config.phase.history_storage,
                                              "bytes": int(record.final["history_bytes"])}
        self.started_at = _timestamp(record.started) or _timestamp(record.created)
        end = record.ended or record.heartbeat
        self.finished_at = _timestamp(end) if end is not None else self.started_at

    def weight_snapshot(self):
        """None: a stored run has no live weights (its model is in the store)."""
        return None

    def join(self, timeout: float | None = None) -> bool:
        return True

    def result(self):
        """A RunResult of what the store holds (history, final metrics, status; no model)."""
        from ..train.result import RunResult
        return RunResult(history=self.log.columns(), final=dict(self.record.final), model=None,
                         status=self.status, message=self.message, config=public_config(self.record.config_dict))

    def __repr__(self) -> str:
        return f"StoredRun({self.id!r}, status={self.status!r}, rows={len(self.log)})"
