"""The benchmark harness shared by every ``python -m qatlab.bench`` suite.

What it gives a suite:

* :func:`measure` / :func:`measure_many` -- warm up, pick a loop count so one
  sample lasts at least ``min_time``, take ``repeats`` samples and summarise
  them as a :class:`Measurement` (median, min, IQR and MAD, in seconds per
  call). :func:`measure_many` interleaves the samples of several functions
  round-robin, so things compared side by side see the same machine load.
* :func:`machine_info` / :func:`machine_line` -- CPU model, cores, Python,
  numpy, numba and torch versions, Numba threading layer, load average.
* :class:`Table` / :func:`format_table` -- aligned text tables whose rows are
  plain dicts (the same dicts go into the JSON, with every raw field).
* :class:`Goal` -- a target the suite checks; printed as a PASS / MISS / SKIP line.
* :func:`write_json` -- strict JSON (NaN/inf become ``null``), written atomically.
* the suite registry: :func:`suite` registers a function under a name;
  :func:`load_suite` imports ``qatlab.bench.<name>`` lazily on first use and
  raises :class:`SuiteNotAvailable` when that module does not exist yet.

A suite is a function ``fn(opts: BenchOptions) -> SuiteResult``::

    from qatlab.bench.kit import BenchOptions, Column, Goal, SuiteResult, Table, measure, suite

    @suite("train", description="SteTrainer steps per second")
    def run(opts: BenchOptions) -> SuiteResult:
        m = measure(step, repeats=opts.repeats, warmup=opts.warmup, min_time=opts.min_time)
        row = {"what": "step", "us_per_call": m.median * 1e6, **m.to_dict()}
        table = Table("train", [Column("what", "what"), Column("us_per_call", "us/call", "{:.1f}")], [row])
        return SuiteResult(tables=[table], goals=[Goal("step < 1 ms", m.median < 1e-3, f"{m.median*1e3:.2f} ms")])
"""
from __future__ import annotations

import dataclasses
import datetime as _dt
import importlib
import json
import math
import numbers
import os
import platform
import statistics
import time
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import Any

# ----------------------------------------------------------------------------- measuring


@dataclasses.dataclass(frozen=True)
class Measurement:
    """Summary of ``repeats`` timing samples, each the mean seconds per call over ``number`` calls.

    ``iqr`` is the inter-quartile range (q3 - q1) and ``mad`` the median absolute
    deviation of the samples, both in seconds; ``rel_spread`` is ``iqr / median``.
    """

    median: float
    min: float
    max: float
    q1: float
    q3: float
    mad: float
    repeats: int
    number: int
    samples: tuple[float, ...]

    @property
    def iqr(self) -> float:
        """Inter-quartile range of the samples, seconds."""
        return self.q3 - self.q1

    @property
    def rel_spread(self) -> float:
        """IQR as a fraction of the median (0.05 = 5 %); nan when the median is 0."""
        return self.iqr / self.median if self.median > 0 else math.nan

    @classmethod
    def from_samples(cls, samples: Sequence[float], number: int = 1) -> "Measurement":
        """Summarise per-call times ``samples`` (seconds, at least one) taken with ``number`` calls each."""
        xs = sorted(float(s) for s in samples)
        if not xs:
            raise ValueError("samples: need at least one timing sample")
        med = statistics.median(xs)
        q1, q3 = _quartiles(xs)
        mad = statistics.median(abs(x - med) for x in xs)
        return cls(median=med, min=xs[0], max=xs[-1], q1=q1, q3=q3, mad=mad,
                   repeats=len(xs), number=int(number), samples=tuple(samples))

    def per(self, n: int) -> "Measurement":
        """The same samples divided by ``n``: time per step of a call that makes ``n`` steps."""
        return Measurement.from_samples([x / n for x in self.samples], self.number)

    def to_dict(self) -> dict[str, Any]:
        """Plain dict of every field (seconds), for JSON rows."""
        return {"median_s": self.median, "min_s": self.min, "max_s": self.max, "iqr_s": self.iqr,
                "mad_s": self.mad, "rel_spread": self.rel_spread, "repeats": self.repeats,
                "number": self.number, "samples_s": list(self.samples)}


