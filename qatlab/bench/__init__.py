"""``python -m qatlab.bench SUITE``: side-by-side performance tables, printed and saved as JSON.

Usage::

    python -m qatlab.bench fakequant                 # full run -> bench-results/fakequant.json
    python -m qatlab.bench fakequant --quick         # smaller sizes, fewer repeats
    python -m qatlab.bench conv                      # CNN step vs PyTorch eager vs im2col floor
    python -m qatlab.bench sweep                     # a 16-run sweep on 1 vs 2 Dask workers
    python -m qatlab.bench store                     # the run store: logging cost, reading 100k rows
    python -m qatlab.bench fakequant --out my.json --repeats 11
    python -m qatlab.bench all                       # every available suite -> bench-results/<suite>.json
    python -m qatlab.bench --list                    # suites and whether they are available

Options: ``--out PATH`` (a file; with ``all``, a directory), ``--quick``,
``--repeats N`` (timing samples per measurement), ``--min-time S`` (seconds per
sample), ``--sizes N,N,..`` (override the suite's problem sizes), ``--strict``
(exit 1 when a goal is missed). Each suite lives in ``qatlab/bench/<name>.py``
and registers itself with :func:`qatlab.bench.kit.suite`; see :mod:`qatlab.bench.kit`.

Exit status: 0 when every requested suite ran (goal misses are reported, not
fatal, unless ``--strict``); 1 when a named suite is not available or a goal was
missed under ``--strict``; 2 for bad arguments.
"""
from __future__ import annotations

import argparse
import sys
from pathlib import Path

from . import kit
from .kit import BenchOptions, SuiteNotAvailable

DEFAULT_DIR = Path("bench-results")


def _parse_sizes(text: str) -> tuple[int, ...]:
    units = {"k": 2**10, "m": 2**20, "g": 2**30}
    sizes = []
    for part in text.split(","):
        part = part.strip().lower()
        if not part:
            continue
        mult = units.get(part[-1], 1)
        digits = part[:-1] if part[-1] in units else part
        try:
            value = int(digits) * mult
        except ValueError:
            raise argparse.ArgumentTypeError(f"--sizes: {part!r} is not an integer (suffixes k, m, g allowed)")
        if value < 1:
            raise argparse.ArgumentTypeError(f"--sizes: sizes must be >= 1, got {part!r}")
        sizes.append(value)
    if not sizes:
        raise argparse.ArgumentTypeError("--sizes: give at least one size, e.g. 4k,256k")
    return tuple(sizes)


def _positive_int(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected an integer >= 1, got {text!r}")
    if value < 1:
        raise argparse.ArgumentTypeError(f"expected an integer >= 1, got {value}")
    return value


def _non_negative_float(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected seconds >= 0, got {text!r}")
    if not value >= 0:
        raise argparse.ArgumentTypeError(f"expected seconds >= 0, got {value}")
    return value


def build_parser() -> argparse.ArgumentParser:
    """The argument parser of ``python -m qatlab.bench``."""
    p = argparse.ArgumentParser(prog="python -m qatlab.bench",
                                description="qatlab benchmarks: aligned tables on stdout, JSON on disk.")
    p.add_argument("suite", nargs="?", help="suite name (" + ", ".join(kit.KNOWN_SUITES) + ") or 'all'")
    p.add_argument("--out", type=Path, default=None,
                   help="JSON output file (default bench-results/<suite>.json); with 'all', a directory")
    p.add_argument("--quick", action="store_true", help="smaller sizes and fewer repeats")
    p.add_argument("--repeats", type=_positive_int, default=None, help="timing samples per measurement")
    p.add_argument("--min-time", type=_non_negative_float, default=None, help="minimum seconds per timing sample")
    p.add_argument("--sizes", type=_parse_sizes, default=None, help="problem sizes, e.g. 4k,256k,16m")
    p.add_argument("--strict", action="store_true", help="exit 1 if any goal is missed")
    p.add_argument("--list", action="store_true", help="list suites and whether they are available")
    return p


def run_suite(name: str, opts: BenchOptions, out: Path, stream=None) -> kit.SuiteResult:
    """Run suite ``name``, print its report to ``stream`` (stdout) and write its JSON to ``out``.

    Raises :class:`~qatlab.bench.kit.SuiteNotAvailable` when the suite cannot run.
    """
    stream = sys.stdout if stream is None else stream
    spec = kit.load_suite(name)
    result = spec.fn(opts)
    info = kit.machine_info()
    print(kit.report_text(name, result, info), file=stream)
    path = kit.write_json(out, kit.result_payload(name, result, opts, info))
    print(f"\nwrote {path}", file=stream, flush=True)
    return result


def main(argv=None) -> int:
    """CLI entry point; returns the exit status (see the module docstring)."""
    parser = build_parser()
    args = parser.parse_args(argv)
    if args.list:
        for name, spec in kit.available_suites().items():
            status = spec.description if isinstance(spec, kit.SuiteSpec) else f"(unavailable: {spec})"
            print(f"{name:12s} {status}")
        return 0
    if not args.suite:
        parser.print_usage(sys.stderr)
        print("error: give a suite name or 'all' (see --list)", file=sys.stderr)
        return 2
    try:
        opts = BenchOptions.make(quick=args.quick, repeats=args.repeats, min_time=args.min_time, sizes=args.sizes)
    except ValueError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2

    if args.suite == "all":
        out_dir = args.out if args.out is not None else DEFAULT_DIR
        names = list(kit.available_suites())
        ran, missed = [], False
        for name in names:
            try:
                result = run_suite(name, opts, out_dir / f"{name}.json")
            except SuiteNotAvailable as e:
                print(f"skip: {e}\n", flush=True)
                continue
            print(flush=True)
            ran.append(name)
            missed |= any(g.passed is False for g in result.goals)
        print(f"ran {len(ran)} suite(s): {', '.join(ran) or 'none'}")
        return 1 if (args.strict and missed) else 0

    out = args.out if args.out is not None else DEFAULT_DIR / f"{args.suite}.json"
    try:
        result = run_suite(args.suite, opts, out)
    except SuiteNotAvailable as e:
        print(f"error: {e}", file=sys.stderr)
        return 1
    missed = any(g.passed is False for g in result.goals)
    return 1 if (args.strict and missed) else 0

