"""CPU seconds per kind of process, from Linux's ``/proc``: where a dashboard round's CPU went.

Kinds: ``server`` (the app's process), ``workers`` (its descendants: the local cluster's nannies and
worker processes), ``renderer`` (Chromium's renderer processes: the pages' scripts, layout and
painting) and ``browser`` (every other Chromium process: the browser itself, GPU/compositing,
network). A process that exits inside a window takes its last CPU seconds with it (counted 0, not
minus its lifetime: the previous page's renderer closing during a headless round did that), so
windows should span processes that live through them (the cluster's workers and an open page do).
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


def process_cpu(server_pid: int) -> dict[int, tuple[str, float]]:
    """``{pid: (kind, CPU seconds so far)}`` of every process of one of :data:`KINDS` ({} without ``/proc``)."""
    if not os.path.isdir("/proc"):
        return {}
    stats = {int(pid): s for pid in os.listdir("/proc") if pid.isdigit() and (s := _stat(pid)) is not None}
    parents = {pid: ppid for pid, (ppid, _) in stats.items()}

    def under_server(pid: int) -> bool:
        while pid > 1:
            pid = parents.get(pid, 0)
            if pid == server_pid:
                return True
        return False

    out = {}
    for pid, (_, cpu) in stats.items():
        if pid == server_pid:
            out[pid] = "server", cpu
        elif under_server(pid):
            out[pid] = "workers", cpu
        else:
            cmd = _cmdline(str(pid))
            if "chrom" in cmd.split(" ", 1)[0]:
                out[pid] = ("renderer" if "--type=renderer" in cmd else "browser"), cpu
    return out


def used_since(before: dict[int, tuple[str, float]], server_pid: int) -> dict[str, float]:
    """CPU seconds per kind used since ``before`` (a :func:`process_cpu` reading): what the processes
    alive at both readings used in between, and all of what the new ones used. A process that
    exited in between counts 0 (its last seconds are lost with it), never minus its lifetime."""
    out = dict.fromkeys(KINDS, 0.0)
    for pid, (kind, cpu) in process_cpu(server_pid).items():
        then = before.get(pid)
        out[kind] += cpu - then[1] if then is not None and then[0] == kind else cpu
    return out