def _quartiles(xs: Sequence[float]) -> tuple[float, float]:
    """(q1, q3) of sorted ``xs`` by linear interpolation (numpy's default percentile method)."""
    def pct(p: float) -> float:
        pos = p * (len(xs) - 1)
        lo = math.floor(pos)
        hi = min(lo + 1, len(xs) - 1)
        return xs[lo] + (xs[hi] - xs[lo]) * (pos - lo)
    return pct(0.25), pct(0.75)


def _time_batch(fn: Callable[[], Any], number: int, timer: Callable[[], float]) -> float:
    t0 = timer()
    for _ in range(number):
        fn()
    return timer() - t0


def calibrate(fn: Callable[[], Any], min_time: float, *, timer: Callable[[], float] = time.perf_counter,
              max_number: int = 10_000_000) -> int:
    """Smallest loop count (roughly) for which ``number`` calls of ``fn`` take >= ``min_time`` seconds.

    Starts from one call and scales up from the measured batch time; the
    batches it runs double as warm-up. ``min_time <= 0`` gives 1.
    """
    number = 1
    while True:
        t = _time_batch(fn, number, timer)
        if t >= min_time or number >= max_number:
            return number
        if t <= 0:
            grow = number * 10
        else:
            grow = math.ceil(number * min_time / t * 1.05)
        number = min(max_number, max(number + 1, grow))


def measure_many(fns: Mapping[str, Callable[[], Any]], *, repeats: int = 7, warmup: int = 1,
                 min_time: float = 0.05, number: int | None = None,
                 timer: Callable[[], float] = time.perf_counter) -> dict[str, Measurement]:
    """Time several zero-argument callables side by side; returns ``{key: Measurement}``.

    Each function is called ``warmup`` times, then its loop count is calibrated
    (:func:`calibrate`, unless ``number`` is given), then ``repeats`` rounds are
    taken; in every round each function is timed once (``number`` calls), in
    the order given. Interleaving means a burst of load from elsewhere on the
    machine hits all of them alike instead of one.
    """
    if repeats < 1:
        raise ValueError(f"repeats: must be >= 1, got {repeats}")
    if warmup < 0:
        raise ValueError(f"warmup: must be >= 0, got {warmup}")
    if number is not None and number < 1:
        raise ValueError(f"number: must be >= 1 or None, got {number}")
    numbers: dict[str, int] = {}
    for key, fn in fns.items():
        for _ in range(warmup):
            fn()
        numbers[key] = number if number is not None else calibrate(fn, min_time, timer=timer)
    samples: dict[str, list[float]] = {key: [] for key in fns}
    for _ in range(repeats):
        for key, fn in fns.items():
            samples[key].append(_time_batch(fn, numbers[key], timer) / numbers[key])
    return {key: Measurement.from_samples(samples[key], numbers[key]) for key in fns}


def measure(fn: Callable[[], Any], *, repeats: int = 7, warmup: int = 1, min_time: float = 0.05,
            number: int | None = None, timer: Callable[[], float] = time.perf_counter) -> Measurement:
    """Time one zero-argument callable: warm up, calibrate, take ``repeats`` samples (seconds per call).

    See :func:`measure_many` for the meaning of each argument.
    """
    return measure_many({"fn": fn}, repeats=repeats, warmup=warmup, min_time=min_time,
                        number=number, timer=timer)["fn"]


# ----------------------------------------------------------------------------- machine


def _cpu_model() -> str:
    try:
        with open("/proc/cpuinfo", encoding="utf-8", errors="replace") as f:
            for line in f:
                if line.lower().startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine() or "unknown"


