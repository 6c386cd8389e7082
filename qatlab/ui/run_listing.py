"""The Runs table's view of the store: one light :class:`Listed` per run, read cheaply once a second.

``RunStore.runs()`` builds an ExperimentConfig per run, too slow for a table refreshed every second
by every page; the table reads ``RunStore.listing()`` (raw rows, one query) into :class:`Listed`
instead. A run's config never changes, so its table columns are computed from the config's JSON
once per process (:func:`config_columns`, cached by run id).
"""
from __future__ import annotations

import datetime as _dt
import json
import math
from dataclasses import dataclass

_CACHE_LIMIT = 50_000          # cached runs' config columns (one small dict each)
_columns_cache: dict[str, dict] = {}


@dataclass
class Listed:
    """One run of the listing: the RunRecord fields the table needs, plus ``has_model``."""

    id: str
    name: str
    notes: str
    status: str
    config_dict: dict
    created: float
    started: float | None
    ended: float | None
    message: str
    page: str | None
    worker: str | None
    sweep_id: str | None
    final: dict
    heartbeat: float | None
    n_rows: int
    has_model: bool

    @classmethod
    def from_row(cls, row: tuple) -> "Listed":
        (rid, name, notes, status, config, created, started, ended, message, page, worker, sweep_id, final,
         heartbeat, n_rows, has_model) = row
        cached = _columns_cache.get(rid)
        config_dict = cached["_config"] if cached is not None else json.loads(config)
        return cls(rid, name, notes or "", status, config_dict, created, started, ended, message or "", page, worker,
                   sweep_id, json.loads(final or "{}"), heartbeat, n_rows, bool(has_model))

    @property
    def columns(self) -> dict:
        """The run's config columns (:func:`config_columns`), computed once per run id."""
        cached = _columns_cache.get(self.id)
        if cached is None:
            if len(_columns_cache) >= _CACHE_LIMIT:
                _columns_cache.clear()
            cached = _columns_cache[self.id] = {**config_columns(self.config_dict), "_config": self.config_dict}
        return cached


def _get(d: dict, section: str, key: str, default=None):
    sub = d.get(section)
    return sub.get(key, default) if isinstance(sub, dict) else default


def bits_of(weights, weight_bits) -> str:
    """Weight precision: ``k-bit`` for fake weights, else ``ternary`` / ``float``."""
    return f"{weight_bits}-bit" if weights == "fake" else str(weights)


def config_columns(cfg: dict) -> dict:
    """The table's columns of a config dict (``ExperimentConfig.to_dict()``): data, model, quantization
    (bits only for fake weights; per channel only for fake weights; a scale mode only with a fake
    quantizer), optimizer and phase; ``-`` where a setting does not apply."""
    weights, acts = _get(cfg, "quant", "weights"), _get(cfg, "quant", "activations")
    fake = weights == "fake" or acts == "fake"
    hidden = _get(cfg, "model", "hidden", [])
    return {
        "dataset": _get(cfg, "data", "dataset", "-"),
        "hidden": "-".join(map(str, hidden)) if isinstance(hidden, list) else str(hidden),
        "weights": weights,
        "bits": bits_of(weights, _get(cfg, "quant", "weight_bits")),
        "activations": f"{_get(cfg, 'quant', 'activation_bits')}-bit" if acts == "fake" else "off",
        "per channel": ("yes" if _get(cfg, "quant", "per_channel") else "no") if weights == "fake" else "-",
        "scale mode": _get(cfg, "quant", "scale_mode", "-") if fake else "-",
        "ste": _get(cfg, "quant", "ste"),
        "optimizer": _get(cfg, "optim", "optimizer"),
        "lr": _get(cfg, "optim", "lr", math.nan),
        "batch": _get(cfg, "optim", "batch_size"),
        "epochs": _get(cfg, "optim", "epochs"),
        "phase": bool(_get(cfg, "phase", "enabled", False)),
    }


def utc_minutes(t: float | None) -> str:
    """``2026-11-26T04:30Z`` (UTC, ISO to the minute); empty when unknown."""
    if t is None:
        return ""
    return _dt.datetime.fromtimestamp(t, _dt.timezone.utc).strftime("%Y-%m-%dT%H:%MZ")
