"""``python -m qatlab run CONFIG.json`` trains a config into the run store; ``python -m qatlab runs`` lists it.

``run`` trains in this process, or on a Dask cluster with ``--scheduler ADDR`` (``ql.Run``).
Rows reach the store at least once a second, so a run killed midway keeps its rows and is listed
``interrupted``.
"""
from __future__ import annotations

import argparse
import json
import math
import os
import shutil
import sys
import threading
import time
import traceback

FLUSH_SECONDS = 0.5
#: A run's rows are stored unthinned up to this many (its live log's capacity).
STORED_ROWS = 1_000_000
HEARTBEAT_SECONDS = 10.0
EXIT_USAGE, EXIT_FAILED, EXIT_INTERRUPTED = 2, 1, 130


class UsageError(Exception):
    """A bad argument or input file: one line on stderr, exit code 2."""


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m qatlab", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = p.add_subparsers(dest="command", required=True)
    store_help = "run store file (default: $QATLAB_STORE, else ~/.local/share/qatlab/runs.sqlite)"
    run = sub.add_parser("run", help="train CONFIG.json and keep it in the store",
                         description="Train an ExperimentConfig given as JSON (ExperimentConfig.to_dict() form; "
                                     "fields left out keep their defaults) in this process, or on the Dask "
                                     "cluster at --scheduler, with a progress bar on stderr. Rows and the result "
                                     "go to the store.")
    run.add_argument("config", metavar="CONFIG.json", help="the experiment config as JSON")
    run.add_argument("--store", metavar="PATH", help=store_help)
    run.add_argument("--scheduler", metavar="ADDR", help="train on this Dask scheduler's workers, e.g. "
                                                          "tcp://host:8786 (default: in this process)")
    run.add_argument("--name", help="the run's name (default: the config file's name)")
    run.add_argument("--notes", default="", help="free text kept with the run")
    runs = sub.add_parser("runs", help="list the runs in the store")
    runs.add_argument("--store", metavar="PATH", help=store_help)
    runs.add_argument("--status", help="only runs with this status")
    from .sweep.cli import add_parser as add_sweep_parser
    add_sweep_parser(sub, store_help)
    return p


def _one_line(exc: BaseException) -> str:
    return " ".join(str(exc).split()) or type(exc).__name__


def load_config(path: str):
    """The ExperimentConfig in a JSON file; :class:`UsageError` with one line saying what is wrong."""
    from .config import ExperimentConfig
    try:
        with open(path, encoding="utf-8") as f:
            text = f.read()
    except OSError as exc:
        raise UsageError(f"{path}: cannot read the config ({exc.strerror or exc})") from None
    except UnicodeDecodeError:
        raise UsageError(f"{path}: not a UTF-8 text file; a config is a JSON object") from None
    try:
        values = json.loads(text)
    except json.JSONDecodeError as exc:
        raise UsageError(f"{path}: not valid JSON (line {exc.lineno}, column {exc.colno}: {exc.msg})") from None
    if not isinstance(values, dict):
        raise UsageError(f"{path}: expected a JSON object of config fields, got {type(values).__name__}")
    try:
        cfg = ExperimentConfig.from_dict(values)
        cfg.validate()
    except (ValueError, TypeError) as exc:
        raise UsageError(f"{path}: bad config: {_one_line(exc)}") from None
    return cfg


def _open_store(path):
    from .store import RunStore, StoreLockedError
    try:
        return RunStore(path)
    except (ValueError, TypeError, StoreLockedError, OSError) as exc:
        raise UsageError(_one_line(exc)) from None


