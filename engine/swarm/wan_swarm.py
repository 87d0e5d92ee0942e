"""An emulated internet for a swarm on this machine: the relay process and how nodes use it.

``polis wan-relay`` (:func:`run`) is one process holding a
:class:`~engine.net.wan_hub.WanHub` (every node-to-node WebRTC link, shaped from its
two ends' profiles) and one :class:`~engine.net.tcp_delay_proxy.TcpDelayProxy` per
node in front of the coordinator (that node's websockets: its session and its
signalling, shaped by its own profile). When everything listens it writes
``--ready-file`` (JSON: ``control`` address, ``coordinator_ports`` per node,
``profiles`` per node) and serves until SIGTERM.

:class:`WanRelay` is the starting side, used by ``polis demo --wan`` and the swarm
benches: it spawns the relay beside the coordinator, waits for its ready file, and
says for node ``i`` which coordinator URL to join and which node options
(``--signal-url``, ``--wan-relay``, ``--wan-profile``) send its traffic through the
relay. :func:`hub_stats` reads the relay's counters (packets shaped, dropped) over
its control address.

What it does not know: what the swarm computes, the run's settings.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import logging
import signal
import sys
import time
from pathlib import Path
from typing import Any

from engine.atomic_file import atomic_write_text

log = logging.getLogger(__name__)

#: seconds the starting side waits for the relay's ready file
RELAY_START_S = 30.0


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--mix", required=True, help="profile of each node, e.g. continental or home:1,metro")
    parser.add_argument("--nodes", type=int, required=True, help="how many nodes the swarm has")
    parser.add_argument("--coordinator", required=True, metavar="HOST:PORT", help="the coordinator's address")
    parser.add_argument("--ready-file", required=True, help="JSON written once every socket listens")
    parser.add_argument("--profiles", default=None, help="TOML file of extra profiles (see engine.net.wan_profiles)")
    parser.add_argument("--seed", type=int, default=0, help="seed of the relay's loss and jitter")


async def _serve(args: argparse.Namespace) -> int:
    from engine.net.tcp_delay_proxy import TcpDelayProxy
    from engine.net.wan_hub import WanHub, parse_address
    from engine.net.wan_profiles import coordinator_impairment, load_profiles, parse_mix

    profiles = load_profiles(args.profiles)
    names = parse_mix(args.mix, args.nodes, profiles)
    target = parse_address(args.coordinator)
    hub = WanHub(profiles, seed=args.seed)
    proxies = [TcpDelayProxy(target, *coordinator_impairment(profiles[name])) for name in names]
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(sig, stop.set)
    try:
        control = await hub.start()
        ports = [(await proxy.start())[1] for proxy in proxies]
        atomic_write_text(args.ready_file, json.dumps({"control": list(control), "coordinator_ports": ports,
                                                       "profiles": names}))
        log.info("WAN relay: control %s:%d, nodes on %s", control[0], control[1], ", ".join(names))
        await stop.wait()
    finally:
        log.info("WAN relay stats: %s", json.dumps(hub.stats()))
        for proxy in proxies:
            await proxy.close()
        await hub.close()
    return 0


def run(args: argparse.Namespace) -> int:
    try:
        return asyncio.run(_serve(args))
    except ValueError as exc:
        print(f"polis wan-relay: {exc}", file=sys.stderr)
        return 2


def hub_stats(control: tuple[str, int]) -> dict[str, Any] | None:
    """The relay's counters (``WanHub.stats``), or None if it does not answer (call off any event loop)."""
    from engine.net.errors import ProtocolViolation
    from engine.net.wan_hub import HubStats, StatsRequest, ask_hub

    try:
        answer = asyncio.run(ask_hub(control, StatsRequest()))
    except (OSError, ProtocolViolation):
        return None
    return answer.stats if isinstance(answer, HubStats) else None


class WanRelay:
    """A started relay process for a demo swarm of ``nodes`` nodes (see the module docstring)."""

    def __init__(self, control: tuple[str, int], coordinator_ports: list[int], profiles: list[str]) -> None:
        self.control = control
        self.coordinator_ports = coordinator_ports
        self.profiles = profiles

    @classmethod
    def start(cls, processes, run_dir: Path, mix: str, nodes: int, coordinator_port: int,
              profiles_file: str | None = None) -> "WanRelay":
        """Spawn ``polis wan-relay`` in ``processes`` (a ``DemoProcesses``) and wait until it listens."""
        from engine.net.wan_profiles import load_profiles, parse_mix

        try:  # a bad mix or profile file is one clear error, before any process starts
            parse_mix(mix, nodes, load_profiles(profiles_file))
        except ValueError as exc:
            raise RuntimeError(f"--wan: {exc}") from None
        ready = run_dir / "wan-relay.json"
        ready.unlink(missing_ok=True)
        argv = ["-v", "wan-relay", "--mix", mix, "--nodes", str(nodes), "--coordinator",
                f"127.0.0.1:{coordinator_port}", "--ready-file", str(ready)]
        if profiles_file:
            argv += ["--profiles", str(profiles_file)]
        proc = processes.spawn("wan-relay", argv)
        deadline = time.monotonic() + RELAY_START_S
        while not ready.exists():
            if proc.poll() is not None or time.monotonic() > deadline:
                raise RuntimeError(f"the WAN relay did not start; see {run_dir / 'wan-relay.log'}")
            time.sleep(0.1)
        info = json.loads(ready.read_text())
        return cls(tuple(info["control"]), list(info["coordinator_ports"]), list(info["profiles"]))

    def coordinator_url(self, index: int) -> str:
        """The URL node ``index`` joins: its own delay proxy in front of the coordinator."""
        return f"http://127.0.0.1:{self.coordinator_ports[index]}"

    def node_args(self, index: int) -> list[str]:
        """``polis node`` options that send node ``index``'s links and signalling through the relay."""
        return ["--signal-url", f"ws://127.0.0.1:{self.coordinator_ports[index]}/signal",
                "--wan-relay", f"{self.control[0]}:{self.control[1]}", "--wan-profile", self.profiles[index]]

    def stats(self) -> dict[str, Any] | None:
        return hub_stats(self.control)