def _dist_version(name: str) -> str | None:
    try:
        from importlib.metadata import PackageNotFoundError, version
    except ImportError:  # pragma: no cover
        return None
    try:
        return version(name)
    except PackageNotFoundError:
        return None


def machine_info() -> dict[str, Any]:
    """Facts that make a benchmark result interpretable: CPU, cores, library versions, threading.

    torch's version is read from the installed distribution metadata, so this
    never imports torch.
    """
    import numba
    import numpy

    try:
        usable = len(os.sched_getaffinity(0))
    except (AttributeError, OSError):
        usable = os.cpu_count()
    try:
        load = [round(v, 2) for v in os.getloadavg()]
    except OSError:
        load = None
    return {
        "cpu": _cpu_model(),
        "logical_cpus": os.cpu_count(),
        "usable_cpus": usable,
        "platform": platform.platform(),
        "python": platform.python_version(),
        "numpy": numpy.__version__,
        "numba": numba.__version__,
        "torch": _dist_version("torch"),
        "numba_threading_layer": os.environ.get("NUMBA_THREADING_LAYER", numba.config.THREADING_LAYER),
        "numba_num_threads": numba.config.NUMBA_NUM_THREADS,
        "loadavg": load,
    }


def machine_line(info: Mapping[str, Any] | None = None) -> str:
    """One-line summary of :func:`machine_info` for the top of a printed report."""
    m = dict(machine_info() if info is None else info)
    load = m.get("loadavg")
    parts = [
        f"CPU {m['cpu']}",
        f"{m['usable_cpus']}/{m['logical_cpus']} cores",
        f"python {m['python']}",
        f"numpy {m['numpy']}",
        f"numba {m['numba']}",
        f"torch {m['torch'] or 'not installed'}",
        f"NUMBA_THREADING_LAYER={m['numba_threading_layer']}",
    ]
    if load:
        parts.append("load " + " ".join(f"{v:.2f}" for v in load))
    return " | ".join(parts)


# ----------------------------------------------------------------------------- tables and goals


@dataclasses.dataclass(frozen=True)
class Column:
    """A table column: row key, header text, and a format spec (``"{:.2f}"``) or callable for values.

    Missing or ``None`` values print as ``-``; numbers are right-aligned, text left-aligned.
    """

    key: str
    header: str
    fmt: str | Callable[[Any], str] = "{}"

    def render(self, value: Any) -> str:
        """The cell text for ``value``."""
        if value is None or (isinstance(value, float) and math.isnan(value)):
            return "-"
        if callable(self.fmt):
            return self.fmt(value)
        return self.fmt.format(value)


@dataclasses.dataclass
class Table:
    """A titled table: columns to print, rows as dicts (rows may carry extra keys; JSON keeps them all)."""

    title: str
    columns: list[Column]
    rows: list[dict[str, Any]]

    def to_dict(self) -> dict[str, Any]:
        """JSON form: title, column keys/headers, and the full rows."""
        return {"title": self.title, "columns": [{"key": c.key, "header": c.header} for c in self.columns],
                "rows": self.rows}


def format_table(table: Table) -> str:
    """Render ``table`` as aligned text: title, header, rule, one line per row."""
    cols = table.columns
    cells = [[c.render(row.get(c.key)) for c in cols] for row in table.rows]
    numeric = [all(_is_number(row.get(c.key)) for row in table.rows if row.get(c.key) is not None)
               for c in cols]
    widths = [max([len(c.header)] + [len(r[i]) for r in cells]) for i, c in enumerate(cols)]

    def line(values: Sequence[str]) -> str:
        out = [v.rjust(w) if num else v.ljust(w) for v, w, num in zip(values, widths, numeric)]
        return "  ".join(out).rstrip()

    header = line([c.header for c in cols])
    rule = "  ".join("-" * w for w in widths)
    body = [line(r) for r in cells]
    return "\n".join([table.title, header, rule, *body]) if table.title else "\n".join([header, rule, *body])


