"""RunProgress: how far a run is, from its step counts and wall-clock times.

Shared by the in-process :class:`~qatlab.runs.Run` and the Dask
:class:`~qatlab.executor.RemoteRun`, which fill ``steps_done``, ``total_steps``, ``started_at``
and ``finished_at`` (``time.time()``, None until they happen) each in their own way.
"""
from __future__ import annotations

import time


class RunProgress:
    """Mixin: ``progress``, ``elapsed``, ``steps_per_second`` and ``eta`` of a run."""

    steps_done: int
    total_steps: int
    started_at: float | None
    finished_at: float | None

    @property
    def progress(self) -> float:
        """Share of the planned steps done, 0..1."""
        return self.steps_done / self.total_steps if self.total_steps else 0.0

    @property
    def elapsed(self) -> float:
        """Seconds since start (until the run ended)."""
        if self.started_at is None:
            return 0.0
        return (self.finished_at or time.time()) - self.started_at

    @property
    def steps_per_second(self) -> float:
        return self.steps_done / self.elapsed if self.elapsed > 0 else 0.0

    @property
    def eta(self) -> float:
        """Estimated seconds left (nan before the first steps)."""
        rate = self.steps_per_second
        return (self.total_steps - self.steps_done) / rate if rate > 0 else float("nan")
