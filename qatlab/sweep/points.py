"""A sweep's points: grid and random values of dotted config fields, times seeds, each a checked config.

``expand(base, grid, random, seeds)`` returns :class:`Point` s in run order (every point for the
first seed, then every point for the next: a first look at all points comes early). Each point's
config is a copy of ``base`` with its fields set and ``optim.seed`` = its seed, validated; a bad
field path or value raises ``ValueError`` naming the field and the point, before anything runs.
"""
from __future__ import annotations

import itertools
import json
import math
import numbers
from dataclasses import dataclass

import numpy as np

from ..config import ExperimentConfig, _Config
from ..quant.ste import SteKind

SEED_FIELD = "optim.seed"
RANGE_KINDS = ("uniform", "log_uniform", "int")
MAX_POINTS = 100_000


@dataclass(frozen=True)
class Point:
    """One run of a sweep: its field values, seed and config (``index``: its place in the plan)."""

    index: int
    fields: dict
    seed: int
    config: ExperimentConfig

    @property
    def point(self) -> dict:
        """What the store keeps as the run's point: the dotted fields and the seed."""
        return {**self.fields, "seed": self.seed}

    @property
    def key(self) -> str:
        return config_key(self.config.to_dict())

    def label(self) -> str:
        """A short run name: the last part of each field name with its value, and the seed."""
        parts = [f"{path.rsplit('.', 1)[-1]}={_short(v)}" for path, v in self.fields.items()]
        text = " ".join(parts + [f"seed={self.seed}"]).replace("<", "(").replace(">", ")")
        return text if len(text) <= 80 else text[:79] + "\u2026"


def config_key(config_dict: dict) -> str:
    """The canonical JSON of a config dict: equal configs give equal keys (resume compares these)."""
    return json.dumps(config_dict, sort_keys=True)


def flat_fields(config) -> dict:
    """``{dotted field: value}`` of an ExperimentConfig or its dict (``{"quant.ste": "tanh", ...}``)."""
    d = config.to_dict() if isinstance(config, _Config) else config
    if not isinstance(d, dict):
        raise TypeError(f"config: expected an ExperimentConfig or its dict, got {type(config).__name__}")
    out = {}
    for key, value in d.items():
        if isinstance(value, dict):
            out.update({f"{key}.{k}": v for k, v in flat_fields(value).items()})
        else:
            out[key] = value
    return out


def config_diff(a, b) -> dict:
    """The dotted fields whose values differ between two configs (or dicts): ``{field: (a's, b's)}``;
    a field only one of them has shows None on the other side."""
    fa, fb = flat_fields(a), flat_fields(b)
    return {k: (fa.get(k), fb.get(k)) for k in sorted(set(fa) | set(fb)) if fa.get(k) != fb.get(k)}


def _short(value) -> str:
    return f"{value:.3g}" if isinstance(value, float) else str(value)


def plain(value):
    """A JSON-ready value for a config field (numpy scalars, SteKind, tuples -> Python types)."""
    if isinstance(value, np.generic):
        return value.item()
    if isinstance(value, SteKind):
        return value.value
    if isinstance(value, (list, tuple)):
        return [plain(v) for v in value]
    return value


def _resolve(cfg: ExperimentConfig, path: str):
    """(section, field name) of the dotted field ``path`` in ``cfg``; ValueError naming what is wrong."""
    if not isinstance(path, str) or not path:
        raise ValueError(f"field {path!r}: expected a dotted config field name such as 'quant.ste'")
    obj, parts = cfg, path.split(".")
    for i, part in enumerate(parts):
        if part == "name" or part not in obj.param:
            known = ", ".join(k for k in obj.param if k != "name")
            where = ".".join(parts[:i]) or "the config"
            raise ValueError(f"field {path!r}: {where} has no field {part!r} (it has: {known})")
        if i < len(parts) - 1:
            obj = getattr(obj, part)
            if not isinstance(obj, _Config):
                raise ValueError(f"field {path!r}: {'.'.join(parts[:i + 1])} is a value, not a section")
    if isinstance(getattr(obj, parts[-1]), _Config):
        raise ValueError(f"field {path!r}: is a section; name one of its fields")
    return obj, parts[-1]


def set_field(cfg: ExperimentConfig, path: str, value) -> None:
    """Set the dotted field ``path`` (e.g. ``"quant.weight_bits"``) of ``cfg``; ValueError naming it."""
    obj, attr = _resolve(cfg, path)
    try:
        setattr(obj, attr, plain(value))
    except (ValueError, TypeError) as exc:
        raise ValueError(f"field {path!r}: value {value!r} refused: {' '.join(str(exc).split())}") from None


def _check_fields(fields: dict, what: str) -> None:
    if not isinstance(fields, dict):
        raise TypeError(f"{what}: expected a dict of dotted config fields, got {type(fields).__name__}")
    for path in fields:
        _resolve(ExperimentConfig(), path)
        if path == SEED_FIELD:
            raise ValueError(f"{what}: {SEED_FIELD!r} is set by seeds=, not by the {what}")


def grid_points(grid) -> list[dict]:
    """Every combination of the grid's values, in the grid's key order ([{}] for no grid)."""
    if grid is None:
        return [{}]
    _check_fields(grid, "grid")
    for path, values in grid.items():
        if isinstance(values, (str, bytes)) or not isinstance(values, (list, tuple)) or not values:
            raise ValueError(f"grid[{path!r}]: expected a non-empty list of values, got {values!r}")
    paths = list(grid)
    return [dict(zip(paths, (plain(v) for v in combo))) for combo in itertools.product(*grid.values())]


