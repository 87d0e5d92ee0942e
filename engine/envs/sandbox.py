"""Run an untrusted Python snippet in a separate, limited process and return its capped output.

What the sandbox guarantees, per system (``Sandbox.isolation()`` says which layers this
machine gives; with ``require_isolation=True``, the default, a snippet never runs without them):

Linux, where unprivileged user namespaces work (``unshare -U`` succeeds; most distributions,
not Ubuntu 24.04 with its AppArmor restriction unless allowed): the snippet runs under
``unshare --user --map-root-user --net --pid --mount --fork --kill-child`` and
``engine/envs/sandbox_runner.py`` (read its docstring) then
- network: a new network namespace with only a loopback device that is down: no socket can
  reach this machine's services or the internet;
- processes: a new PID namespace (it sees and can signal only its own processes; when its
  first process ends or is killed, the kernel kills every process in it) and RLIMIT_NPROC
  counted inside its own user namespace, so a fork bomb stops at ``max_processes`` even when
  Polis runs as root (root's exemption from RLIMIT_NPROC does not reach a user namespace);
- files: every mount it inherits is read-only (it can delete or change nothing outside its
  own directory); home directories and ``/root`` are covered by an empty tmpfs (except the
  interpreter's own directories, bound back read-only), so ``~/.ssh`` is not there; ``/tmp``,
  ``/var/tmp`` and ``/dev/shm`` are fresh tmpfs of at most ``disk_mb`` (and 1 MB); ``/dev``
  holds only null, zero, full, random and urandom (no disks, no terminals); a nested
  user namespace locks these mounts so the snippet cannot unmount them;
- resources: RLIMIT_AS (memory), RLIMIT_CPU (CPU seconds), RLIMIT_FSIZE (one file's size),
  RLIMIT_NOFILE, no core dumps; a wall-clock deadline kills the whole process group;
- output: stdout and stderr together, at most ``output_bytes``; past that the run is killed and
  the text ends with a truncation marker. The environment is scrubbed (PATH, HOME, TMPDIR,
  LANG only); cwd and HOME are a fresh directory.
When Polis itself runs as root, the snippet runs as uid ``nobody`` (65534) where the
interpreter allows it, so file permissions protect the host as well; where it does not (a venv
whose base interpreter lives under ``/root``), it keeps uid 0 behind the namespaces: then a
pids cgroup holds the process cap (root is exempt from RLIMIT_NPROC in any namespace) and
only the hidden paths (homes, ``/etc/shadow`` ...) keep root-readable files from it.
It does NOT protect against kernel exploits, and it reads (but cannot change) the rest of
the file system outside the hidden paths, e.g. the Polis source and the Python library. The
snippet shares its supervisor's namespace, so it can forge the status line that says how it
ended (which it controls anyway); the parent bounds and validates that line.

Linux without user namespaces, macOS, Windows: no namespace layer exists. With
``require_isolation=False`` the snippet runs with the resource limits (macOS does not enforce
RLIMIT_AS; RLIMIT_NPROC counts all of the user's processes), a fresh cwd/HOME, the scrubbed
environment, the wall-clock kill of its process group and the output cap, but WITH network
access and the user's file permissions. On Windows there are no rlimits: only the wall clock
and the output cap hold, so the default refuses to run there.

What it does not know: tools, tool-call formats, episodes (``engine.envs.tools``).
"""

from __future__ import annotations

import json
import logging
import os
import selectors
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
from dataclasses import dataclass, field, replace
from pathlib import Path

from engine.envs.pids_cgroup import PidsCgroup

log = logging.getLogger(__name__)

TRUNCATION_MARKER = "\n[output truncated: the sandbox output limit of {limit} bytes was reached]\n"
_RUNNER_SOURCE = (Path(__file__).with_name("sandbox_runner.py")).read_text(encoding="utf-8")
_EXIT_MEMORY = 86
NOBODY = 65534  #: the uid a sandbox started by root runs as, where the interpreter allows
_UNSHARE_ARGS = ("--user", "--map-root-user", "--net", "--pid", "--mount", "--fork", "--kill-child")


