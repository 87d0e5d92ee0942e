"""The program that runs *inside* the sandbox: build the view, set the limits, run the snippet.

``engine.envs.sandbox`` starts this file's source with ``python -I -S -c SOURCE CONFIG`` (under
``unshare`` on Linux), writes the snippet to its stdin and reads one JSON status line from the
status pipe. It imports nothing but the standard library and is never imported by the product
(it does not know Polis). Steps, in order, all before one line of the snippet runs:

1. (Linux, mount namespace) make every inherited mount read-only, nosuid and private; put an
   empty read-only tmpfs over each hidden directory (home directories) and /dev/null over each
   hidden file (/etc/shadow), keeping the interpreter's own directories visible by bind mount;
   fresh size-capped tmpfs on ``/tmp``, ``/var/tmp`` and ``/dev/shm``; a ``/dev`` with only
   null, zero, full, random and urandom; a fresh ``/proc`` for the new PID namespace; then
   enter a nested user + mount namespace so that none of these mounts can be unmounted again.
2. resource limits: address space, CPU seconds, processes, file size, open files, no core.
3. fork: the child runs the snippet in a fresh directory (cwd and HOME); the parent (PID 1 of
   the namespace when there is one) waits, writes the status line and exits, which kills every
   process the snippet left behind.
"""

import ctypes
import json
import os
import resource
import signal
import sys
import traceback

MS_RDONLY, MS_NOSUID, MS_NODEV, MS_NOEXEC = 1, 2, 4, 8
MS_REMOUNT, MS_BIND, MS_MOVE, MS_REC, MS_PRIVATE = 32, 4096, 8192, 16384, 1 << 18
CLONE_NEWNS, CLONE_NEWUSER = 0x00020000, 0x10000000
SYS_MOUNT_SETATTR, AT_FDCWD, AT_RECURSIVE = 442, -100, 0x8000
MOUNT_ATTR_RDONLY, MOUNT_ATTR_NOSUID = 0x1, 0x2
EXIT_MEMORY = 86


class _MountAttr(ctypes.Structure):
    _fields_ = [("attr_set", ctypes.c_uint64), ("attr_clr", ctypes.c_uint64),
                ("propagation", ctypes.c_uint64), ("userns_fd", ctypes.c_uint64)]


def _libc():
    libc = ctypes.CDLL(None, use_errno=True)
    libc.mount.argtypes = [ctypes.c_char_p, ctypes.c_char_p, ctypes.c_char_p, ctypes.c_ulong, ctypes.c_char_p]
    libc.syscall.restype = ctypes.c_long
    return libc


def _check(rc, what):
    if rc != 0:
        err = ctypes.get_errno()
        raise OSError(err, f"{what}: {os.strerror(err)}")


def _mount(libc, src, target, fstype, flags, data=None):
    enc = lambda s: None if s is None else s.encode()  # noqa: E731
    _check(libc.mount(enc(src), enc(target), enc(fstype), flags, enc(data)), f"mount {target}")


def _read_only_everything(libc):
    attr = _MountAttr(MOUNT_ATTR_RDONLY | MOUNT_ATTR_NOSUID, 0, MS_PRIVATE, 0)  # /dev needs its nodes
    rc = libc.syscall(SYS_MOUNT_SETATTR, AT_FDCWD, b"/", AT_RECURSIVE, ctypes.byref(attr), ctypes.sizeof(attr))
    _check(rc, "mount_setattr / read-only")


DEV_NODES = ("null", "zero", "full", "random", "urandom")


def _minimal_dev(libc):
    """Replace /dev by a tmpfs holding only the harmless nodes (bound from the host), fd links, shm."""
    staged = []
    for name in DEV_NODES:
        if os.path.exists(f"/dev/{name}"):
            stage = f"/tmp/.dev-{name}"
            open(stage, "w").close()
            _mount(libc, f"/dev/{name}", stage, None, MS_BIND)
            staged.append((stage, name))
    _mount(libc, "tmpfs", "/dev", "tmpfs", MS_NOSUID | MS_NOEXEC, "size=64k,mode=755")
    for stage, name in staged:
        open(f"/dev/{name}", "w").close()
        _mount(libc, stage, f"/dev/{name}", None, MS_MOVE)
        os.remove(stage)
    for i, name in enumerate(("stdin", "stdout", "stderr")):
        os.symlink(f"/proc/self/fd/{i}", f"/dev/{name}")
    os.symlink("/proc/self/fd", "/dev/fd")
    os.mkdir("/dev/shm")
    _mount(libc, "tmpfs", "/dev/shm", "tmpfs", MS_NOSUID | MS_NODEV, "size=1m,mode=1777")
    _mount(libc, None, "/dev", None, MS_REMOUNT | MS_RDONLY | MS_NOSUID | MS_NOEXEC, "size=64k,mode=755")


def _is_under(path, root):
    return path == root or path.startswith(root.rstrip("/") + "/")