def _is_number(v: Any) -> bool:
    return isinstance(v, numbers.Real) and not isinstance(v, bool)


@dataclasses.dataclass
class Goal:
    """A target a suite checks. ``passed`` None means it could not be measured in this run (SKIP)."""

    name: str
    passed: bool | None
    measured: str
    target: str = ""

    @property
    def status(self) -> str:
        """``PASS``, ``MISS`` or ``SKIP``."""
        return "SKIP" if self.passed is None else ("PASS" if self.passed else "MISS")

    def line(self) -> str:
        """``PASS  name: measured (target)``."""
        target = f" (target {self.target})" if self.target else ""
        return f"{self.status}  {self.name}: {self.measured}{target}"

    def to_dict(self) -> dict[str, Any]:
        """JSON form, including ``status``."""
        return {"name": self.name, "status": self.status, "passed": self.passed,
                "measured": self.measured, "target": self.target}


@dataclasses.dataclass
class SuiteResult:
    """What a suite returns: tables, goals, free-text notes and any extra JSON-able data."""

    tables: list[Table]
    goals: list[Goal] = dataclasses.field(default_factory=list)
    notes: list[str] = dataclasses.field(default_factory=list)
    extra: dict[str, Any] = dataclasses.field(default_factory=dict)


@dataclasses.dataclass(frozen=True)
class BenchOptions:
    """Options every suite receives. ``sizes`` None means the suite's own default problem sizes."""

    quick: bool = False
    repeats: int = 7
    warmup: int = 2
    min_time: float = 0.1
    sizes: tuple[int, ...] | None = None

    @classmethod
    def make(cls, *, quick: bool = False, repeats: int | None = None, min_time: float | None = None,
             sizes: Sequence[int] | None = None) -> "BenchOptions":
        """Defaults by mode (full: 7 repeats, 0.1 s per sample; quick: 3 repeats, 0.02 s), then overrides."""
        base = cls(quick=True, repeats=3, warmup=1, min_time=0.02) if quick else cls()
        if repeats is not None:
            if repeats < 1:
                raise ValueError(f"repeats: must be >= 1, got {repeats}")
            base = dataclasses.replace(base, repeats=int(repeats))
        if min_time is not None:
            if not min_time >= 0:
                raise ValueError(f"min_time: must be >= 0 seconds, got {min_time}")
            base = dataclasses.replace(base, min_time=float(min_time))
        if sizes is not None:
            sizes = tuple(int(s) for s in sizes)
            if not sizes or any(s < 1 for s in sizes):
                raise ValueError(f"sizes: must be positive integers, got {sizes}")
            base = dataclasses.replace(base, sizes=sizes)
        return base


def report_text(suite_name: str, result: SuiteResult, info: Mapping[str, Any] | None = None) -> str:
    """The printed report of one suite: heading, machine line, tables, notes, goal lines."""
    parts = [f"== qatlab bench: {suite_name} ==", machine_line(info)]
    for table in result.tables:
        parts += ["", format_table(table)]
    if result.notes:
        parts += [""] + [f"note: {n}" for n in result.notes]
    if result.goals:
        parts += [""] + [g.line() for g in result.goals]
    return "\n".join(parts)


def result_payload(suite_name: str, result: SuiteResult, opts: BenchOptions,
                   info: Mapping[str, Any] | None = None) -> dict[str, Any]:
    """The JSON document for one suite run."""
    return {
        "suite": suite_name,
        "created": _dt.datetime.now(_dt.timezone.utc).isoformat(timespec="seconds"),
        "machine": dict(machine_info() if info is None else info),
        "options": dataclasses.asdict(opts),
        "tables": [t.to_dict() for t in result.tables],
        "goals": [g.to_dict() for g in result.goals],
        "notes": list(result.notes),
        "extra": result.extra,
    }


# ----------------------------------------------------------------------------- JSON


