"""The real-window check: the app in a real X server (Xvfb), used as a first-time contributor would.

    python tests/gui/real_window.py [--out docs] [--rise-timeout-s 600]

Starts Xvfb (1440x900), opens the window through ``app.main.build_window`` (the code
``polis`` runs) with a fresh user (own HOME, settings, data; consent given; LAN
discovery kept on loopback with a private service type), then, with real mouse
clicks on the widgets:

1. presses Start in the default "Find a swarm on this network" mode; alone, the
   window must say "Waiting for a computer to serve stage 2 — none found on your
   network" (never green, no time counted) and offer "Run a local demo instead";
2. clicks that button: the node restarts as the local demo (the same swarm as
   ``polis demo``) and must turn green only once tokens flow;
3. waits until the policy version moves and the held-out accuracy rises 5 points
   above the version-0 evaluation (then, with ``--learn-for-s``, keeps learning);
4. shows the Log tab, then quits through the window (as the tray's Quit does).

Screenshots of the whole screen (``import -window root``) at those points go to
``--out`` (``docs/`` by default: they are the README's pictures). Afterwards no
process started by the run may be left (found by a marker in their environment).
Prints one JSON summary line (timings in seconds from launch; ``ok``) and exits 0
only if every check held. Needs Linux, Xvfb and ImageMagick's ``import``.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
import uuid
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
MARKER_ENV = "POLIS_REAL_WINDOW_RUN"
SCREEN = "1440x900"
SHOTS = ("real-window-1-ready.png", "real-window-2-alone-waiting.png", "real-window-3-demo-contributing.png",
         "real-window-4-learning.png", "real-window-5-log.png")


def missing_tools() -> list[str]:
    return [tool for tool in ("Xvfb", "import") if shutil.which(tool) is None]


def _processes_with_marker(marker: str) -> list[int]:
    found = []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit() or int(entry.name) == os.getpid():
            continue
        try:
            environ = (entry / "environ").read_bytes()
        except OSError:
            continue
        if f"{MARKER_ENV}={marker}".encode() in environ.split(b"\0"):
            found.append(int(entry.name))
    return found


def _start_xvfb() -> tuple[subprocess.Popen, str]:
    read_fd, write_fd = os.pipe()
    xvfb = subprocess.Popen(["Xvfb", "-displayfd", str(write_fd), "-screen", "0", f"{SCREEN}x24", "-nolisten", "tcp"],
                            pass_fds=(write_fd,), stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    os.close(write_fd)
    with os.fdopen(read_fd) as pipe:
        number = pipe.readline().strip()
    if not number:
        xvfb.kill()
        raise RuntimeError("Xvfb did not start")
    return xvfb, f":{number}"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", type=Path, default=REPO / "docs", help="folder for the screenshots")
    parser.add_argument("--rise-timeout-s", type=float, default=600.0)
    parser.add_argument("--learn-for-s", type=float, default=0.0,
                        help="after the rise, keep learning until this many seconds after the demo click "
                             "(the docs/ pictures use 300)")
    parser.add_argument("--drive", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--summary", type=Path, default=None, help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.drive:
        from tests.gui.real_window_driver import drive

        return drive(args.out, args.summary, args.rise_timeout_s, args.learn_for_s)
    missing = missing_tools()
    if missing or not sys.platform.startswith("linux"):
        print(f"real_window: needs Linux with {', '.join(missing or ['Xvfb', 'import'])}", file=sys.stderr)
        return 2
    args.out.mkdir(parents=True, exist_ok=True)
    marker = uuid.uuid4().hex
    with tempfile.TemporaryDirectory(prefix="polis-real-window-") as tmp:
        home = Path(tmp) / "home"
        (home / ".config" / "Polis").mkdir(parents=True)
        (home / ".config" / "Polis" / "Polis.ini").write_text("[first_run]\nconsent_given=true\n")
        xvfb, display = _start_xvfb()
        summary_path = Path(tmp) / "summary.json"
        env = {**os.environ, "DISPLAY": display, "QT_QPA_PLATFORM": "xcb", "HOME": str(home),
               "XDG_CONFIG_HOME": str(home / ".config"), "XDG_DATA_HOME": str(home / ".local" / "share"),
               "POLIS_DATA_DIR": str(Path(tmp) / "data"), "POLIS_LAN_INTERFACES": "loopback",
               "POLIS_LAN_SERVICE_TYPE": f"_prw{marker[:8]}._tcp.local.", MARKER_ENV: marker,
               "POLIS_REAL_WINDOW_T0": repr(time.time()), "PYTHONPATH": f"{REPO}{os.pathsep}"
               f"{os.environ.get('PYTHONPATH', '')}"}
        env.pop("POLIS_NODE_COMMAND", None)
        env.pop("WAYLAND_DISPLAY", None)
        driver = subprocess.Popen([sys.executable, str(Path(__file__).resolve()), "--drive", "--out", str(args.out),
                                   "--summary", str(summary_path), "--rise-timeout-s", str(args.rise_timeout_s),
                                   "--learn-for-s", str(args.learn_for_s)],
                                  cwd=REPO, env=env)
        try:
            code = driver.wait(timeout=args.rise_timeout_s + args.learn_for_s + 480)
        except subprocess.TimeoutExpired:
            driver.send_signal(signal.SIGINT)
            code = driver.wait(timeout=30)
        quit_at = time.monotonic()
        left = _processes_with_marker(marker)
        while left and time.monotonic() - quit_at < 5.0:
            time.sleep(0.25)
            left = _processes_with_marker(marker)
        for pid in left:  # do not leave them running on this machine, but the check has failed
            try:
                os.kill(pid, signal.SIGKILL)
            except OSError:
                pass
        xvfb.terminate()
        xvfb.wait(timeout=10)
        summary = json.loads(summary_path.read_text()) if summary_path.exists() else {"ok": False,
                                                                                      "error": "no summary"}
    summary["processes_left"] = len(left)
    summary["driver_exit_code"] = code
    summary["ok"] = bool(summary.get("ok")) and code == 0 and not left
    print(json.dumps(summary))
    return 0 if summary["ok"] else 1


if __name__ == "__main__":
    sys.exit(main())
