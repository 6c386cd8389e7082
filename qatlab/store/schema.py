"""Opening a run store file: the schema, its version, migrations, and clear errors.

The file says what it is with ``PRAGMA application_id`` (:data:`APP_ID`) and which layout it
holds with ``PRAGMA user_version`` (:data:`SCHEMA_VERSION`). An empty file gets the current
schema; an older one is migrated forward in one transaction (:data:`MIGRATIONS`); a newer one,
an SQLite file of another application, a file that is not SQLite at all or a damaged one is
refused with a ``ValueError`` that says which; a file another connection keeps locked past the
busy timeout raises :class:`StoreLockedError`, never hangs.
"""
from __future__ import annotations

import contextlib
import json
import os
import sqlite3
import time

from . import rows as R

APP_ID = 0x51544C42          # "QTLB"
SCHEMA_VERSION = 1
SQLITE_MAGIC = b"SQLite format 3\x00"
PAGE_SIZE = 16384            # a history's blobs span 4x fewer overflow pages than at the default 4096

SCHEMA_V1 = """
CREATE TABLE runs (
    id TEXT PRIMARY KEY, name TEXT NOT NULL, notes TEXT NOT NULL DEFAULT '', status TEXT NOT NULL,
    config TEXT NOT NULL, created REAL NOT NULL, started REAL, ended REAL, message TEXT NOT NULL DEFAULT '',
    owner_host TEXT, owner_pid INTEGER, owner_start INTEGER, owner_page TEXT, worker TEXT,
    sweep_id TEXT, point TEXT, provenance TEXT NOT NULL DEFAULT '{}', final TEXT NOT NULL DEFAULT '{}',
    heartbeat REAL, n_rows INTEGER NOT NULL DEFAULT 0);
CREATE INDEX runs_status ON runs(status);
CREATE INDEX runs_sweep ON runs(sweep_id);
CREATE TABLE row_kinds (id INTEGER PRIMARY KEY, columns TEXT NOT NULL UNIQUE);
CREATE TABLE row_chunks (
    run_id TEXT NOT NULL, first_seq INTEGER NOT NULL, kind INTEGER NOT NULL, n INTEGER NOT NULL,
    seqs BLOB NOT NULL, payload BLOB NOT NULL, PRIMARY KEY (run_id, first_seq)) WITHOUT ROWID;
CREATE TABLE artifacts (
    run_id TEXT NOT NULL, name TEXT NOT NULL, data BLOB NOT NULL, PRIMARY KEY (run_id, name)) WITHOUT ROWID;
"""


class StoreLockedError(TimeoutError):
    """Another connection held the store's write lock for longer than the busy timeout."""


class StoreCorruptError(ValueError):
    """The store file is damaged (SQLite reports a malformed database)."""


@contextlib.contextmanager
def translated(path: str, timeout: float):
    """Turn sqlite3's locked / corrupt / not-a-database errors into clear qatlab errors."""
    try:
        yield
    except sqlite3.OperationalError as exc:
        text = str(exc).lower()
        if "locked" in text or "busy" in text:
            raise StoreLockedError(
                f"{path}: the run store is locked by another connection (waited {timeout:g} s); "
                "try again when the other writer is done, or raise the timeout") from exc
        if "malformed" in text or "corrupt" in text:
            raise _corrupt(path, exc) from exc
        if "unable to open" in text or "readonly" in text:
            raise ValueError(f"{path}: cannot open the run store for writing ({exc}); "
                             "give a writable store path") from exc
        raise
    except sqlite3.DatabaseError as exc:
        text = str(exc).lower()
        if "not a database" in text or "malformed" in text or "corrupt" in text or "encrypted" in text:
            raise _corrupt(path, exc) from exc
        raise


#: How long a run's owner keeps trying to store its last rows and its end while another connection
#: holds the store's write lock (a reader's long transaction, a backup, sqlite3 at a prompt).
LOCKED_WAIT_SECONDS = 120.0


def when_unlocked(write, seconds: float = LOCKED_WAIT_SECONDS):
    """``write()``, tried again while another connection holds the store's lock (each try waits the
    store's busy timeout) for up to ``seconds``; then the StoreLockedError."""
    deadline = time.monotonic() + seconds
    while True:
        try:
            return write()
        except StoreLockedError:
            if time.monotonic() >= deadline:
                raise


def _corrupt(path: str, exc: Exception) -> StoreCorruptError:
    return StoreCorruptError(f"{path}: the run store file is corrupt ({exc}); move it away to start a new "
                             "store, or restore it from a backup")


def check_file_header(path: str) -> None:
    """Refuse an existing non-empty file that is not SQLite (before sqlite3 touches it)."""
    try:
        with open(path, "rb") as f:
            head = f.read(len(SQLITE_MAGIC))
    except FileNotFoundError:
        return
    if head and head != SQLITE_MAGIC:
        raise ValueError(f"{path}: not a qatlab run store (not an SQLite file); give another store path "
                         "(RunStore(path), --store or QATLAB_STORE)")