class _Progress:
    """A one-line progress bar on stderr (redrawn in place on a terminal, a line every few seconds otherwise)."""

    def __init__(self, stream=None):
        self.stream = stream if stream is not None else sys.stderr
        self.tty = self.stream.isatty()
        self.t0 = time.perf_counter()
        self.last = -math.inf

    def draw(self, done: int, total: int, loss: float, final: bool = False) -> None:
        now = time.perf_counter()
        if not final and (total == 0 or now - self.last < (0.2 if self.tty else 5.0)):
            return                       # (total is 0 until the data is loaded and the first step runs)
        self.last = now
        elapsed = now - self.t0
        rate = done / elapsed if elapsed > 0 else 0.0
        share = done / total if total else 0.0
        eta = f"{(total - done) / rate:.0f}s" if rate > 0 and done < total else "-"
        text = f"{share:4.0%} {done}/{total} steps  {rate:.0f} steps/s  eta {eta}  loss {loss:.4g}"
        width = min(40, shutil.get_terminal_size().columns - len(text) - 4)
        fill = int(share * width)
        line = f"[{'#' * fill}{'.' * (width - fill)}] {text}" if width >= 10 else text   # (narrow: no bar)
        if self.tty:    # \x1b[K clears the rest of a longer previous line
            self.stream.write("\r" + line + "\x1b[K" + ("\n" if final else ""))
        else:
            self.stream.write(line + "\n")
        self.stream.flush()


class _Flusher:
    """Writes the rows a run's MetricsLog took since the last write, as columns (no per-row Python,
    so the training thread keeps the GIL). The log keeps up to :data:`STORED_ROWS` rows unthinned;
    a run that logs more is stored thinned, as its live log is (rare rows such as test rows kept)."""

    def __init__(self, store, run_id: str):
        from .metrics import MetricsLog
        self.store, self.run_id = store, run_id
        self.log = MetricsLog(capacity=STORED_ROWS)
        self.cursor = 0

    def pending(self) -> bool:
        return self.log.total_rows > self.cursor

    def flush(self) -> None:
        """Write what is new; the cursor moves only once the write is done (a Ctrl-C inside it retries)."""
        columns, cursor = self.log.since(self.cursor)
        if len(columns["row_id"]):
            self.store.append_columns(self.run_id, columns)
        self.cursor = cursor


def cmd_run(args) -> int:
    from .data import check_data_here
    from .runs import failure_message
    from .store import StoreLockedError, when_unlocked
    cfg = load_config(args.config)
    store = _open_store(args.store)
    name = args.name or os.path.splitext(os.path.basename(args.config))[0]
    if args.scheduler is not None:
        return _run_remote(cfg, store, name, args.notes, args.scheduler)
    try:
        check_data_here(cfg.data, "this machine")     # (it trains here, not on a worker)
        run_id = store.create_run(cfg, name=name, notes=args.notes)
        store.set_status(run_id, "running")
    except (ValueError, TypeError, StoreLockedError) as exc:
        raise UsageError(_one_line(exc)) from None
    print(f"run {run_id} ({name}) -> {store.path}", file=sys.stderr)
    rows = _Flusher(store, run_id)
    log, stop, ended, state = rows.log, threading.Event(), threading.Event(), {"done": 0, "total": 0}

    def report(done: int, total: int) -> bool:
        state["done"], state["total"] = done, total
        return not stop.is_set()

    def train():
        from .train.trainer import train_experiment
        try:
            state["result"] = train_experiment(cfg, log, report=report)
        except BaseException as exc:    # reported as a failed run by the main thread
            state["error"], state["traceback"] = failure_message(exc), traceback.format_exc()
        finally:
            ended.set()

    thread = threading.Thread(target=train, name=f"qatlab-{run_id[:8]}", daemon=True)
    progress, last_flush, last_beat, locked_said = _Progress(), time.monotonic(), time.monotonic(), False
    thread.start()
    while not ended.is_set():           # (a Ctrl-C inside Thread.join can make is_alive() lie: an Event)
        try:
            ended.wait(0.1)
            now = time.monotonic()
            if rows.pending() and now - last_flush >= FLUSH_SECONDS:
                last_flush = now
                rows.flush()
                last_beat = now
            if now - last_beat >= HEARTBEAT_SECONDS:
                last_beat = now
                store.heartbeat([run_id])
            progress.draw(state["done"], state["total"], log.last("loss"))
        except StoreLockedError:        # another writer holds the store: the rows wait in memory
            if not locked_said:
                locked_said = True
                print("\nthe run store is locked by another writer; training goes on, rows are kept "
                      "and written once it is free", file=sys.stderr)
        except KeyboardInterrupt:       # stop after the current step; the run is kept as stopped
            stop.set()
            print("\nstopping (Ctrl-C) ...", file=sys.stderr)
    progress.draw(state["done"], state["total"], log.last("loss"), final=True)
    when_unlocked(rows.flush)
    if "error" in state:
        when_unlocked(lambda: store.set_status(run_id, "failed", state["error"]))
        print(f"run {run_id[:8]} failed: {state['error']}\n{state['traceback']}", file=sys.stderr)
        return EXIT_FAILED
    result = state["result"]
    when_unlocked(lambda: store.finish(run_id, result))
    acc = result.final.get("test_accuracy", math.nan)
    print(f"run {run_id[:8]} {result.status}: test accuracy {acc:.4f}, "
          f"{result.final.get('steps_per_second', 0.0):.0f} steps/s{'; ' + result.message if result.message else ''}",
          file=sys.stderr)
    if result.status == "finished":
        return 0
    return EXIT_INTERRUPTED if stop.is_set() else EXIT_FAILED


