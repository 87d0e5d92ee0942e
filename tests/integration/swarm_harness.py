"""Start a real coordinator and real nodes as separate processes on 127.0.0.1 (for swarm tests)."""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import time
import urllib.request
from pathlib import Path

from engine.paths import base_checkpoint_dir
from engine.self_command import polis_command


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class Swarm:
    def __init__(self, tmp: Path, *, stages: int = 2, settings: list[str] = (), checkpoint: str | None = None,
                 coordinator_args: list[str] = (), coordinator_command=None):
        self.tmp = tmp
        self.stages = stages
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.checkpoint = checkpoint or str(base_checkpoint_dir())
        self.settings = list(settings)
        self.coordinator_args = list(coordinator_args)  #: more ``polis coordinator`` flags
        #: the coordinator's command line from its polis argv (None: ``polis`` itself), e.g.
        #: ``tests.support.equal_shares.coordinator_argv``
        self.coordinator_command = coordinator_command
        self.coordinator: subprocess.Popen | None = None
        self.nodes: dict[str, subprocess.Popen] = {}
        self.env = dict(os.environ, POLIS_TORCH_THREADS="1", OMP_NUM_THREADS="1")

    def _spawn(self, name: str, *argv: str, command: list[str] | None = None) -> subprocess.Popen:
        log = open(self.tmp / f"{name}.log", "ab")
        try:
            return subprocess.Popen(command or polis_command(*argv), stdout=log, stderr=subprocess.STDOUT,
                                    stdin=subprocess.DEVNULL, env=self.env)
        finally:
            log.close()

    def start_coordinator(self) -> None:
        argv = ["-v", "coordinator", "--db", str(self.tmp / "c.db"), "--port", str(self.port), "--stages",
                str(self.stages), "--checkpoint", self.checkpoint,
                "--admin-token-file", str(self.tmp / "token")]
        for item in self.settings:
            argv += ["--set", item]
        argv += self.coordinator_args
        command = None if self.coordinator_command is None else self.coordinator_command(*argv)
        self.coordinator = self._spawn("coordinator", *argv, command=command)
        self.wait(lambda s: True, timeout_s=60, what="the coordinator to answer")

    def start_node(self, name: str, *extra: str, misbehaviour: str | None = None,
                   slowdown: float | None = None, coordinator: str | None = None) -> None:
        """A torch node named ``name``; ``extra``: more ``polis node`` flags (e.g. ``--inference-only``);
        ``misbehaviour``: a hostile real node (``tests.support.hostile_node.MISBEHAVIOURS``);
        ``slowdown``: a node that computes that many times slower (``tests.support.throttled_node``);
        ``coordinator``: the swarm URL it is given (default: this coordinator's, unpinned)."""
        argv = ["-v", "node", "--coordinator", coordinator or self.url, "--identity", name,
                "--data-dir", str(self.tmp / name),
                "--checkpoint", self.checkpoint, "--backend", "torch", *extra]
        command = None
        if misbehaviour is not None:
            from tests.support.hostile_node import node_argv

            command = node_argv(misbehaviour, *argv)
        elif slowdown is not None:
            from tests.support import throttled_node

            command = throttled_node.node_argv(slowdown, *argv)
        self.nodes[name] = self._spawn(name, *argv, command=command)

    def start_wan(self, mix: str, nodes: int):
        """The emulated internet of ``engine.swarm.wan_swarm`` for ``nodes`` nodes on ``mix`` (e.g.
        ``home:0,metro``); returns its ``WanRelay``: give node i ``coordinator=relay.coordinator_url(i)``
        and ``*relay.node_args(i)``. Stopped with the swarm."""
        from engine.swarm.wan_swarm import WanRelay

        swarm = self

        class _Spawner:
            def spawn(self, name: str, argv: list[str]) -> subprocess.Popen:
                swarm.nodes[name] = swarm._spawn(name, *argv)
                return swarm.nodes[name]
        return WanRelay.start(_Spawner(), self.tmp, mix, nodes, self.port)

    def pinned_url(self) -> str:
        """The swarm URL the coordinator printed, pinning its key (``#key=...``)."""
        deadline = time.monotonic() + 15
        while time.monotonic() < deadline:
            for line in (self.tmp / "coordinator.log").read_text(errors="replace").splitlines():
                if "nodes join with: polis node --coordinator '" in line:
                    return line.split("--coordinator '", 1)[1].split("'", 1)[0]
            time.sleep(0.2)
        raise AssertionError(f"the coordinator printed no swarm URL; logs in {self.tmp}")

    def log_has(self, name: str, text: str) -> bool:
        """Whether process ``name``'s log contains ``text``."""
        log = self.tmp / f"{name}.log"
        return log.exists() and text in log.read_text(errors="replace")

    def peer_id(self, name: str) -> str:
        """The peer id node ``name`` has (its identity is created here first if it has none yet)."""
        from engine.net.identity import KEY_FILE_NAME, load_or_create_key_file

        # the node's own key file, written here: an existing file wins over any keyring in the node,
        # and this process's keyring (usable in some test runs, not in the nodes) must not decide the id
        return load_or_create_key_file(self.tmp / name / KEY_FILE_NAME, what="test node").peer_id

    def stats(self, *, admin: bool = True) -> dict | None:
        """The coordinator's stats (None while it does not answer): the admin view with the token it
        wrote (``admin``), else the public one; the longest page of versions, steps and evals."""
        from engine.swarm.stats_view import MAX_PAGE

        path = f"/api/admin/stats?limit={MAX_PAGE}" if admin else f"/api/stats?limit={MAX_PAGE}"
        try:
            headers = {"Authorization": f"Bearer {(self.tmp / 'token').read_text().strip()}"} if admin else {}
            with urllib.request.urlopen(urllib.request.Request(self.url + path, headers=headers), timeout=5) as r:
                return json.loads(r.read())
        except OSError:
            return None

    def wait(self, predicate, *, timeout_s: float, what: str) -> dict:
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            stats = self.stats()
            if stats is not None and predicate(stats):
                return stats
            time.sleep(0.5)
        raise AssertionError(f"timed out after {timeout_s} s waiting for {what}; last stats: {self.stats()}; "
                             f"logs in {self.tmp}\n{self.log_tails()}")

    def log_tails(self, lines: int = 12) -> str:
        """The last ``lines`` warnings and errors of every process's log (CI keeps no files)."""
        out = []
        for log in sorted(self.tmp.glob("*.log")):
            worth = [line for line in log.read_text(errors="replace").splitlines()
                     if " WARNING " in line or " ERROR " in line or "Traceback" in line]
            out.append(f"--- {log.name}: " + ("\n".join(worth[-lines:]) or "(no warnings)"))
        return "\n".join(out)

    def finish(self) -> None:
        token = (self.tmp / "token").read_text().strip()
        request = urllib.request.Request(self.url + "/api/finish", method="POST", data=b"",
                                         headers={"Authorization": f"Bearer {token}"})
        urllib.request.urlopen(request, timeout=5).read()

    def kill_coordinator(self, sig: int = signal.SIGKILL) -> None:
        assert self.coordinator is not None
        self.coordinator.send_signal(sig)
        self.coordinator.wait(15)

    def stop(self) -> None:
        procs = list(self.nodes.values()) + ([self.coordinator] if self.coordinator else [])
        for p in procs:
            if p.poll() is None:
                p.send_signal(signal.SIGTERM)
        for p in procs:
            try:
                p.wait(10)
            except subprocess.TimeoutExpired:
                p.kill()
                p.wait()