def _jsonable(obj: Any) -> Any:
    """Plain-Python copy of ``obj``: numpy scalars/arrays converted, non-finite floats -> None."""
    if isinstance(obj, Mapping):
        return {str(k): _jsonable(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return [_jsonable(v) for v in obj]
    if isinstance(obj, bool) or obj is None or isinstance(obj, str):
        return obj
    if isinstance(obj, int):
        return obj
    if isinstance(obj, float):
        return obj if math.isfinite(obj) else None
    if hasattr(obj, "tolist"):  # numpy scalar or array
        return _jsonable(obj.tolist())
    if hasattr(obj, "value") and isinstance(getattr(obj, "value"), str):  # str enums (SteKind)
        return obj.value
    return str(obj)


def write_json(path: str | os.PathLike, payload: Any) -> Path:
    """Write ``payload`` as strict, indented JSON to ``path`` (parents created, atomic replace); returns the path."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    text = json.dumps(_jsonable(payload), indent=2, allow_nan=False)
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    tmp.write_text(text + "\n", encoding="utf-8")
    os.replace(tmp, path)
    return path


# ----------------------------------------------------------------------------- registry

#: Suites in the order ``all`` runs them; each lives in ``qatlab.bench.<name>``.
KNOWN_SUITES: tuple[str, ...] = ("fakequant", "train", "conv", "quality", "phase", "dashboard", "sweep", "store")

_REGISTRY: dict[str, "SuiteSpec"] = {}


@dataclasses.dataclass(frozen=True)
class SuiteSpec:
    """A registered suite: its name, the function that runs it, and a one-line description."""

    name: str
    fn: Callable[[BenchOptions], SuiteResult]
    description: str = ""


class SuiteNotAvailable(RuntimeError):
    """The suite's module does not exist yet, or the suite cannot run here (it says why)."""


def suite(name: str, *, description: str = "") -> Callable:
    """Decorator: register ``fn(opts: BenchOptions) -> SuiteResult`` as suite ``name``.

    Put it in ``qatlab/bench/<name>.py``; the registry imports that module the
    first time the suite is asked for, so no other file needs to change.
    """
    def register(fn: Callable[[BenchOptions], SuiteResult]) -> Callable[[BenchOptions], SuiteResult]:
        _REGISTRY[name] = SuiteSpec(name, fn, description or (fn.__doc__ or "").strip().split("\n")[0])
        return fn
    return register


def suite_module(name: str) -> str:
    """Module that defines suite ``name``: ``qatlab.bench.<name>``."""
    return f"{__package__}.{name}"


def load_suite(name: str) -> SuiteSpec:
    """The registered suite ``name``, importing its module on first use.

    Raises :class:`SuiteNotAvailable` when the module does not exist (yet) or
    does not register that name. Errors raised *inside* an existing module
    propagate unchanged, so a broken suite is not mistaken for a missing one.
    """
    if name in _REGISTRY:
        return _REGISTRY[name]
    if not name.isidentifier():
        raise SuiteNotAvailable(f"suite {name!r}: not a valid suite name")
    module = suite_module(name)
    try:
        importlib.import_module(module)
    except ModuleNotFoundError as e:
        if e.name == module:
            raise SuiteNotAvailable(f"suite {name!r} not available yet (module {module} does not exist)") from None
        raise
    if name not in _REGISTRY:
        raise SuiteNotAvailable(f"suite {name!r} not available: {module} does not register it with @suite({name!r})")
    return _REGISTRY[name]


def available_suites() -> dict[str, SuiteSpec | str]:
    """``{name: SuiteSpec}`` for each known or registered suite, or ``{name: reason}`` when unavailable."""
    out: dict[str, SuiteSpec | str] = {}
    for name in list(KNOWN_SUITES) + [n for n in _REGISTRY if n not in KNOWN_SUITES]:
        try:
            out[name] = load_suite(name)
        except SuiteNotAvailable as e:
            out[name] = str(e)
    return out