def _range_spec(path: str, spec) -> tuple | None:
    """(kind, lo, hi) when ``spec`` is a range such as ``("log_uniform", 1e-4, 1e-1)``, else None."""
    if not (isinstance(spec, (list, tuple)) and len(spec) == 3 and spec[0] in RANGE_KINDS):
        return None
    kind, lo, hi = spec
    if not all(isinstance(v, numbers.Real) and not isinstance(v, bool) and math.isfinite(v) for v in (lo, hi)):
        raise ValueError(f"random fields[{path!r}]: {kind} bounds must be finite numbers, got {lo!r}, {hi!r}")
    if not lo < hi:
        raise ValueError(f"random fields[{path!r}]: expected low < high, got {lo!r}, {hi!r}")
    if kind == "log_uniform" and lo <= 0:
        raise ValueError(f"random fields[{path!r}]: log_uniform needs low > 0, got {lo!r}")
    if kind == "int" and not (float(lo).is_integer() and float(hi).is_integer()):
        raise ValueError(f"random fields[{path!r}]: int bounds must be integers, got {lo!r}, {hi!r}")
    return kind, lo, hi


def random_points(random) -> list[dict]:
    """``random["n"]`` draws from ``random["fields"]`` with ``random["seed"]`` (same spec, same points).

    A field's spec is a range ``(kind, low, high)`` with kind ``uniform``, ``log_uniform`` or ``int``
    (both ends included), or a list of choices drawn uniformly."""
    if random is None:
        return [{}]
    if not isinstance(random, dict):
        raise TypeError(f"random: expected a dict {{'n', 'seed', 'fields'}}, got {type(random).__name__}")
    unknown = set(random) - {"n", "seed", "fields"}
    if unknown:
        raise ValueError(f"random: unknown keys {sorted(unknown)}; allowed: n, seed, fields")
    n, seed, fields = random.get("n"), random.get("seed", 0), random.get("fields")
    if isinstance(n, bool) or not isinstance(n, int) or not 1 <= n <= MAX_POINTS:
        raise ValueError(f"random['n']: expected an int in [1, {MAX_POINTS}], got {n!r}")
    if isinstance(seed, bool) or not isinstance(seed, int) or seed < 0:
        raise ValueError(f"random['seed']: expected an int >= 0, got {seed!r}")
    if not fields:
        raise ValueError("random['fields']: expected a non-empty dict of field -> range or choices")
    _check_fields(fields, "random")
    specs = {}
    for path, spec in fields.items():
        specs[path] = _range_spec(path, spec)
        if specs[path] is None and (isinstance(spec, (str, bytes)) or not isinstance(spec, (list, tuple)) or not spec):
            raise ValueError(f"random fields[{path!r}]: expected (kind, low, high) with kind in "
                             f"{', '.join(RANGE_KINDS)}, or a non-empty list of choices; got {spec!r}")
    rng = np.random.default_rng(seed)
    out = []
    for _ in range(n):
        draw = {}
        for path, spec in fields.items():
            rs = specs[path]
            if rs is None:
                draw[path] = plain(spec[int(rng.integers(len(spec)))])
            elif rs[0] == "uniform":
                draw[path] = float(rng.uniform(rs[1], rs[2]))
            elif rs[0] == "log_uniform":
                draw[path] = float(math.exp(rng.uniform(math.log(rs[1]), math.log(rs[2]))))
            else:
                draw[path] = int(rng.integers(int(rs[1]), int(rs[2]) + 1))
        out.append(draw)
    return out


def check_seeds(seeds) -> list[int]:
    if isinstance(seeds, (str, bytes)) or not hasattr(seeds, "__iter__"):
        raise TypeError(f"seeds: expected a list of ints, got {seeds!r}")
    seeds = list(seeds)
    if not seeds:
        raise ValueError("seeds: expected at least one seed")
    for s in seeds:
        if isinstance(s, bool) or not isinstance(s, (int, np.integer)) or not 0 <= s <= 2**31 - 1:
            raise ValueError(f"seeds: each seed is an int in [0, 2**31 - 1], got {s!r}")
    if len(set(seeds)) != len(seeds):
        raise ValueError(f"seeds: repeated seeds in {seeds}")
    return [int(s) for s in seeds]


def expand(base: ExperimentConfig, grid=None, random=None, seeds=(0,)) -> list[Point]:
    """Every (grid x random) point times every seed, as checked configs (duplicates run once)."""
    if not isinstance(base, ExperimentConfig):
        raise TypeError(f"base: expected an ExperimentConfig, got {type(base).__name__}")
    base.validate()
    seeds = check_seeds(seeds)
    grid_list, random_list = grid_points(grid), random_points(random)
    if grid and random and set(grid) & set(random["fields"]):
        raise ValueError(f"random: fields {sorted(set(grid) & set(random['fields']))} are in the grid too")
    combos = [{**g, **r} for g in grid_list for r in random_list]
    if len(combos) * len(seeds) > MAX_POINTS:
        raise ValueError(f"grid/random/seeds: {len(combos) * len(seeds)} runs, more than {MAX_POINTS}")
    points, seen = [], set()
    for seed in seeds:
        for n, fields in enumerate(combos):
            cfg = base.copy()
            where = f"point {n} {fields | {'seed': seed}}"
            try:
                for path, value in fields.items():
                    set_field(cfg, path, value)
                cfg.optim.seed = seed
                cfg.validate()
            except (ValueError, TypeError) as exc:
                raise ValueError(f"{where}: {' '.join(str(exc).split())}") from None
            point = Point(len(points), dict(fields), seed, cfg)
            if point.key not in seen:
                seen.add(point.key)
                points.append(point)
    return points
