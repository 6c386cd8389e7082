"""The run store: every run, its metric rows and its model in one SQLite file (see :mod:`.runstore`)."""
from .runstore import ACTIVE, ENDED, HEARTBEAT_STALE_SECONDS, STATUSES, RunRecord, RunStore, record
from .schema import APP_ID, SCHEMA_VERSION, StoreCorruptError, StoreLockedError, default_path, when_unlocked

__all__ = ["ACTIVE", "APP_ID", "ENDED", "HEARTBEAT_STALE_SECONDS", "RunRecord", "RunStore", "SCHEMA_VERSION",
           "STATUSES", "StoreCorruptError", "StoreLockedError", "default_path", "record", "when_unlocked"]