@dataclass(frozen=True)
class SandboxLimits:
    """Limits of one snippet run; validated on construction.

    Fields:
      wall_s: wall-clock seconds before the whole process group is killed.
      cpu_s: CPU seconds per process (RLIMIT_CPU; SIGXCPU, then SIGKILL one second later).
      memory_mb: address space per process (RLIMIT_AS), in MiB.
      max_processes: processes the snippet may have at once (RLIMIT_NPROC in its namespace).
      file_size_mb: largest file it may write (RLIMIT_FSIZE), in MiB.
      disk_mb: size of its private /tmp (its working directory lives there), in MiB.
      open_files: file descriptors per process (RLIMIT_NOFILE).
      output_bytes: stdout + stderr kept; more kills the run and appends a marker.
      code_bytes: largest snippet accepted (UTF-8 bytes).
      require_isolation: refuse to run unless the namespace layers (network, PID, mounts) work.
      hidden_paths: directories covered by an empty tmpfs, files covered by /dev/null
        (default: homes, /root, /etc/shadow, /etc/gshadow, /etc/sudoers).
    """

    wall_s: float = 10.0
    cpu_s: int = 5
    memory_mb: int = 512
    max_processes: int = 16
    file_size_mb: int = 16
    disk_mb: int = 32
    open_files: int = 64
    output_bytes: int = 16_384
    code_bytes: int = 65_536
    require_isolation: bool = True
    hidden_paths: tuple[str, ...] = field(default_factory=lambda: _default_hidden_paths())

    def __post_init__(self) -> None:
        checks = {"wall_s": (0.1, 600), "cpu_s": (1, 600), "memory_mb": (32, 65_536),
                  "max_processes": (1, 4096), "file_size_mb": (1, 65_536), "disk_mb": (1, 65_536),
                  "open_files": (8, 65_536), "output_bytes": (64, 64 * 1024 * 1024),
                  "code_bytes": (1, 16 * 1024 * 1024)}
        for name, (lo, hi) in checks.items():
            value = getattr(self, name)
            if not lo <= value <= hi:
                raise ValueError(f"SandboxLimits.{name} must be in [{lo}, {hi}], got {value}")
        if any(not os.path.isabs(p) for p in self.hidden_paths):
            raise ValueError(f"SandboxLimits.hidden_paths must be absolute, got {self.hidden_paths}")


def _default_hidden_paths() -> tuple[str, ...]:
    paths = {str(Path.home()), "/root", "/home", "/Users", "/etc/shadow", "/etc/gshadow", "/etc/sudoers"}
    return tuple(sorted(p for p in paths if p not in ("/", "")))


@dataclass(frozen=True)
class SandboxResult:
    """What one run did.

    Fields:
      ok: it ran and exited with status 0 within every limit.
      output: stdout + stderr (decoded, invalid bytes replaced), capped, with the marker if cut.
      exit_code: the snippet's exit status, if it exited.
      signal_name: the signal that ended it (``SIGKILL``, ``SIGXCPU`` ...), if one did.
      limit: which limit ended or refused it: ``wall_s``, ``cpu_s``, ``memory_mb``,
        ``output_bytes``, ``code_bytes``, ``isolation``, ``sandbox_error`` (the sandbox itself
        failed before the snippet ran); ``None`` if none did.
      truncated: the output was cut at ``output_bytes``.
      wall_s: seconds from start to the end of the process group.
      layers: the isolation layers that were in force (see the module docstring).
    """

    ok: bool
    output: str
    exit_code: int | None
    signal_name: str | None
    limit: str | None
    truncated: bool
    wall_s: float
    layers: tuple[str, ...]

    def describe(self) -> str:
        """One line for the model: what happened and, if it failed, why."""
        if self.ok:
            return "exit 0"
        if self.limit == "wall_s":
            return "killed: the wall-clock time limit was reached"
        if self.limit == "cpu_s":
            return "killed: the CPU time limit was reached"
        if self.limit == "memory_mb":
            return "error: the memory limit was reached"
        if self.limit == "output_bytes":
            return "killed: the output limit was reached"
        if self.limit in ("code_bytes", "isolation", "sandbox_error"):
            return f"refused: {self.output.strip()}"
        if self.signal_name:
            return f"killed by {self.signal_name}"
        return f"exit {self.exit_code}"


