"""Host a coordinator inside this process, and start helper nodes, for LAN and demo swarms.

``polis node --lan`` (:func:`find_or_host_lan`) browses for a coordinator with
zeroconf for :data:`LAN_BROWSE_S` seconds and joins the first that answers;
if none does, it hosts one (listening on every interface, or only on 127.0.0.1
when ``POLIS_LAN_INTERFACES=loopback``) and advertises its base URL. Two nodes
started at the same moment may both host: right after advertising, a hosting
node browses again for :data:`LAN_RECHECK_S` seconds and, if it sees another
coordinator with a smaller run id, withdraws its own and joins that one, so
both converge on one coordinator. (A node that starts hosting more than
``LAN_RECHECK_S`` seconds after the other's advert appeared would have found it
in its first browse.)

``polis node --demo`` (the desktop app's "local demo") runs the same swarm as
``polis demo``, through the same recipe (``engine.swarm.demo``): a coordinator
process (:func:`host_local_coordinator` with ``lan=False``) and the demo's other
``stages x replicas - 1`` node processes (:func:`spawn_helper_node`), each with one
compute thread; this node is the last of the four. Each run starts afresh in
``DATA_DIR/demo-run`` (logs kept there until the next run); the processes end with
this node (SIGTERM on stop; on Linux also when this node is killed). It knows how to
start these pieces, not what they do.
"""

from __future__ import annotations

import asyncio
import logging
import shutil
import time
from pathlib import Path

from engine import __version__

log = logging.getLogger(__name__)

#: Seconds ``--lan`` browses for a coordinator before hosting one.
LAN_BROWSE_S = 5.0
#: Seconds a node that has just started hosting browses again for a rival coordinator.
LAN_RECHECK_S = 3.0


class HostedCoordinator:
    """A coordinator on this process's loop, plus its LAN advert when there is one."""

    def __init__(self, coordinator, advertiser=None) -> None:
        self.coordinator = coordinator
        self.advertiser = advertiser

    @property
    def run_id(self) -> str:
        return self.coordinator.run_id

    async def stop(self) -> None:
        """Withdraw the advert (zeroconf sends a goodbye) first, then stop serving."""
        advertiser, self.advertiser = self.advertiser, None
        try:
            if advertiser is not None:
                await advertiser.close()
        finally:
            await self.coordinator.stop()


def _data_dir(args) -> Path:
    if args.data_dir:
        return Path(args.data_dir)
    from engine.paths import user_data_dir

    return user_data_dir()


async def host_local_coordinator(args, lan: bool, discovery=None) -> tuple[HostedCoordinator | DemoPart, str]:
    """Start a coordinator for a swarm on this machine: ``lan``: in this process, reachable and
    advertised on the LAN; otherwise the local demo's coordinator process (see the module docstring).

    ``discovery`` (a ``DiscoveryConfig``; default: from the environment) says which
    interfaces the LAN coordinator listens on and is advertised on. The URL returned
    is the advertised one (what other nodes join), or ``http://127.0.0.1:PORT``.
    ``args.lan_port`` (0 or missing: any free port) fixes its port.
    """
    if not lan:
        return await _start_demo_coordinator(args)
    from engine.paths import base_checkpoint_dir
    from engine.swarm.coordinator import Coordinator, CoordinatorConfig

    base = args.checkpoint or str(base_checkpoint_dir())
    db = _data_dir(args) / "lan-coordinator.db"
    db.parent.mkdir(parents=True, exist_ok=True)
    from engine.net.discovery import DiscoveryConfig

    discovery = discovery or DiscoveryConfig.from_env()
    listen = discovery.listen_host
    coordinator = Coordinator(CoordinatorConfig(db_path=str(db), base_checkpoint=base, host=listen,
                                                port=int(getattr(args, "lan_port", 0) or 0)))
    url = await coordinator.start()
    hosted = HostedCoordinator(coordinator)
    try:
        from engine.net.discovery import LanAdvertiser, ServiceAdvert, reachable_address

        port = int(url.rsplit(":", 1)[1])
        url = f"http://{reachable_address(discovery, listen)}:{port}"
        hosted.advertiser = LanAdvertiser(ServiceAdvert(role="coordinator", peer_id=coordinator.run_id,
                                                        signalling_url=url, version=__version__,
                                                        coordinator_key=coordinator.identity.public_key),
                                          discovery)
        await hosted.advertiser.start()
    except BaseException:
        await hosted.stop()
        raise
    log.info("hosting a LAN coordinator at %s (advertised with zeroconf as %s)", url, discovery.service_type)
    return hosted, url


