"""A node's links to other nodes: signalling, WebRTC links, bandwidth caps, deadlines.

:class:`PeerLinks` is the node's :class:`~engine.swarm.node_context.PeerSender`.
It connects to the coordinator's signalling relay (the URL comes in the
welcome), opens links through a :class:`~engine.net.peer_manager.PeerManager`
(only members of the swarm may link to us), reads every link on its own named
task and hands each decoded message (a typed struct, ``engine.swarm.messages``)
to ``on_message(sender, header, payload)``;
a ``ProtocolViolation`` raised there counts as a strike against the sender.
``send`` waits for the upload cap, opens the link if needed and gives the whole
send ``send_timeout_s``; a message to ourselves is handled in place. ``sdp_filter`` (optional)
rewrites every outgoing SDP offer and answer (an emulated WAN's stand-ins).

What it does not know: what messages mean, stages, jobs.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Awaitable, Callable
from typing import Any

from engine.net.errors import LinkClosed, NetError, ProtocolViolation
from engine.net.identity import Identity
from engine.net.peer_link import LinkConfig, PeerLink
from engine.net.peer_manager import PeerManager, PeerManagerConfig
from engine.net.signalling import SignallingClient
from engine.swarm import messages
from engine.swarm.messages import PeerMessage
from engine.swarm.node_context import TaskSpawner
from engine.swarm.rate_limit import TokenBucket

log = logging.getLogger(__name__)

#: longest one send to a peer may take, link set-up and backpressure included (seconds)
SEND_TIMEOUT_S = 120.0
#: bytes a message costs beyond its payload, for the bandwidth caps
HEADER_COST_BYTES = 64
#: rewrites every outgoing SDP (e.g. through an emulated WAN, ``engine.net.wan_hub``)
SdpFilter = Callable[[str], "str | Awaitable[str]"]


class PeerLinks:
    """Links of one node; see the module docstring."""

    def __init__(self, identity: Identity, tasks: TaskSpawner,
                 on_message: Callable[[str, PeerMessage, bytes], None], *, accept_peer: Callable[[str], bool],
                 upload_mbps: float | None = None, download_mbps: float | None = None,
                 send_timeout_s: float = SEND_TIMEOUT_S, sdp_filter: SdpFilter | None = None) -> None:
        self.identity = identity
        self.tasks = tasks
        self.on_message = on_message
        self.accept_peer = accept_peer
        self.send_timeout_s = send_timeout_s
        self.sdp_filter = sdp_filter
        self.upload = TokenBucket(upload_mbps)
        self.download = TokenBucket(download_mbps)
        self._signal: SignallingClient | None = None
        self._pm: PeerManager | None = None
        self._locks: dict[str, asyncio.Lock] = {}
        self._dialing: set[str] = set()
        self._closed_bytes = [0.0, 0.0]
        #: called with a peer id whenever a new link to it is up (before its first message is read)
        self.on_new_link: Callable[[str], None] | None = None

    # ------------------------------------------------------------------ set-up
    async def start(self, signal_url: str) -> None:
        """Use the signalling relay at ``signal_url`` (a no-op if it is the one in use)."""
        if self._signal is not None and self._signal.url == signal_url:
            return
        await self.close()
        self._signal = SignallingClient(signal_url, self.identity)
        await self._signal.connect()
        self._pm = PeerManager(self._signal, PeerManagerConfig(link=LinkConfig()), sdp_filter=self.sdp_filter,
                               validator=messages.decode_peer_header, accept_peer=self.accept_peer)
        self._pm.on_link = self._on_link

    def _on_link(self, link: PeerLink) -> None:
        if self.on_new_link is not None:
            self.on_new_link(link.peer_id)
        self.tasks.spawn(self._read(link), f"polis-read-{link.peer_id[:8]}")

    async def close(self) -> None:
        if self._pm is not None:
            await self._pm.close()
        if self._signal is not None:
            await self._signal.close()

    @property
    def ready(self) -> bool:
        return self._pm is not None

    def link_count(self) -> int:
        return len(self._pm.links) if self._pm is not None else 0

    # ------------------------------------------------------------------ PeerSender
    async def send(self, peer: str, header: PeerMessage, payload: bytes = b"", channel: str = "control") -> None:
        if peer == self.identity.peer_id:
            self.on_message(peer, header, payload)
            return
        await self.upload.consume(len(payload) + HEADER_COST_BYTES)
        await asyncio.wait_for(self._send(peer, header, payload, "bulk" if payload else channel),
                               self.send_timeout_s)

    async def _send(self, peer: str, header: PeerMessage, payload: bytes, channel: str) -> None:
        link = await self._link(peer)
        await link.send(header, payload, channel=channel)

    def strike(self, peer: str, reason: str) -> None:
        link = self._pm.link(peer) if self._pm is not None else None
        if link is not None:
            link.report_violation(reason)

    # ------------------------------------------------------------------ links
    async def _link(self, peer: str) -> PeerLink:
        if self._pm is None:
            raise LinkClosed("no links yet: the coordinator has not welcomed us")
        lock = self._locks.setdefault(peer, asyncio.Lock())
        async with lock:
            return await self._pm.ensure_link(peer)  # within PeerManagerConfig.connect_timeout_s

    def connect_ahead(self, peers: set[str]) -> None:
        """Open links ahead of need to ``peers``; only the side with the smaller peer id dials.

        So two peers never race to connect; connecting under load can take seconds and
        must not delay the first job.
        """
        if self._pm is None:
            return
        me = self.identity.peer_id
        for peer in sorted(peers):
            if peer > me and self._pm.link(peer) is None and peer not in self._dialing:
                self._dialing.add(peer)
                self.tasks.spawn(self._dial(peer), f"polis-dial-{peer[:8]}")

    async def _dial(self, peer: str) -> None:
        try:
            await self._link(peer)
        except (NetError, OSError, asyncio.TimeoutError) as exc:
            log.info("could not open a link to %s yet: %s", peer, exc)
        finally:
            self._dialing.discard(peer)

    async def _read(self, link: PeerLink) -> None:
        try:
            async for header, payload in link:
                await self.download.consume(len(payload) + HEADER_COST_BYTES)
                try:
                    self.on_message(link.peer_id, header, payload)
                except ProtocolViolation as exc:
                    link.report_violation(str(exc))
        except LinkClosed:
            pass
        finally:
            self._closed_bytes[0] += link.stats.wire_bytes_sent
            self._closed_bytes[1] += link.stats.wire_bytes_received

    def rtt_ms(self) -> dict[str, float]:
        """Measured round trip (SCTP's smoothed RTT, milliseconds) of every open link that has one."""
        if self._pm is None:
            return {}
        return {peer: round(1e3 * link.rtt_s, 3) for peer, link in self._pm.links.items() if link.rtt_s is not None}

    def send_rates(self) -> dict[str, Any]:
        """Measured send rates for the coordinator's report, Mbit/s: ``link_send_mbps`` (each open link's),
        ``uplink_mbps`` (the fastest a link sent while its path set the pace, at most the upload cap;
        the cap itself when none did; 0: unknown) and ``uplink_floor_mbps`` (the fastest any link sent:
        the uplink is at least this)."""
        links: dict[str, float] = {}
        ceiling = floor = 0.0
        for peer, link in (self._pm.links.items() if self._pm is not None else ()):
            rate = link.send_rate
            if rate is None:
                continue
            mbps = rate[0] * 8 / 1e6
            links[peer] = round(mbps, 3)
            floor = max(floor, mbps)
            if rate[1]:
                ceiling = max(ceiling, mbps)
        cap = self.upload.rate_bytes_s
        if cap is not None:
            cap_mbps = cap * 8 / 1e6
            ceiling = min(ceiling, cap_mbps) if ceiling else cap_mbps
        return {"link_send_mbps": links, "uplink_mbps": round(ceiling, 3), "uplink_floor_mbps": round(floor, 3)}

    def bytes_moved(self) -> tuple[float, float]:
        """Wire bytes ``(sent, received)`` over every link this node had."""
        sent, received = self._closed_bytes
        if self._pm is not None:
            for link in self._pm.links.values():
                sent += link.stats.wire_bytes_sent
                received += link.stats.wire_bytes_received
        return sent, received
