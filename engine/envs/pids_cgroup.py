"""A child cgroup with ``pids.max``: the process cap of a sandbox started by root.

Root's processes are exempt from RLIMIT_NPROC in every user namespace (the kernel checks the
real uid, not the namespace), so a sandbox that has to keep uid 0 gets its own pids cgroup
under this process's pids cgroup (cgroup v1 ``pids`` or v2 with the pids controller), where
the kernel refuses a fork past ``pids.max``. Creating it needs write access there (root).

What it does not know: sandboxes, snippets (``engine.envs.sandbox`` puts its process group in).
"""

from __future__ import annotations

import logging
import os
import signal
import threading
import time
from pathlib import Path

log = logging.getLogger(__name__)


class PidsCgroup:
    """A child cgroup with ``pids.max`` set: the process cap that also holds for root."""

    _counter = 0
    _counter_lock = threading.Lock()

    def __init__(self, path: Path) -> None:
        self.path = path
        self.procs_file = str(path / "cgroup.procs")

    @classmethod
    def create(cls, max_pids: int) -> "PidsCgroup | None":
        """A fresh cgroup under this process's own pids cgroup, or ``None`` if none is writable."""
        base = _own_pids_cgroup()
        if base is None:
            return None
        with cls._counter_lock:
            cls._counter += 1
            name = f"polis-sandbox-{os.getpid()}-{cls._counter}"
        path = base / name
        try:
            path.mkdir()
            (path / "pids.max").write_text(f"{max_pids}\n")
        except OSError as e:
            log.warning("sandbox: cannot use pids cgroup %s: %s", path, e)
            try:
                path.rmdir()
            except OSError:
                pass
            return None
        return cls(path)

    def remove(self) -> None:
        """Kill what is left in it and remove it (the kernel needs it empty)."""
        for _ in range(100):
            try:
                pids = [int(x) for x in Path(self.procs_file).read_text().split()]
            except OSError:
                pids = []
            for pid in pids:
                try:
                    os.kill(pid, signal.SIGKILL)
                except ProcessLookupError:
                    pass
            try:
                self.path.rmdir()
                return
            except FileNotFoundError:
                return
            except OSError:
                time.sleep(0.02)
        log.error("sandbox: could not remove cgroup %s", self.path)


def _own_pids_cgroup() -> Path | None:
    """The directory of this process's pids cgroup (v1 ``pids`` or v2 with the pids controller)."""
    try:
        lines = Path("/proc/self/cgroup").read_text().splitlines()
    except OSError:
        return None
    for line in lines:
        _, controllers, rel = line.split(":", 2)
        if "pids" in controllers.split(","):
            base = Path("/sys/fs/cgroup/pids") / rel.lstrip("/")
        elif controllers == "" and "pids" in _read("/sys/fs/cgroup/cgroup.controllers").split():
            base = Path("/sys/fs/cgroup") / rel.lstrip("/")
        else:
            continue
        if (base / "cgroup.procs").exists() and os.access(base, os.W_OK):
            return base
    return None


def _read(path: str) -> str:
    try:
        return Path(path).read_text()
    except OSError:
        return ""
