"""RunResult: what a run leaves (history, final metrics, model, status), shared by the loop and its callers."""
from __future__ import annotations

from dataclasses import dataclass, field


@dataclass
class RunResult:
    """What a finished run leaves: ``history`` {column: array (rows,)}, ``final`` metrics, the model."""

    history: dict
    final: dict
    model: object = None
    status: str = "finished"
    message: str = ""
    config: dict = field(default_factory=dict)