async def find_or_host_lan(args, discovery=None, on_progress=None) -> tuple[HostedCoordinator | None, str]:
    """``--lan``: the coordinator URL to join, and the coordinator this process hosts (None if it joined one).

    ``on_progress(message)`` hears what is happening, in words for the user.
    """
    from engine.net.discovery import DiscoveryConfig, find_coordinator, find_coordinators

    discovery = discovery or DiscoveryConfig.from_env()
    say = on_progress or (lambda message: None)
    found = await find_coordinator(LAN_BROWSE_S, discovery, joinable_only=True)
    if found is not None:
        url = found.advert.coordinator_url
        say(f"joining the coordinator at {url} (found on the LAN)")
        return None, url
    hosted, url = await host_local_coordinator(args, lan=True, discovery=discovery)
    try:
        rivals = [s for s in await find_coordinators(LAN_RECHECK_S, discovery, joinable_only=True)
                  if s.advert.peer_id != hosted.run_id]
    except BaseException:
        await hosted.stop()
        raise
    winner = min(rivals, key=lambda s: s.advert.peer_id, default=None)
    if winner is not None and winner.advert.peer_id < hosted.run_id:
        log.info("another coordinator (run %s) started at the same time; withdrawing ours (run %s)",
                 winner.advert.peer_id, hosted.run_id)
        await hosted.stop()
        url = winner.advert.coordinator_url
        say(f"joining the coordinator at {url} (found on the LAN; it started at the same time as ours)")
        return None, url
    say(f"no coordinator answered on the LAN; hosting one at {url}")
    return hosted, url


#: seconds the demo coordinator process gets to answer its stats API.
DEMO_COORDINATOR_START_S = 60.0


class DemoPart:
    """Processes of the local demo that this node started; ``await stop()`` ends them."""

    def __init__(self, processes) -> None:
        self.processes = processes

    async def stop(self) -> None:
        await self.processes.stop_async()


def demo_run_dir(args) -> Path:
    return _data_dir(args) / "demo-run"


async def _start_demo_coordinator(args) -> tuple[DemoPart, str]:
    """The demo's coordinator as its own process, exactly as ``polis demo`` starts it."""
    from engine.swarm.demo import DemoProcesses, _free_port, coordinator_alive, coordinator_argv

    run_dir = demo_run_dir(args)
    shutil.rmtree(run_dir, ignore_errors=True)  # every local demo starts from version 0, like `polis demo`
    run_dir.mkdir(parents=True, exist_ok=True)
    port = _free_port()
    url = f"http://127.0.0.1:{port}"
    processes = DemoProcesses(run_dir, die_with_parent=True)
    proc = processes.spawn("coordinator", coordinator_argv(run_dir, port, checkpoint=args.checkpoint))
    part = DemoPart(processes)
    deadline = time.monotonic() + DEMO_COORDINATOR_START_S
    try:
        while not await asyncio.to_thread(coordinator_alive, url):
            if proc.poll() is not None or time.monotonic() > deadline:
                raise RuntimeError(f"the demo coordinator did not start; see {run_dir / 'coordinator.log'}")
            await asyncio.sleep(0.2)
    except BaseException:
        await part.stop()
        raise
    log.info("local demo: coordinator at %s (logs in %s)", url, run_dir)
    return part, url


def spawn_helper_node(url: str, args) -> DemoPart:
    """The demo's other node processes (``stages x replicas - 1``; this node is the last one)."""
    from engine.swarm.demo import DEFAULT_REPLICAS, DEFAULT_STAGES, DemoProcesses, node_argv

    run_dir = demo_run_dir(args)
    run_dir.mkdir(parents=True, exist_ok=True)
    processes = DemoProcesses(run_dir, die_with_parent=True)
    for index in range(DEFAULT_STAGES * DEFAULT_REPLICAS - 1):
        processes.spawn(f"node{index}", node_argv(index, url, run_dir, backend=args.backend,
                                                  checkpoint=args.checkpoint))
    log.info("local demo: started %d more node processes (logs in %s)", len(processes.procs), run_dir)
    return DemoPart(processes)