def _build_view(cfg, layers):
    """Steps 1 of the module docstring; raises OSError if the kernel refuses a step."""
    libc = _libc()
    _mount(libc, None, "/", None, MS_REC | MS_PRIVATE)
    _read_only_everything(libc)
    layers.append("read_only_root")
    _mount(libc, "tmpfs", "/tmp", "tmpfs", MS_NOSUID | MS_NODEV, f"size={cfg['disk_mb']}m,mode=1777")
    if os.path.isdir("/var/tmp"):
        _mount(libc, "tmpfs", "/var/tmp", "tmpfs", MS_NOSUID | MS_NODEV, "size=1m,mode=1777")
    layers.append("private_tmp")
    _minimal_dev(libc)
    layers.append("minimal_dev")
    keep = sorted({os.path.realpath(p) for p in cfg["keep_paths"] if os.path.isdir(p)})
    for hidden in cfg["hidden_paths"]:
        hidden = os.path.realpath(hidden)
        if os.path.isfile(hidden):  # a file (e.g. /etc/shadow): /dev/null over it
            _mount(libc, "/dev/null", hidden, None, MS_BIND)
            continue
        if not os.path.isdir(hidden) or _is_under("/tmp", hidden) or _is_under(hidden, "/tmp"):
            continue  # "/" or "/tmp" itself: never hidden (the private /tmp already covers /tmp)
        inside = [k for k in keep if _is_under(k, hidden)]
        staged = []
        for i, k in enumerate(inside):  # park the kept directories on the private /tmp
            stage = f"/tmp/.keep{i}"
            os.mkdir(stage)
            _mount(libc, k, stage, None, MS_BIND | MS_REC)
            staged.append((stage, k))
        _mount(libc, "tmpfs", hidden, "tmpfs", MS_NOSUID | MS_NODEV, "size=64k,mode=755")
        for stage, k in staged:
            os.makedirs(k, exist_ok=True)
            _mount(libc, stage, k, None, MS_MOVE)
            os.rmdir(stage)
        _mount(libc, None, hidden, None, MS_REMOUNT | MS_RDONLY | MS_NOSUID | MS_NODEV, "size=64k,mode=755")
    layers.append("hidden_homes")
    try:
        _mount(libc, "proc", "/proc", "proc", MS_NOSUID | MS_NODEV | MS_NOEXEC)
        layers.append("private_proc")
    except OSError:
        pass  # the host /proc stays (its process list is visible, not signalable: other PID namespace)
    # Lock the mounts: a nested user + mount namespace cannot unmount what its parent mounted.
    _check(libc.unshare(CLONE_NEWUSER | CLONE_NEWNS), "unshare nested user namespace")
    for name, text in (("setgroups", "deny"), ("uid_map", "0 0 1"), ("gid_map", "0 0 1")):
        with open(f"/proc/self/{name}", "w") as f:
            f.write(text)
    layers.append("locked_mounts")


def _set_limits(cfg):
    mb = 1024 * 1024
    resource.setrlimit(resource.RLIMIT_CORE, (0, 0))
    resource.setrlimit(resource.RLIMIT_CPU, (cfg["cpu_s"], cfg["cpu_s"] + 1))
    resource.setrlimit(resource.RLIMIT_FSIZE, (cfg["file_size_mb"] * mb,) * 2)
    resource.setrlimit(resource.RLIMIT_NOFILE, (cfg["open_files"],) * 2)
    if hasattr(resource, "RLIMIT_AS"):
        resource.setrlimit(resource.RLIMIT_AS, (cfg["memory_mb"] * mb,) * 2)
    if hasattr(resource, "RLIMIT_NPROC"):
        resource.setrlimit(resource.RLIMIT_NPROC, (cfg["nproc"],) * 2)


def _worker(code, workdir):
    os.chdir(workdir)
    sys.argv = ["main.py"]
    try:
        exec(compile(code, "main.py", "exec"), {"__name__": "__main__", "__builtins__": __builtins__})
    except SystemExit as e:
        code_ = e.code if isinstance(e.code, int) else (0 if e.code is None else 1)
        if e.code is not None and not isinstance(e.code, int):
            sys.stderr.write(f"{e.code}\n")  # as the interpreter does for sys.exit("message")
        sys.stdout.flush()
        os._exit(code_ & 0xFF)
    except MemoryError:
        sys.stdout.flush()
        sys.stderr.write("MemoryError: the sandbox memory limit was reached\n")
        sys.stderr.flush()
        os._exit(EXIT_MEMORY)
    except BaseException:
        sys.stdout.flush()
        traceback.print_exc(limit=-4)
        sys.stderr.flush()
        os._exit(1)
    try:
        sys.stdout.flush()
        sys.stderr.flush()
    except OSError:
        os._exit(1)
    os._exit(0)


def main():
    cfg = json.loads(sys.argv[1])
    status = os.fdopen(cfg["status_fd"], "w")
    code = sys.stdin.read()
    layers, problems = [], []
    if cfg["build_view"]:
        try:
            _build_view(cfg, layers)
        except OSError as e:
            problems.append(str(e))
    if problems and cfg["require_isolation"]:
        status.write(json.dumps({"refused": "; ".join(problems), "layers": layers}) + "\n")
        status.flush()
        os._exit(0)
    workdir = "/tmp/sandbox" if "private_tmp" in layers else cfg["workdir"]
    os.makedirs(workdir, exist_ok=True)
    os.environ.pop("PWD", None)  # set by the cgroup-joining shell; a host path
    os.environ["HOME"] = os.environ["TMPDIR"] = workdir
    with open(os.path.join(workdir, "main.py"), "w") as f:
        f.write(code)
    _set_limits(cfg)
    layers.append("rlimits")
    devnull = os.open(os.devnull, os.O_RDONLY)
    os.dup2(devnull, 0)
    pid = os.fork()
    if pid == 0:
        status.close()
        _worker(code, workdir)
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    while True:
        try:
            _, wstatus = os.waitpid(pid, 0)
            break
        except ChildProcessError:
            wstatus = 0
            break
        except InterruptedError:
            continue
    result = {"layers": layers, "problems": problems}
    if os.WIFSIGNALED(wstatus):
        result["signal"] = os.WTERMSIG(wstatus)
    else:
        result["exit"] = os.WEXITSTATUS(wstatus)
    status.write(json.dumps(result) + "\n")
    status.flush()
    if os.getpid() != 1:  # no PID namespace: take the snippet's leftovers down with the group
        os.killpg(os.getpgrp(), signal.SIGKILL)
    os._exit(0)


if __name__ == "__main__":
    main()
