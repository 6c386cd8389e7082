"""Where and with what a run was made: provenance (versions, commit, CPU) and its owner process.

An owner is ``{"host", "pid", "start", "page"}``: ``start`` is the process's start time in clock
ticks (``/proc/<pid>/stat``), so a pid reused by another process after the owner died is not
taken for the owner.
"""
from __future__ import annotations

import functools
import os
import platform
import socket
import subprocess
import sys


@functools.cache
def provenance() -> dict:
    """qatlab version and git commit (when run from a checkout), numpy/numba/Python versions, CPU model."""
    import numpy
    info = {"qatlab": _qatlab_version(), "commit": _git_commit(), "numpy": numpy.__version__,
            "numba": _version_of("numba"), "python": platform.python_version(),
            "platform": platform.platform(), "cpu": cpu_model(), "cores": os.cpu_count()}
    return info


def _qatlab_version() -> str | None:
    return _version_of("qatlab")


def _version_of(package: str) -> str | None:
    module = sys.modules.get(package)
    if module is not None and getattr(module, "__version__", None):
        return module.__version__
    try:
        from importlib.metadata import version
        return version(package)
    except Exception:   # not installed as a distribution
        return None


def _git_commit() -> str | None:
    """HEAD of the checkout qatlab is imported from (with ``+dirty`` when files differ), or None."""
    here = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    try:
        head = subprocess.run(["git", "-C", here, "rev-parse", "HEAD"], capture_output=True, text=True,
                              timeout=5, check=True).stdout.strip()
        dirty = subprocess.run(["git", "-C", here, "status", "--porcelain", "--untracked-files=no", "--", "."],
                               capture_output=True, text=True, timeout=5).stdout.strip()
    except (OSError, subprocess.SubprocessError):
        return None
    return head + ("+dirty" if dirty else "") if head else None


def cpu_model() -> str:
    """The CPU's model name from /proc/cpuinfo (Linux), else ``platform.processor()``."""
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.lower().startswith(("model name", "hardware", "cpu model")):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def process_start(pid: int) -> int | None:
    """Start time of process ``pid`` in clock ticks since boot, or None (no /proc, no such process)."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            fields = f.read().rsplit(")", 1)[1].split()
    except (OSError, IndexError):
        return None
    return int(fields[19]) if len(fields) > 19 else None


def _zombie(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] == "Z"
    except (OSError, IndexError):
        return False


def this_owner(page: str | None = None) -> dict:
    """The owner record of the calling process (and the page it acts for, if any)."""
    pid = os.getpid()
    return {"host": socket.gethostname(), "pid": pid, "start": process_start(pid), "page": page}


def owner_alive(owner: dict) -> bool:
    """True while the owner's process (on this host) runs: it exists, is not a zombie, and its
    start time matches the recorded one (when both are known)."""
    pid = owner.get("pid")
    if not pid:
        return False
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        pass                      # exists, another user's
    if _zombie(pid):
        return False
    start, now = owner.get("start"), process_start(pid)
    return start is None or now is None or start == now
