"""RunStore: runs, their metric rows and model artifacts in one SQLite file; RunRecord; record().

The dashboard, notebooks and the CLI open the same file (:func:`~qatlab.store.schema.default_path`)
and see the same runs. Writes are short ``BEGIN IMMEDIATE`` transactions, so several processes
write at once (WAL: readers never wait for writers); a writer that cannot get the lock within
``timeout`` seconds raises :class:`~qatlab.store.schema.StoreLockedError`. Opening a store marks
the runs whose owner died as ``interrupted`` (:meth:`RunStore.mark_interrupted`).
"""
from __future__ import annotations

import contextlib
import datetime as _dt
import functools
import json
import math
import os
import socket
import threading
import time
import uuid
from dataclasses import dataclass, field

import numpy as np

from ..runs import ACTIVE as TRAINING, checked_name
from . import artifacts, rows as R, schema
from .schema import StoreCorruptError
from .provenance import owner_alive, provenance, this_owner

STATUSES = ("created", "running", "paused", "finished", "stopped", "diverged", "failed", "interrupted", "pruned")
ACTIVE = ("created", "running", "paused")
ENDED = ("finished", "stopped", "diverged", "failed", "interrupted", "pruned")
#: A run of another host whose owner has not beaten for this long is taken as interrupted.
HEARTBEAT_STALE_SECONDS = 60.0
MODEL = "model"
_RUN_COLUMNS = ("id, name, notes, status, config, created, started, ended, message, owner_host, owner_pid, "
                "owner_start, owner_page, worker, sweep_id, point, provenance, final, heartbeat, n_rows")
_inherited: list = []   # connections a forked child inherited: never closed there (the parent owns them)


def _utc(t: float | None) -> _dt.datetime | None:
    return None if t is None else _dt.datetime.fromtimestamp(t, _dt.timezone.utc)


def _loads(text, damaged):
    """A stored JSON field; ``damaged`` when it is missing or unreadable (one damaged record must not
    hide the others from a listing; its ``config`` is then None)."""
    try:
        value = json.loads(text)
    except (TypeError, ValueError):
        return damaged
    return value if damaged is None or isinstance(value, type(damaged)) else damaged


def _json(value) -> str:
    return json.dumps(value, default=_plain)


def _plain(value):
    if isinstance(value, np.generic):
        return value.item()
    if isinstance(value, np.ndarray):
        return value.tolist()
    raise TypeError(f"not JSON serializable: {type(value).__name__}")


@dataclass
class RunRecord:
    """One stored run. Times are aware UTC datetimes (None until they happen); ``config`` is an
    ExperimentConfig (None if this qatlab can no longer read it: ``config_dict`` keeps the raw dict)."""

    id: str
    name: str
    notes: str
    status: str
    created: _dt.datetime
    started: _dt.datetime | None
    ended: _dt.datetime | None
    message: str
    owner: dict
    worker: str | None
    sweep_id: str | None
    point: dict | None
    final: dict
    provenance: dict
    heartbeat: _dt.datetime | None = None
    n_rows: int = 0
    config_dict: dict = field(default_factory=dict, repr=False)

    @classmethod
    def _from_row(cls, row) -> "RunRecord":
        (rid, name, notes, status, config, created, started, ended, message, host, pid, start, page, worker,
         sweep_id, point, prov, final, heartbeat, n_rows) = row
        return cls(id=rid, name=name, notes=notes, status=status, created=_utc(created),
                   started=_utc(started), ended=_utc(ended), message=message,
                   owner={"host": host, "pid": pid, "start": start, "page": page}, worker=worker,
                   sweep_id=sweep_id, point=_loads(point, None), final=_loads(final, {}),
                   provenance=_loads(prov, {}), heartbeat=_utc(heartbeat), n_rows=n_rows,
                   config_dict=_loads(config, {}))

    @functools.cached_property
    def config(self):
        """The run's ExperimentConfig, read from ``config_dict`` on first use (a listing of many
        runs parses none)."""
        from ..config import ExperimentConfig
        if not self.config_dict:           # (unreadable in the file: not the defaults)
            return None
        try:
            return ExperimentConfig.from_dict(self.config_dict)
        except (ValueError, TypeError):
            return None


