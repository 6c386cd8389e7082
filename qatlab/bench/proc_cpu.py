"""CPU seconds per kind of process, from Linux's ``/proc``: where a dashboard round's CPU went.

Kinds: ``server`` (the app's process), ``workers`` (its descendants: the local cluster's nannies and
worker processes), ``renderer`` (Chromium's renderer processes: the pages' scripts, layout and
painting) and ``browser`` (every other Chromium process: the browser itself, GPU/compositing,
network). A process that exits inside a window takes its CPU seconds with it, so windows should
span processes that live through them (the cluster's workers and an open page do).
"""
from __future__ import annotations

import os

KINDS = ("workers", "server", "renderer", "browser")


def stat_fields(path: str) -> list[str] | None:
    """The fields after the command name of a ``/proc/.../stat`` file (its state first), or None."""
    try:
        with open(path) as f:
            return f.read().rsplit(")", 1)[1].split()
    except (OSError, IndexError):
        return None


def cpu_seconds(fields: list[str]) -> float:
    """User + system CPU seconds of :func:`stat_fields` (a process's or one thread's)."""
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def _stat(pid: str) -> tuple[int, float] | None:
    """(parent pid, CPU seconds) of process ``pid``, or None if it is gone."""
    fields = stat_fields(f"/proc/{pid}/stat")
    return None if fields is None else (int(fields[1]), cpu_seconds(fields))


def _cmdline(pid: str) -> str:
    try:
        with open(f"/proc/{pid}/cmdline", "rb") as f:
            return f.read().replace(b"\0", b" ").decode(errors="replace")
    except OSError:
        return ""


def cpu_by_kind(server_pid: int) -> dict[str, float]:
    """CPU seconds used so far by each of :data:`KINDS` (all 0.0 where ``/proc`` is missing)."""
    out = dict.fromkeys(KINDS, 0.0)
    if not os.path.isdir("/proc"):
        return out
    stats = {pid: s for pid in os.listdir("/proc") if pid.isdigit() and (s := _stat(pid)) is not None}
    parents = {int(pid): ppid for pid, (ppid, _) in stats.items()}

    def under_server(pid: int) -> bool:
        while pid > 1:
            pid = parents.get(pid, 0)
            if pid == server_pid:
                return True
        return False

    for pid, (_, cpu) in stats.items():
        if int(pid) == server_pid:
            out["server"] += cpu
        elif under_server(int(pid)):
            out["workers"] += cpu
        else:
            cmd = _cmdline(pid)
            if "chrom" in cmd.split(" ", 1)[0]:
                out["renderer" if "--type=renderer" in cmd else "browser"] += cpu
    return out


def used_since(before: dict[str, float], server_pid: int) -> dict[str, float]:
    """CPU seconds per kind used since ``before`` (a :func:`cpu_by_kind` reading)."""
    now = cpu_by_kind(server_pid)
    return {k: now[k] - before.get(k, 0.0) for k in KINDS}