def connect(path: str, timeout: float) -> sqlite3.Connection:
    """A connection in autocommit mode (transactions are explicit), WAL journal, schema checked
    and migrated to :data:`SCHEMA_VERSION`."""
    check_file_header(path)
    with translated(path, timeout):      # (a directory it cannot write in: a clear error)
        conn = sqlite3.connect(path, timeout=timeout, isolation_level=None, check_same_thread=False)
    try:
        with translated(path, timeout):
            conn.execute(f"PRAGMA busy_timeout = {int(timeout * 1000)}")
            app, ver, tables = _version(conn)
            _refuse(path, app, ver, tables)  # a foreign or newer file: refused before anything is written
            if tables == 0:                  # a new file: its page size, set before WAL fixes it
                conn.execute(f"PRAGMA page_size = {PAGE_SIZE}")
            _use_wal(conn, timeout)          # before the schema: no process sees a store not yet in WAL
            _ensure_schema(conn, path)
            conn.execute("PRAGMA synchronous = NORMAL")   # WAL: durable at checkpoints, fast commits
            # no mmap: pages of the file it maps would count in a long-lived reader's (the server's) resident
            # memory, growing with every run it reads; without it a 100k-row history still reads well under 0.1 s
            conn.execute("PRAGMA mmap_size = 0")
    except BaseException:
        conn.close()
        raise
    return conn


def _use_wal(conn, timeout: float) -> None:
    """Switch the file to WAL (kept in the file). The switch needs the file to itself and SQLite may
    refuse it at once while another process reads a new store: try again until ``timeout``."""
    deadline = time.monotonic() + timeout
    while conn.execute("PRAGMA journal_mode").fetchone()[0].lower() != "wal":
        try:
            conn.execute("PRAGMA journal_mode = WAL")
        except sqlite3.OperationalError as exc:
            if "locked" not in str(exc).lower() or time.monotonic() >= deadline:
                raise
            time.sleep(0.02)


def _version(conn) -> tuple[int, int, int]:
    """(application_id, user_version, tables), read in one statement: one snapshot of the file, so a
    schema another process commits meanwhile is seen whole or not at all."""
    return conn.execute("SELECT (SELECT application_id FROM pragma_application_id),"
                        " (SELECT user_version FROM pragma_user_version),"
                        " (SELECT count(*) FROM sqlite_master)").fetchone()


def _ensure_schema(conn, path: str) -> None:
    app, ver, tables = _version(conn)
    if app == APP_ID and ver == SCHEMA_VERSION:
        return
    _refuse(path, app, ver, tables)
    conn.execute("BEGIN IMMEDIATE")      # another process may be creating or migrating it right now
    try:
        app, ver, tables = _version(conn)
        _refuse(path, app, ver, tables)
        if app == 0 and tables == 0:
            for statement in _statements(SCHEMA_V1):
                conn.execute(statement)
            conn.execute(f"PRAGMA application_id = {APP_ID}")
        else:
            for v in range(ver, SCHEMA_VERSION):
                MIGRATIONS[v](conn)
        conn.execute(f"PRAGMA user_version = {SCHEMA_VERSION}")
        conn.execute("COMMIT")
    except BaseException:
        if conn.in_transaction:
            conn.execute("ROLLBACK")
        raise


def _refuse(path: str, app: int, ver: int, tables: int) -> None:
    if app == 0 and tables == 0 and ver == 0:
        return                                   # a new, empty file
    if app != APP_ID:
        raise ValueError(f"{path}: an SQLite file of another application (application_id {app:#x}), "
                         "not a qatlab run store; give another store path")
    if ver > SCHEMA_VERSION:
        raise ValueError(f"{path}: written by a newer qatlab (store schema v{ver}; this qatlab reads up to "
                         f"v{SCHEMA_VERSION}); upgrade qatlab to open it")


def _statements(script: str) -> list[str]:
    return [s.strip() for s in script.split(";") if s.strip()]


# ----------------------------------------------------------------------------- migrations

def _migrate_0_to_1(conn) -> None:
    """v0 (before versioned layouts): runs without notes/sweep point/provenance/heartbeat, owner
    as one JSON text, and one JSON object per metrics row in ``metric_rows(run_id, seq, row)``."""
    conn.execute("ALTER TABLE runs RENAME TO runs_v0")
    conn.execute("ALTER TABLE artifacts RENAME TO artifacts_v0")
    for statement in _statements(SCHEMA_V1):
        conn.execute(statement)
    old = conn.execute("SELECT id, name, status, config, created, started, ended, message, owner, final "
                       "FROM runs_v0").fetchall()
    for rid, name, status, config, created, started, ended, message, owner, final in old:
        owner = json.loads(owner or "{}")
        conn.execute("INSERT INTO runs (id, name, status, config, created, started, ended, message, owner_host, "
                     "owner_pid, owner_page, final) VALUES (?,?,?,?,?,?,?,?,?,?,?,?)",
                     (rid, name or rid[:8], status, config, created, started, ended, message or "",
                      owner.get("host"), owner.get("pid"), owner.get("page"), final or "{}"))
        rows = [json.loads(text) for (text,) in
                conn.execute("SELECT row FROM metric_rows WHERE run_id = ? ORDER BY seq", (rid,))]
        R.insert_rows(conn, rid, rows)
    conn.execute("INSERT INTO artifacts SELECT run_id, name, data FROM artifacts_v0")
    for table in ("runs_v0", "artifacts_v0", "metric_rows"):
        conn.execute(f"DROP TABLE {table}")


#: MIGRATIONS[v](conn) turns schema v into v + 1 inside the caller's transaction.
MIGRATIONS = {0: _migrate_0_to_1}
assert sorted(MIGRATIONS) == list(range(SCHEMA_VERSION))


def default_path() -> str:
    """``$QATLAB_STORE``, else ``${XDG_DATA_HOME:-~/.local/share}/qatlab/runs.sqlite``."""
    env = os.environ.get("QATLAB_STORE")
    if env:
        return env
    base = os.environ.get("XDG_DATA_HOME") or os.path.join(os.path.expanduser("~"), ".local", "share")
    return os.path.join(base, "qatlab", "runs.sqlite")