def _config_dict(config) -> dict:
    from ..config import ExperimentConfig
    if isinstance(config, ExperimentConfig):
        config.validate()
        return config.to_dict()
    if isinstance(config, dict):
        cfg = ExperimentConfig.from_dict(config)    # unknown fields / bad values raise ValueError
        cfg.validate()
        return cfg.to_dict()
    raise TypeError(f"config: expected an ExperimentConfig or its dict, got {type(config).__name__}")


def _owner(owner) -> dict:
    if owner is None or isinstance(owner, str):
        return this_owner(owner)
    if isinstance(owner, dict):
        unknown = set(owner) - {"host", "pid", "start", "page"}
        if unknown:
            raise ValueError(f"owner: unknown keys {sorted(unknown)}; allowed: host, pid, start, page")
        if "pid" not in owner:             # this process, with the host or page given
            return {**this_owner(owner.get("page")), **owner}
        return {"host": socket.gethostname(), "start": None, "page": None, **owner}
    raise TypeError(f"owner: expected None, a page id (str) or a dict, got {type(owner).__name__}")


def _status(status: str) -> str:
    if status not in STATUSES:
        raise ValueError(f"status: expected one of {', '.join(STATUSES)}; got {status!r}")
    return status


def _timeout(timeout) -> float:
    if isinstance(timeout, bool) or not isinstance(timeout, (int, float)) or not 0 <= timeout <= 3600:
        raise ValueError(f"timeout: expected seconds in [0, 3600], got {timeout!r}")
    return float(timeout)


