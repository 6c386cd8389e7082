"""RunProgress: how far a run is, from its step counts and wall-clock times.

Shared by the in-process :class:`~qatlab.runs.LocalRun` and the Dask
:class:`~qatlab.executor.RemoteRun`, which fill ``steps_done``, ``total_steps``, ``started_at``
and ``finished_at`` (``time.time()``, None until they happen) each in their own way. Time spent
paused (``_pause_began``/``_pause_ended``) does not count as elapsed, so the rate and ETA hold
still while a run is paused.
"""
from __future__ import annotations

import time


class RunProgress:
    """Mixin: ``progress``, ``elapsed``, ``steps_per_second`` and ``eta`` of a run."""

    steps_done: int
    total_steps: int
    started_at: float | None
    finished_at: float | None
    paused_seconds: float = 0.0       # closed pauses, summed
    paused_since: float | None = None  # start of the open pause, if any

    def _pause_began(self, now: float | None = None) -> None:
        """Record that the run is paused from ``now`` (a second call keeps the first time)."""
        if self.paused_since is None:
            self.paused_since = time.time() if now is None else now

    def _pause_ended(self, now: float | None = None) -> None:
        """Close the open pause, adding its length to ``paused_seconds``."""
        if self.paused_since is not None:
            now = time.time() if now is None else now
            self.paused_seconds += max(0.0, now - self.paused_since)
            self.paused_since = None

    @property
    def progress(self) -> float:
        """Share of the planned steps done, 0..1."""
        return self.steps_done / self.total_steps if self.total_steps else 0.0

    @property
    def elapsed(self) -> float:
        """Seconds spent running since start (until the run ended), pauses left out."""
        if self.started_at is None:
            return 0.0
        end = self.finished_at or time.time()
        paused = self.paused_seconds
        if self.paused_since is not None:  # still paused (or ended while paused)
            paused += max(0.0, end - self.paused_since)
        return max(0.0, end - self.started_at - paused)

    @property
    def steps_per_second(self) -> float:
        return self.steps_done / self.elapsed if self.elapsed > 0 else 0.0

    @property
    def eta(self) -> float:
        """Estimated seconds left (nan before the first steps)."""
        rate = self.steps_per_second
        return (self.total_steps - self.steps_done) / rate if rate > 0 else float("nan")