class Sandbox:
    """Runs snippets one at a time per call; thread-safe (each call is its own process)."""

    def __init__(self, limits: SandboxLimits | None = None, python: str | None = None) -> None:
        self.limits = limits or SandboxLimits()
        self._python = python or sys.executable

    # -- what this machine gives -----------------------------------------------------
    _probe_lock = threading.Lock()
    _probe: bool | None = None

    @classmethod
    def namespaces_available(cls) -> bool:
        """Whether ``unshare`` can create user, network, PID and mount namespaces here (cached)."""
        with cls._probe_lock:
            if cls._probe is None:
                cls._probe = False
                unshare = shutil.which("unshare")
                if sys.platform.startswith("linux") and unshare:
                    try:
                        r = subprocess.run([unshare, *_UNSHARE_ARGS, "true"], capture_output=True, timeout=10)
                        cls._probe = r.returncode == 0
                        if r.returncode != 0:
                            log.warning("sandbox: unshare refused namespaces: %s",
                                        r.stderr.decode(errors="replace").strip())
                    except (OSError, subprocess.TimeoutExpired) as e:
                        log.warning("sandbox: unshare probe failed: %s", e)
            return cls._probe

    _nobody_probe: dict[str, bool] = {}

    def runs_as_nobody(self) -> bool:
        """Whether this interpreter starts as uid ``nobody`` (when Polis runs as root; cached).

        A venv whose base interpreter lives under ``/root`` does not: then the sandbox keeps
        uid 0 behind the namespaces and a pids cgroup, and hidden paths cover the secrets.
        """
        with self._probe_lock:
            if self._python not in self._nobody_probe:
                try:
                    r = subprocess.run([self._python, "-I", "-S", "-c", "import ctypes, json, resource"],
                                       capture_output=True, timeout=20, cwd="/", user=NOBODY, group=NOBODY,
                                       extra_groups=[], env={"PATH": "/usr/bin:/bin"})
                    ok = r.returncode == 0
                except (OSError, subprocess.SubprocessError):
                    ok = False
                if not ok:
                    log.warning("sandbox: %s cannot run as uid %d; the sandbox keeps uid 0 inside its namespaces",
                                self._python, NOBODY)
                self._nobody_probe[self._python] = ok
            return self._nobody_probe[self._python]

    def isolation(self) -> str:
        """``namespaces`` (Linux, full guarantees), ``rlimits`` (weak) or ``none``."""
        if self.namespaces_available():
            return "namespaces"
        if sys.platform == "win32":
            return "none"
        return "rlimits"

    # -- one run --------------------------------------------------------------------
    def run(self, code: str, *, wall_s: float | None = None) -> SandboxResult:
        """Run ``code``; ``wall_s`` may only shorten the configured wall-clock limit."""
        lim = self.limits
        wall = min(lim.wall_s, wall_s) if wall_s is not None else lim.wall_s
        start = time.monotonic()
        data = code.encode("utf-8", errors="replace")
        if len(data) > lim.code_bytes:
            return _refusal(f"the snippet is {len(data)} bytes; the limit is {lim.code_bytes}", "code_bytes")
        if getattr(sys, "frozen", False) and self._python == sys.executable:
            return _refusal("this packaged build has no separate Python interpreter for the sandbox; "
                            "pass one with Sandbox(python=...)", "isolation")
        mode = self.isolation()
        if mode != "namespaces" and (lim.require_isolation or mode == "none"):
            return _refusal("the python tool needs Linux user namespaces (unshare -U) on this machine; "
                            "they are not available here", "isolation")
        if wall <= 0:
            return _refusal("no tool time is left in this episode", "wall_s")
        workdir = tempfile.mkdtemp(prefix="polis-sandbox-")
        try:
            return self._run(data, wall, workdir, mode, start)
        finally:
            shutil.rmtree(workdir, ignore_errors=True)

    def _run(self, data: bytes, wall: float, workdir: str, mode: str, start: float) -> SandboxResult:
        lim = self.limits
        status_r, status_w = os.pipe()
        keep = _outermost({os.path.realpath(p) for p in (sys.prefix, sys.base_prefix, sys.exec_prefix,
                                                         os.path.dirname(os.path.realpath(self._python)))})
        cfg = {"status_fd": status_w, "build_view": mode == "namespaces", "require_isolation": lim.require_isolation,
               "workdir": workdir, "disk_mb": lim.disk_mb, "keep_paths": keep,
               "hidden_paths": list(lim.hidden_paths), "cpu_s": lim.cpu_s, "memory_mb": lim.memory_mb,
               "file_size_mb": lim.file_size_mb, "open_files": lim.open_files,
               # the supervisor (and, outside a PID namespace, nothing else) counts too
               "nproc": lim.max_processes + 2}
        argv = [self._python, "-I", "-S", "-c", _RUNNER_SOURCE, json.dumps(cfg)]
        if mode == "namespaces":
            argv = [shutil.which("unshare") or "unshare", *_UNSHARE_ARGS, *argv]
        cgroup = None
        as_nobody = os.name == "posix" and os.geteuid() == 0 and self.runs_as_nobody()
        if as_nobody:  # an unprivileged uid: file permissions protect the host, RLIMIT_NPROC holds
            os.chown(workdir, NOBODY, NOBODY)
        elif os.name == "posix" and os.geteuid() == 0:
            # root's processes are exempt from RLIMIT_NPROC even inside a user namespace
            cgroup = PidsCgroup.create(lim.max_processes + 3)
            if cgroup is None and lim.require_isolation:
                os.close(status_r)
                os.close(status_w)
                return _refusal("Polis runs as root and no pids cgroup is writable here, so a fork bomb "
                                "could not be contained; run Polis as a normal user", "isolation")
            if cgroup is not None:  # the shell joins the cgroup, then becomes the sandbox
                argv = ["/bin/sh", "-c", 'echo $$ > "$0" && exec "$@"', cgroup.procs_file, *argv]
        env = {"PATH": "/usr/bin:/bin", "HOME": workdir, "TMPDIR": workdir, "LANG": "C.UTF-8",
               "PYTHONIOENCODING": "utf-8", "PYTHONDONTWRITEBYTECODE": "1"}
        try:
            proc = subprocess.Popen(argv, stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                                    pass_fds=(status_w,), env=env, cwd=workdir, start_new_session=True,
                                    user=NOBODY if as_nobody else None, group=NOBODY if as_nobody else None,
                                    extra_groups=[] if as_nobody else None)
        except OSError as e:
            os.close(status_r)
            os.close(status_w)
            if cgroup is not None:
                cgroup.remove()
            return _refusal(f"the sandbox could not start: {e}", "isolation")
        os.close(status_w)
        try:
            try:
                assert proc.stdin is not None
                proc.stdin.write(data)
                proc.stdin.close()
            except (BrokenPipeError, OSError):
                pass
            output, status_text, limit = self._collect(proc, status_r, start + wall)
        finally:
            _kill_group(proc)
            os.close(status_r)
            if cgroup is not None:
                cgroup.remove()
        result = self._result(output, status_text, limit, start)
        if result.layers and (cgroup is not None or as_nobody):
            result = replace(result, layers=(*result.layers, "pids_cgroup" if cgroup else "unprivileged_uid"))
        return result

    def _collect(self, proc: subprocess.Popen, status_r: int, deadline: float) -> tuple[bytes, bytes, str | None]:
        cap = self.limits.output_bytes
        out, status = bytearray(), bytearray()
        assert proc.stdout is not None
        out_fd = proc.stdout.fileno()
        sel = selectors.DefaultSelector()
        sel.register(out_fd, selectors.EVENT_READ, "out")
        sel.register(status_r, selectors.EVENT_READ, "status")
        limit = None
        try:
            while sel.get_map():
                left = deadline - time.monotonic()
                if left <= 0:
                    limit = "wall_s"
                    break
                for key, _ in sel.select(timeout=min(left, 0.5)):
                    chunk = os.read(key.fd, 65_536)
                    if not chunk:
                        sel.unregister(key.fd)
                    elif key.data == "out":
                        out += chunk
                    elif len(status) < 65_536:
                        status += chunk
                if len(out) > cap:
                    limit = "output_bytes"
                    break
        finally:
            sel.close()
        return bytes(out), bytes(status), limit

    def _result(self, output: bytes, status_text: bytes, limit: str | None, start: float) -> SandboxResult:
        cap = self.limits.output_bytes
        truncated = len(output) > cap
        text = output[:cap].decode("utf-8", errors="replace")
        if truncated:
            text += TRUNCATION_MARKER.format(limit=cap)
        try:
            status = json.loads(status_text.decode(errors="replace").split("\n", 1)[0] or "{}")
        except ValueError:
            status = {}
        if not isinstance(status, dict):  # the supervisor wrote it, but the snippet shares its namespace
            status = {}
        if "refused" in status:
            return _refusal(f"the sandbox could not isolate the snippet: {str(status['refused'])[:500]}", "isolation")
        exit_code = status.get("exit") if isinstance(status.get("exit"), int) else None
        sig = status.get("signal")
        sig_name = None
        if isinstance(sig, int):
            try:
                sig_name = signal.Signals(sig).name
            except ValueError:
                sig_name = f"signal {sig}"
        if limit is None:
            if sig_name == "SIGXCPU":
                limit = "cpu_s"
            elif exit_code == _EXIT_MEMORY:
                limit = "memory_mb"
            elif not status:  # no status line: the sandbox itself failed (its output says why)
                limit = "sandbox_error"
        ok = limit is None and exit_code == 0 and not truncated
        return SandboxResult(ok=ok, output=text, exit_code=exit_code, signal_name=sig_name, limit=limit,
                             truncated=truncated, wall_s=time.monotonic() - start,
                             layers=_layers(status.get("layers")))


def _layers(value: object) -> tuple[str, ...]:
    """The layer names of a status line, bounded (it is read back from inside the sandbox)."""
    return tuple(str(x)[:32] for x in value[:16]) if isinstance(value, list) else ()


def _outermost(paths: set[str]) -> list[str]:
    """The paths not inside another one of them (each is bound back once)."""
    return sorted(p for p in paths if not any(q != p and p.startswith(q.rstrip("/") + "/") for q in paths))


def _kill_group(proc: subprocess.Popen) -> None:
    try:
        os.killpg(proc.pid, signal.SIGKILL)
    except (ProcessLookupError, PermissionError):
        pass
    try:
        proc.wait(timeout=10)
    except subprocess.TimeoutExpired:
        log.error("sandbox: process %d did not die after SIGKILL", proc.pid)
    if proc.stdout is not None:
        proc.stdout.close()


def _refusal(reason: str, limit: str) -> SandboxResult:
    return SandboxResult(ok=False, output=reason, exit_code=None, signal_name=None, limit=limit,
                         truncated=False, wall_s=0.0, layers=())