def _run_remote(cfg, store, name: str, notes: str, address: str) -> int:
    """``run --scheduler``: one RemoteRun on that cluster; Ctrl-C stops it after its current step."""
    from .executor import RemoteRun, connect
    try:
        client = connect(address)
    except (ValueError, OSError) as exc:
        raise UsageError(f"--scheduler: {' '.join(str(exc).split())}") from None
    try:
        run = RemoteRun(cfg, name=name, store=store, client=client).start()
    except (ValueError, TypeError, TimeoutError) as exc:     # (StoreLockedError is a TimeoutError)
        raise UsageError(_one_line(exc)) from None
    if notes:
        store.set_notes(run.id, notes)
    print(f"run {run.id} ({name}) on {address} -> {store.path}", file=sys.stderr)
    progress, stopping = _Progress(), False
    while True:
        try:                            # (Ctrl-C lands in join() most of the time)
            if run.join(0.1):
                break
            progress.draw(run.steps_done, run.total_steps, run.log.last("loss"))
        except KeyboardInterrupt:
            if not stopping:
                stopping = True
                run.stop()
                print("\nstopping (Ctrl-C) ...", file=sys.stderr)
    progress.draw(run.steps_done, run.total_steps, run.log.last("loss"), final=True)
    acc = run.result().final.get("test_accuracy", math.nan) if run.result() else math.nan
    print(f"run {run.id[:8]} {run.status} on {run.worker}: test accuracy {acc:.4f}"
          f"{'; ' + run.message if run.message else ''}", file=sys.stderr)
    if run.status == "finished":
        return 0
    return EXIT_INTERRUPTED if stopping else EXIT_FAILED


def cmd_runs(args) -> int:
    from .store import STATUSES
    if args.status is not None and args.status not in STATUSES:
        raise UsageError(f"--status: expected one of {', '.join(STATUSES)}; got {args.status!r}")
    from .store import default_path
    path = os.path.abspath(args.store) if args.store else default_path()
    if not os.path.exists(path):       # listing must not create a store at a mistyped path
        print(f"no run store at {path}")
        return 0 if args.store is None else EXIT_USAGE
    store = _open_store(path)
    records = store.runs(status=args.status)
    if not records:
        print(f"no runs in {store.path}")
        return 0
    print(f"{'id':<8}  {'name':<24}  {'status':<11}  {'created (UTC)':<16}  {'rows':>7}  test acc")
    for r in records:
        acc = r.final.get("test_accuracy")
        acc = f"{acc:.4f}" if isinstance(acc, (int, float)) and math.isfinite(acc) else "-"
        print(f"{r.id[:8]:<8}  {r.name[:24]:<24}  {r.status:<11}  {r.created:%Y-%m-%d %H:%M}  {r.n_rows:>7}  {acc}")
    return 0


def main(argv=None) -> int:
    args = _parser().parse_args(argv)
    try:
        if args.command == "sweep":
            from .sweep.cli import cmd_sweep
            return cmd_sweep(args, _open_store, UsageError)
        return {"run": cmd_run, "runs": cmd_runs}[args.command](args)
    except UsageError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return EXIT_USAGE
    except TimeoutError as exc:         # the store stayed locked past when_unlocked's wait
        print(f"error: {_one_line(exc)}", file=sys.stderr)
        return EXIT_FAILED


if __name__ == "__main__":
    sys.exit(main())
