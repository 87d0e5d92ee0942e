"""Host a coordinator inside this process, and start helper nodes, for LAN and demo swarms.

``polis node --lan`` hosts a coordinator when none answers on the network (and
advertises it with zeroconf); ``polis node --demo`` also starts one helper node
so that a two-stage pipeline can run on one machine. It knows how to start
these pieces, not what they do.
"""

from __future__ import annotations

import logging
import subprocess
import sys
from pathlib import Path

from engine import __version__
from engine.self_command import polis_command

log = logging.getLogger(__name__)


class HostedCoordinator:
    """A coordinator on this process's loop, plus its LAN advert when there is one."""

    def __init__(self, coordinator, advertiser=None) -> None:
        self.coordinator = coordinator
        self.advertiser = advertiser

    async def stop(self) -> None:
        if self.advertiser is not None:
            await self.advertiser.close()
        await self.coordinator.stop()


def _data_dir(args) -> Path:
    if args.data_dir:
        return Path(args.data_dir)
    from engine.paths import user_data_dir

    return user_data_dir()


async def host_local_coordinator(args, lan: bool) -> tuple[HostedCoordinator, str]:
    """Start a coordinator for a swarm on this machine (``lan``: reachable and advertised on the LAN)."""
    from engine.paths import base_checkpoint_dir
    from engine.swarm.coordinator import Coordinator, CoordinatorConfig

    base = args.checkpoint or str(base_checkpoint_dir())
    db = _data_dir(args) / ("lan-coordinator.db" if lan else "demo-coordinator.db")
    coordinator = Coordinator(CoordinatorConfig(db_path=str(db), base_checkpoint=base,
                                                host="0.0.0.0" if lan else "127.0.0.1", port=0))
    url = await coordinator.start()
    advertiser = None
    if lan:
        import socket

        from engine.net.discovery import LanAdvertiser, ServiceAdvert

        port = int(url.rsplit(":", 1)[1])
        host = socket.gethostbyname(socket.gethostname())
        url = f"http://{host}:{port}"
        advertiser = LanAdvertiser(ServiceAdvert(role="coordinator", peer_id=coordinator.run_id,
                                                 signalling_url=url, version=__version__))
        await advertiser.start()
        log.info("hosting a LAN coordinator at %s (advertised with zeroconf)", url)
    return HostedCoordinator(coordinator, advertiser), url


def spawn_helper_node(url: str, args) -> subprocess.Popen:
    """A second node process for the demo swarm (its own identity and data directory)."""
    data = _data_dir(args) / "demo-helper"
    data.mkdir(parents=True, exist_ok=True)
    command = polis_command("node", "--coordinator", url, "--identity", "demo-helper", "--data-dir", str(data),
                            "--backend", args.backend)
    if args.checkpoint:
        command += ["--checkpoint", args.checkpoint]
    log.info("starting a helper node: %s", " ".join(command))
    return subprocess.Popen(command, stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, stderr=sys.stderr)
