"""``polis node``: run a node from the command line, optionally supervised over JSON lines.

Swarm choice (exactly one): ``--coordinator URL``; ``--lan`` (find a coordinator
with zeroconf, or host one if none answers, see ``engine.swarm.local_swarm``;
``POLIS_LAN_INTERFACES`` and ``POLIS_LAN_SERVICE_TYPE`` restrict it, see
``engine.net.discovery``); ``--demo`` (start the demo's coordinator and its other 3
nodes: the same swarm as ``polis demo``, on this machine). With ``--lan`` the node says on
stderr (and as a ``log`` event) which coordinator it joined or hosts.

``--inference-only`` joins as an inference replica: the node holds one stage
without optimiser state, takes no training work, serves generation routes only,
and its stage's leader trainer streams it int8 weight deltas against a shared
shadow after every step, so it never drifts (``engine.swarm.inference_replica``).

``--wan-relay HOST:PORT`` (``POLIS_WAN_RELAY``) sends every peer link through an
emulated-WAN relay (``engine.net.wan_hub``; ``polis demo --wan`` starts one) as a node
on ``--wan-profile``; ``--signal-url`` replaces the signalling URL of the welcome (a
node that joins through a proxy signals through it too).

With ``--control stdio`` the node speaks ``engine.control_protocol``: commands
on stdin, events on stdout (logs on stderr). It starts contributing at once;
``pause`` leaves the swarm but keeps the process, ``start`` rejoins, ``stop`` (or
end of stdin) exits 0. Limits arrive as flags and later as ``set_limits``.
"""

from __future__ import annotations

import argparse
import asyncio
import logging
import os
import signal
import sys
import threading
from pathlib import Path
from typing import Any

from engine import __version__
from engine.control_protocol import ProtocolError, add_limit_arguments, encode_event, limits_from_args, parse_command

log = logging.getLogger(__name__)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    swarm = parser.add_mutually_exclusive_group()
    swarm.add_argument("--coordinator", metavar="URL", help="coordinator to join, e.g. http://10.0.0.5:8700")
    swarm.add_argument("--lan", action="store_true", help="find a coordinator on the LAN (host one if none)")
    swarm.add_argument("--demo", action="store_true",
                       help="run the local demo swarm (the same as `polis demo`) on this machine")
    parser.add_argument("--lan-port", type=int, default=0, metavar="PORT",
                        help="with --lan: port of the coordinator this node hosts if none answers (default: any free)")
    parser.add_argument("--control", choices=["stdio", "none"], default="none",
                        help="stdio: JSON-lines commands on stdin, events on stdout (for the desktop app)")
    parser.add_argument("--backend", default="auto", help="stage backend: auto, torch or mlx (default: auto)")
    parser.add_argument("--device", default=None, help="device override, e.g. cpu, cuda:1, mps")
    parser.add_argument("--checkpoint", default=None, help="base checkpoint directory (default: the shipped one)")
    parser.add_argument("--data-dir", default=None, help="where this node keeps its identity and stage checkpoints")
    parser.add_argument("--identity", default="node", help="name of this node's identity (several nodes per machine)")
    parser.add_argument("--max-layers", type=int, default=None, help="most decoder layers this node may hold")
    parser.add_argument("--inference-only", action="store_true",
                        help="join as an inference replica: hold one stage without optimiser state, do no "
                             "training, serve generation only, and follow the stage leader's weights through "
                             "quantised deltas")
    parser.add_argument("--signal-url", default=None, metavar="URL",
                        help="signalling websocket to use instead of the one the coordinator names (e.g. through "
                             "the same proxy as --coordinator)")
    parser.add_argument("--wan-relay", default=os.environ.get("POLIS_WAN_RELAY") or None, metavar="HOST:PORT",
                        help="send every peer link through the emulated-WAN relay whose control address this is "
                             "(default: $POLIS_WAN_RELAY; `polis demo --wan` starts one)")
    parser.add_argument("--wan-profile", default=os.environ.get("POLIS_WAN_PROFILE") or "metro", metavar="NAME",
                        help="this node's link profile at that relay (default: $POLIS_WAN_PROFILE or metro)")
    parser.add_argument("--selftest", action="store_true",
                        help="load a stage of the base checkpoint, run one forward pass, print the result and exit")
    add_limit_arguments(parser)


