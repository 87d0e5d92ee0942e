"""``polis node --lan`` end to end on loopback: the first node hosts a coordinator, the second joins it.

Two real node processes with ``POLIS_LAN_INTERFACES=loopback`` (nothing leaves
127.0.0.1) and a private ``POLIS_LAN_SERVICE_TYPE`` (concurrent runs stay apart).
The hosted coordinator's port is fixed with ``--lan-port`` so that the test can
read its ``GET /api/stats``.
"""

from __future__ import annotations

import json
import os
import re
import secrets
import signal
import socket
import subprocess
import time
import urllib.request
from pathlib import Path

import pytest

from engine.paths import base_checkpoint_dir
from engine.self_command import polis_command

pytestmark = [pytest.mark.network, pytest.mark.slow]

ROOT = Path(__file__).resolve().parents[2]


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _stats(port: int) -> dict | None:
    try:
        with urllib.request.urlopen(f"http://127.0.0.1:{port}/api/stats", timeout=2) as r:
            return json.loads(r.read())
    except OSError:
        return None


def _wait(predicate, timeout_s: float, what: str, procs: list[subprocess.Popen], logs: list[Path]):
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        value = predicate()
        if value:
            return value
        for proc, log in zip(procs, logs):
            assert proc.poll() is None, f"a node exited ({proc.returncode}) while waiting for {what}:\n" \
                                        + log.read_text(errors="replace")[-3000:]
        time.sleep(0.3)
    tails = "\n".join(f"--- {log.name}\n{log.read_text(errors='replace')[-3000:]}" for log in logs)
    raise AssertionError(f"timed out after {timeout_s} s waiting for {what}\n{tails}")


def test_a_lan_node_hosts_a_coordinator_and_a_second_finds_and_joins_it(tmp_path):
    env = dict(os.environ, POLIS_TORCH_THREADS="1", OMP_NUM_THREADS="1", POLIS_LAN_INTERFACES="loopback",
               POLIS_LAN_SERVICE_TYPE=f"_pl{secrets.token_hex(4)}._tcp.local.",
               PYTHONPATH=os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")])))
    ports = {"a": _free_port(), "b": _free_port()}
    procs: list[subprocess.Popen] = []
    logs: list[Path] = []

    def spawn(name: str) -> subprocess.Popen:
        log = tmp_path / f"{name}.log"
        with open(log, "wb") as out:
            proc = subprocess.Popen(polis_command("-v", "node", "--lan", "--lan-port", str(ports[name]),
                                                  "--identity", f"lan-{name}", "--data-dir", str(tmp_path / name),
                                                  "--checkpoint", str(base_checkpoint_dir()), "--backend", "torch"),
                                    stdin=subprocess.DEVNULL, stdout=out, stderr=subprocess.STDOUT, env=env)
        procs.append(proc)
        logs.append(log)
        return proc

    try:
        a = spawn("a")
        _wait(lambda: _stats(ports["a"]), 30, "node a to host a coordinator", procs, logs)
        b = spawn("b")
        stats = _wait(lambda: (s := _stats(ports["a"])) and len(s["nodes"]) == 2 and s, 40,
                      "node b to join node a's coordinator", procs, logs)
        assert sorted(n["stage"] for n in stats["nodes"]) == [0, 1]  # one per stage
        assert _stats(ports["b"]) is None  # b found a's coordinator and hosts none
        url = f"http://127.0.0.1:{ports['a']}"
        assert f"hosting one at {url}" in logs[0].read_text(errors="replace")
        joined = logs[1].read_text(errors="replace")
        # the advert pins the coordinator's key, so b joins a's URL with that key (#key=...)
        assert re.search(re.escape(f"joining the coordinator at {url}#key=") + r"[A-Za-z0-9_-]+ \(found on the LAN\)",
                         joined), joined[-2000:]
        for proc in (b, a):
            proc.send_signal(signal.SIGTERM)
            assert proc.wait(timeout=20) == 0
        assert _stats(ports["a"]) is None  # the hosted coordinator went with its node
    finally:
        for proc in procs:
            if proc.poll() is None:
                proc.kill()
                proc.wait()