class RunStore:
    """Runs, metric rows and models in one SQLite file (WAL).

    Args:
        path: the file; default ``$QATLAB_STORE``, else ``${XDG_DATA_HOME:-~/.local/share}/qatlab/runs.sqlite``
            (directories are created).
        timeout: seconds to wait for another writer's lock before :class:`StoreLockedError`.
        check_interrupted: mark runs whose owner died as ``interrupted`` on opening.
    """

    def __init__(self, path=None, timeout: float = 5.0, check_interrupted: bool = True):
        if path is not None and not isinstance(path, (str, os.PathLike)):
            raise TypeError(f"path: expected a file path or None, got {type(path).__name__}")
        self.timeout = _timeout(timeout)
        self.path = os.path.abspath(os.fspath(path) if path is not None else schema.default_path())
        if os.path.isdir(self.path):
            raise ValueError(f"path: {self.path} is a directory; give the store's file path")
        os.makedirs(os.path.dirname(self.path), exist_ok=True)
        self._lock = threading.RLock()
        self._pid = os.getpid()
        self._db = schema.connect(self.path, self.timeout)
        if check_interrupted:
            self.mark_interrupted()

    # ------------------------------------------------------------------ plumbing

    def _conn(self):
        if self._pid != os.getpid():         # forked: the parent's connection must not be used here
            _inherited.append(self._db)
            self._db, self._pid = schema.connect(self.path, self.timeout), os.getpid()
        if self._db is None:
            raise ValueError(f"{self.path}: the store is closed")
        return self._db

    @contextlib.contextmanager
    def _write(self):
        """One write transaction (taken at once: no lock upgrade that could fail mid-way)."""
        with self._lock, schema.translated(self.path, self.timeout):
            conn = self._conn()
            conn.execute("BEGIN IMMEDIATE")
            try:
                yield conn
                conn.execute("COMMIT")
            except BaseException:
                if conn.in_transaction:
                    conn.execute("ROLLBACK")
                raise

    @contextlib.contextmanager
    def _read(self):
        """One read snapshot."""
        with self._lock, schema.translated(self.path, self.timeout):
            conn = self._conn()
            conn.execute("BEGIN")
            try:
                yield conn
            finally:
                if conn.in_transaction:
                    conn.execute("COMMIT")

    def close(self) -> None:
        with self._lock:
            if self._db is not None and self._pid == os.getpid():
                self._db.close()
            self._db = None

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()

    def __repr__(self) -> str:
        return f"RunStore({self.path!r})"

    @staticmethod
    def _changed(cur, run_id: str) -> None:
        if cur.rowcount == 0:
            raise KeyError(f"run_id: no run {run_id!r} in this store")

    # ------------------------------------------------------------------ runs

    def create_run(self, config, name: str | None = None, owner=None, sweep_id: str | None = None,
                   point: dict | None = None, notes: str = "") -> str:
        """Add a run in status ``created``; returns its id (uuid4 hex, unique across processes and hosts).

        owner: None (this process), a page id (this process, acting for that page) or a dict
        ``{host, pid, start, page}``. point: the sweep point (a JSON-ready dict)."""
        cfg = _config_dict(config)
        for label, value in (("sweep_id", sweep_id), ("notes", notes)):
            if value is not None and not isinstance(value, str):
                raise TypeError(f"{label}: expected a str, got {type(value).__name__}")
        name = None if name is None else checked_name(name)
        if point is not None and not isinstance(point, dict):
            raise TypeError(f"point: expected a dict, got {type(point).__name__}")
        who = _owner(owner)
        rid = uuid.uuid4().hex
        with self._write() as conn:
            conn.execute(
                "INSERT INTO runs (id, name, notes, status, config, created, message, owner_host, owner_pid, "
                "owner_start, owner_page, sweep_id, point, provenance, heartbeat) "
                "VALUES (?,?,?,?,?,?,?,?,?,?,?,?,?,?,?)",
                (rid, name or rid[:8], notes, "created", _json(cfg), time.time(), "", who["host"], who["pid"],
                 who["start"], who["page"], sweep_id, None if point is None else _json(point),
                 _json(provenance()), time.time()))
        return rid

    def get(self, run_id: str) -> RunRecord:
        """The run's record; ``KeyError`` if there is none."""
        with self._read() as conn:
            row = conn.execute(f"SELECT {_RUN_COLUMNS} FROM runs WHERE id = ?", (run_id,)).fetchone()
        if row is None:
            raise KeyError(f"run_id: no run {run_id!r} in this store")
        return RunRecord._from_row(row)

    def _config_dict_of(self, run_id: str) -> dict:
        with self._read() as conn:
            row = conn.execute("SELECT config FROM runs WHERE id = ?", (run_id,)).fetchone()
        if row is None:
            raise KeyError(f"run_id: no run {run_id!r} in this store")
        return json.loads(row[0])

    def runs(self, status=None, sweep_id: str | None = None) -> list[RunRecord]:
        """Stored runs, oldest first; ``status``: one status or a list of them."""
        where, args = [], []
        if status is not None:
            wanted = [status] if isinstance(status, str) else list(status)
            for s in wanted:
                _status(s)
            where.append(f"status IN ({','.join('?' * len(wanted))})")
            args += wanted
        if sweep_id is not None:
            where.append("sweep_id = ?")
            args.append(sweep_id)
        sql = f"SELECT {_RUN_COLUMNS} FROM runs" + (f" WHERE {' AND '.join(where)}" if where else "")
        with self._read() as conn:
            found = conn.execute(sql + " ORDER BY created, id", args).fetchall()
        return [RunRecord._from_row(row) for row in found]

    #: The columns of :meth:`listing`'s rows, in order.
    LISTING_COLUMNS = ("id", "name", "notes", "status", "config", "created", "started", "ended", "message",
                       "owner_page", "worker", "sweep_id", "final", "heartbeat", "n_rows")

    def listing(self) -> list[tuple]:
        """Every run as a raw row of :data:`LISTING_COLUMNS` (JSON as text, times as epoch seconds)
        plus whether it has a stored model, newest first: one query, no config parsed (a table
        refreshed every second reads this; :meth:`runs` builds an ExperimentConfig per run)."""
        sql = (f"SELECT {', '.join(self.LISTING_COLUMNS)}, EXISTS (SELECT 1 FROM artifacts a "
               "WHERE a.run_id = runs.id AND a.name = ?) FROM runs ORDER BY created DESC, id DESC")
        with self._read() as conn:
            return conn.execute(sql, (MODEL,)).fetchall()

    def find(self, prefix: str) -> str:
        """The id of the one run whose id starts with ``prefix`` (as the CLI prints them)."""
        if not isinstance(prefix, str) or not prefix:
            raise ValueError(f"prefix: expected a non-empty id prefix, got {prefix!r}")
        with self._read() as conn:
            found = conn.execute("SELECT id FROM runs WHERE id >= ? AND id < ? LIMIT 2",
                                 (prefix, prefix + "\U0010ffff")).fetchall()
        if len(found) != 1:
            raise KeyError(f"prefix: {'no run' if not found else 'several runs'} with an id starting {prefix!r}")
        return found[0][0]

    def set_status(self, run_id: str, status: str, message: str = "") -> None:
        """Set the status (one of :data:`STATUSES`) and message; ``running`` stamps the start time
        (once), an ending status the end time."""
        _status(status)
        now = time.time()
        with self._write() as conn:
            cur = conn.execute(
                "UPDATE runs SET status = ?, message = ?, heartbeat = ?, "
                "started = CASE WHEN ? AND started IS NULL THEN ? ELSE started END, "
                "ended = CASE WHEN ? THEN ? ELSE ended END WHERE id = ?",
                (status, str(message), now, status == "running", now, status in ENDED, now, run_id))
            self._changed(cur, run_id)

    def set_worker(self, run_id: str, worker: str | None) -> None:
        """Record the worker (e.g. a Dask worker address) that trains the run."""
        with self._write() as conn:
            self._changed(conn.execute("UPDATE runs SET worker = ? WHERE id = ?", (worker, run_id)), run_id)

    def rename(self, run_id: str, name: str) -> None:
        name = checked_name(name)
        with self._write() as conn:
            self._changed(conn.execute("UPDATE runs SET name = ? WHERE id = ?", (name, run_id)), run_id)

    def set_notes(self, run_id: str, notes: str) -> None:
        if not isinstance(notes, str):
            raise TypeError(f"notes: expected a str, got {type(notes).__name__}")
        with self._write() as conn:
            self._changed(conn.execute("UPDATE runs SET notes = ? WHERE id = ?", (notes, run_id)), run_id)

    def delete(self, run_id: str) -> None:
        """Remove the run, its rows and its artifacts; a running or paused run is refused (its owner
        still writes to it): stop it first."""
        with self._write() as conn:
            row = conn.execute("SELECT status FROM runs WHERE id = ?", (run_id,)).fetchone()
            if row is not None and row[0] in TRAINING:
                raise ValueError(f"run_id: run {run_id!r} is {row[0]}; stop it first, then delete it")
            conn.execute("DELETE FROM row_chunks WHERE run_id = ?", (run_id,))
            conn.execute("DELETE FROM artifacts WHERE run_id = ?", (run_id,))
            self._changed(conn.execute("DELETE FROM runs WHERE id = ?", (run_id,)), run_id)

    # ------------------------------------------------------------------ rows, results, models

    def append_rows(self, run_id: str, rows: list[dict]) -> int:
        """Append metrics rows (dicts ``{column: number}``, as a MetricsLog takes them) in one
        transaction; returns the run's row count. A bad row raises before anything is written."""
        groups = R.group_rows(rows)
        with self._write() as conn:
            return R.insert_groups(conn, run_id, len(rows), groups)

    def append_columns(self, run_id: str, columns: dict) -> int:
        """Append rows given as ``{column: array (n,)}`` (MetricsLog.columns(); NaN = no value)."""
        n, groups = R.group_columns(columns)
        with self._write() as conn:
            return R.insert_groups(conn, run_id, n, groups)

    def history(self, run_id: str) -> dict[str, np.ndarray]:
        """``{"row_id", column: float64 (n,)}``, NaN where a row lacks a column (as MetricsLog.columns())."""
        with self._read() as conn:
            try:
                return R.read(conn, run_id)
            except (ValueError, TypeError, KeyError, IndexError) as exc:    # a chunk that does not decode
                raise StoreCorruptError(f"{self.path}: run {run_id!r}: its stored rows are damaged ({exc})") from exc

    def finish(self, run_id: str, result) -> None:
        """Store a RunResult's end: status, message, final metrics, end time and the model
        (the run's rows are merged into large chunks, so its history reads fast)."""
        status = _status(result.status)
        if status not in ENDED:
            raise ValueError(f"result.status: a finished run's status is one of {', '.join(ENDED)}; got {status!r}")
        final = dict(result.final or {})
        blob = None
        if artifacts.storable(result.model):       # (other model kinds have no store format yet)
            blob = artifacts.model_to_npz(result.model, self._config_dict_of(run_id))
        with self._write() as conn:
            cur = conn.execute("UPDATE runs SET status = ?, message = ?, final = ?, ended = ?, heartbeat = ? "
                               "WHERE id = ?", (status, str(result.message or ""), _json(final), time.time(),
                                                time.time(), run_id))
            self._changed(cur, run_id)
            if blob is not None:
                conn.execute("INSERT OR REPLACE INTO artifacts (run_id, name, data) VALUES (?,?,?)",
                             (run_id, MODEL, blob))
            R.compact(conn, run_id)

    def load_model(self, run_id: str):
        """The run's trained model (an :class:`~qatlab.nn.Mlp`); ``KeyError`` if none was stored."""
        with self._read() as conn:
            found = conn.execute("SELECT data FROM artifacts WHERE run_id = ? AND name = ?",
                                 (run_id, MODEL)).fetchone()
        if found is None:
            self.get(run_id)      # KeyError for an unknown run
            raise KeyError(f"run_id: run {run_id!r} has no stored model")
        try:
            return artifacts.load_model(found[0])
        except (ValueError, TypeError, KeyError) as exc:
            raise StoreCorruptError(f"{self.path}: run {run_id!r}: its stored model is damaged ({exc})") from exc

    # ------------------------------------------------------------------ liveness

    def heartbeat(self, run_ids) -> None:
        """Stamp ``now`` on these runs: their owner is alive (another host decides by this)."""
        ids = [run_ids] if isinstance(run_ids, str) else list(run_ids)
        if not ids:
            return
        with self._write() as conn:
            conn.execute(f"UPDATE runs SET heartbeat = ? WHERE id IN ({','.join('?' * len(ids))})",
                         [time.time(), *ids])

    def mark_interrupted(self, owner_is_alive=None, stale_after: float = HEARTBEAT_STALE_SECONDS) -> list[str]:
        """Mark ``interrupted`` the created/running/paused runs whose owner is gone; returns their ids.

        An owner on this host is gone when ``owner_is_alive(owner_dict)`` is False (default: its
        process has ended; see :func:`~qatlab.store.provenance.owner_alive`). An owner on another
        host cannot be checked that way: it is gone when its runs' heartbeat is older than
        ``stale_after`` seconds. So a notebook never marks the runs of a live server.
        """
        alive = owner_alive if owner_is_alive is None else owner_is_alive
        if not callable(alive):
            raise TypeError(f"owner_is_alive: expected a callable(owner dict) -> bool, got {alive!r}")
        host, now = socket.gethostname(), time.time()
        with self._read() as conn:
            active = conn.execute(
                "SELECT id, owner_host, owner_pid, owner_start, owner_page, heartbeat, created FROM runs "
                f"WHERE status IN ({','.join('?' * len(ACTIVE))})", ACTIVE).fetchall()
        gone = {}
        for rid, h, pid, start, page, beat, created in active:
            if h == host:
                if not alive({"host": h, "pid": pid, "start": start, "page": page}):
                    gone[rid] = f"interrupted: its owner process {pid} on {h} ended"
            elif now - (beat or created) > stale_after:
                gone[rid] = f"interrupted: no heartbeat from its owner on {h} for {now - (beat or created):.0f} s"
        if gone:
            with self._write() as conn:
                for rid, message in gone.items():
                    conn.execute(f"UPDATE runs SET status = 'interrupted', message = ?, ended = ? "
                                 f"WHERE id = ? AND status IN ({','.join('?' * len(ACTIVE))})",
                                 (message, now, rid, *ACTIVE))
                    R.compact(conn, rid)
        return list(gone)


def record(result, store: RunStore | None = None, name: str | None = None, notes: str = "") -> str:
    """Keep a finished in-process ``ql.run_experiment`` RunResult in the store (config, history rows,
    final metrics, model); returns the run id."""
    from ..train.result import RunResult
    if not isinstance(result, RunResult):
        raise TypeError(f"result: expected a qatlab RunResult, got {type(result).__name__}")
    if not result.config:
        raise ValueError("result: has no config (a run that failed before it started cannot be recorded)")
    store = store if store is not None else RunStore()
    rid = store.create_run(result.config, name=name, notes=notes)
    store.set_status(rid, "running")
    if result.history:
        store.append_columns(rid, result.history)
    store.finish(rid, result)
    seconds = (result.final or {}).get("seconds")
    if isinstance(seconds, (int, float)) and math.isfinite(seconds):   # the run's real start, not the record's
        with store._write() as conn:
            conn.execute("UPDATE runs SET started = ended - ? WHERE id = ?", (float(seconds), rid))
    return rid