class StdioControl:
    """Events to stdout (one JSON line each); commands from stdin on a reader thread."""

    def __init__(self, enabled: bool) -> None:
        self.enabled = enabled
        self._lock = threading.Lock()

    def emit(self, event: str, **fields: Any) -> None:
        if not self.enabled:
            return
        try:
            line = encode_event(event, **fields)
        except (ValueError, TypeError) as exc:
            log.warning("could not encode %s event: %s", event, exc)
            return
        with self._lock:
            sys.stdout.write(line)
            sys.stdout.flush()

    def start_reader(self, loop: asyncio.AbstractEventLoop, on_command, on_eof) -> None:
        def read() -> None:
            for line in sys.stdin:
                if not line.strip():
                    continue
                try:
                    command = parse_command(line)
                except ProtocolError as exc:
                    self.emit("error", message=f"Ignored an invalid command: {exc}", hint="", fatal=False)
                    continue
                loop.call_soon_threadsafe(on_command, command)
            loop.call_soon_threadsafe(on_eof)

        threading.Thread(target=read, name="polis-stdin", daemon=True).start()


async def _find_or_host(args, control: StdioControl, stack: list) -> str:
    """The coordinator URL to join, starting a local one for --lan (none found) or --demo."""
    if args.coordinator:
        return args.coordinator
    if args.lan:
        from engine.swarm.local_swarm import find_or_host_lan

        def progress(message: str) -> None:
            print(f"polis node: {message}", file=sys.stderr, flush=True)
            control.emit("log", level="info", message=message[0].upper() + message[1:] + ".")

        control.emit("state", state="connecting", detail="looking for a coordinator on the local network")
        hosted, url = await find_or_host_lan(args, on_progress=progress)
        if hosted is not None:
            stack.append(hosted)
        return url
    from engine.swarm.local_swarm import host_local_coordinator

    coordinator, url = await host_local_coordinator(args, lan=False)
    stack.append(coordinator)
    if args.demo:
        from engine.swarm.local_swarm import spawn_helper_node

        stack.append(spawn_helper_node(url, args))
    return url


async def _export(args, control: StdioControl, command: dict) -> None:
    """The ``export`` command of the local demo's owner: ``polis export`` on the demo's run directory."""
    from engine.swarm.demo_export import ExportFailed, export_run
    from engine.swarm.local_swarm import demo_run_dir

    out = Path(command["out"]).expanduser()
    control.emit("log", level="info", message=f"Exporting the demo's model to {out} (this takes a minute or two).")
    try:
        summary = await export_run(demo_run_dir(args), out, version=command.get("version"))
    except ExportFailed as exc:
        control.emit("error", message=f"The export did not finish: {exc}", hint=exc.hint)
        return
    control.emit("exported", path=summary["out_dir"], version=int(summary["version"]))


async def _main(args) -> int:
    from engine.net.identity import IdentityStoreConfig, load_or_create_identity
    from engine.swarm.node import Node, NodeConfig

    control = StdioControl(args.control == "stdio")
    limits = limits_from_args(args)
    data_dir = Path(args.data_dir) if args.data_dir else None
    identity = load_or_create_identity(IdentityStoreConfig(username=args.identity, fallback_dir=data_dir))
    stack: list = []
    loop = asyncio.get_running_loop()
    stopping = asyncio.Event()
    node = None

    def request_stop() -> None:
        stopping.set()
        if node is not None:
            node.request_stop()

    for sig in (signal.SIGINT, signal.SIGTERM):  # early: a stop while finding or hosting still cleans up
        try:
            loop.add_signal_handler(sig, request_stop)
        except (NotImplementedError, RuntimeError):
            pass
    try:
        finding = loop.create_task(_find_or_host(args, control, stack), name="polis-find-swarm")
        stopper = loop.create_task(stopping.wait(), name="polis-stop-wait")
        await asyncio.wait({finding, stopper}, return_when=asyncio.FIRST_COMPLETED)
        stopper.cancel()
        if not finding.done():
            finding.cancel()
            await asyncio.gather(finding, return_exceptions=True)
            return 0
        url = finding.result()
        if stopping.is_set():
            return 0
        config = NodeConfig(coordinator_url=url, backend=args.backend, device=args.device,
                            base_checkpoint=args.checkpoint, data_dir=args.data_dir,
                            cpu_threads=limits.get("cpu_threads"), max_layers=args.max_layers,
                            upload_mbps=limits.get("upload_mbps"), download_mbps=limits.get("download_mbps"),
                            inference_only=args.inference_only, signal_url=args.signal_url,
                            wan_relay=args.wan_relay, wan_profile=args.wan_profile)
        node = Node(config, identity, on_event=control.emit)
        await node.start_compute()
        control.emit("hello", version=__version__, peer_id=identity.peer_id, fingerprint=identity.fingerprint,
                     key_storage=identity.storage, key_storage_note=identity.storage_note,
                     device=node.rt.device_description, backend=node.rt.backend_name, memory_gb=None)

        def on_command(command: dict) -> None:
            cmd = command["cmd"]
            if cmd == "stop":
                node.request_stop()
            elif cmd == "pause":
                node.pause()
            elif cmd == "start":
                node.resume()
            elif cmd == "set_limits":
                node.set_limits(command["limits"])
                node.emit_status()
            elif cmd == "status":
                node.emit_status(force=True)
            elif cmd == "export":
                if not args.demo:
                    control.emit("error", message="Export model works for the local demo this node runs.",
                                 hint="Export another run with `polis export --run-dir DIR --out FOLDER`.")
                elif exporting:
                    control.emit("error", message="An export is already running.",
                                 hint="Wait for it to finish; its folder opens when it is written.")
                else:
                    task = loop.create_task(_export(args, control, command), name="polis-export")
                    exporting.add(task)
                    task.add_done_callback(exporting.discard)

        exporting: set[asyncio.Task] = set()
        if control.enabled:
            control.start_reader(loop, on_command, node.request_stop)
        await node.run()
        return 0
    finally:
        for item in reversed(stack):
            closer = getattr(item, "stop", None) or getattr(item, "terminate", None)
            result = closer()
            if asyncio.iscoroutine(result):
                await result


def run(args) -> int:
    if args.selftest:
        from engine.swarm.selftest import run_selftest

        return run_selftest(args)
    if args.control == "stdio":
        # stdout belongs to the event stream; everything else logs to stderr
        logging.getLogger().handlers[:] = []
        logging.basicConfig(level=logging.INFO, stream=sys.stderr,
                            format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    if not (args.coordinator or args.lan or args.demo):
        print("polis node: choose a swarm: --coordinator URL, --lan or --demo", file=sys.stderr)
        return 2
    if args.wan_relay:
        from engine.net.wan_hub import parse_address

        try:
            parse_address(args.wan_relay)
        except ValueError as exc:
            print(f"polis node: --wan-relay: {exc}", file=sys.stderr)
            return 2
    if not 0 <= args.lan_port <= 65535:
        print("polis node: --lan-port must be in 0-65535 (0: any free port)", file=sys.stderr)
        return 2
    if args.lan:
        from engine.net.discovery import lan_env_problem

        problem = lan_env_problem()  # a bad POLIS_LAN_* value is one clear line, before anything starts
        if problem:
            print(f"polis node: {problem}", file=sys.stderr)
            return 2
    try:
        return asyncio.run(_main(args))
    except KeyboardInterrupt:
        return 0
    except Exception as exc:  # the boundary: one clear line for the user and the supervisor
        log.exception("node failed")
        StdioControl(args.control == "stdio").emit("error", message=str(exc), fatal=True,
                                                   hint="See the log for details; check the settings and restart.")
        print(f"polis node: {exc}", file=sys.stderr)
        return 1
