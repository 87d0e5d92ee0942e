"""One impairment relay for a whole swarm: every node-to-node WebRTC link, each shaped by its two ends.

:class:`~engine.net.wan_emulator.WanLink` relays one peer pair inside one process.
:class:`WanHub` serves many node processes: each node, before it sends an SDP
offer or answer, asks the hub's *control address* (JSON lines over TCP,
:func:`relay_sdp`) for stand-ins of its host candidates, naming its own WAN
profile (``engine.net.wan_profiles``). Every real endpoint gets one stand-in socket;
a datagram from real endpoint ``src`` arriving at the stand-in of ``dst`` is
impaired by the shaper of the ordered pair (``src``, ``dst``) -- made on first use
from :func:`~engine.net.wan_profiles.link_impairment` of the two endpoints'
profiles -- and sent to ``dst`` from the stand-in of ``src``. No peer ids are
needed: aiortc gives every connection its own UDP socket, so an endpoint pair *is*
a link. The offerer is registered before anyone knows its stand-in; the answerer
may start its ICE checks before its answer (and so its endpoint) is registered:
those first checks are dropped (``dropped_unknown``) and ICE repeats them. Each
link has its own shaper: the links of one node do not share its uplink rate.

Control messages (:data:`CONTROL`): ``register`` (profile name, endpoints) ->
``registered`` (stand-ins, in order) or ``refused`` (reason); ``stats`` ->
``hub_stats``. Lines are capped at :data:`MAX_CONTROL_LINE_BYTES`, endpoints per
request at 16, endpoints per hub at :data:`MAX_ENDPOINTS`.

What this module does not know: WebRTC, signalling, which node is which.
"""

from __future__ import annotations

import asyncio
import logging
import random
import socket
from collections import Counter
from dataclasses import asdict
from typing import Annotated, Any, Awaitable, Callable, Mapping, Union

import msgspec

from engine.net.errors import ProtocolViolation
from engine.net.wan_emulator import (
    Address,
    DeliveryQueue,
    DirectionCounters,
    PacketShaper,
    rewrite_sdp_candidates,
    sdp_host_candidates,
)
from engine.net.wan_profiles import WanProfile, link_impairment
from engine.net.wire import MessageSet, WireMessage, encode_json

log = logging.getLogger(__name__)

#: longest control line either side reads (bytes)
MAX_CONTROL_LINE_BYTES = 64 * 1024
#: most real endpoints one hub stands in for (links come and go over a run)
MAX_ENDPOINTS = 2048
#: seconds a node waits for the hub's answer
CONTROL_TIMEOUT_S = 5.0
_RCVBUF_BYTES = 4 * 1024 * 1024

_Port = Annotated[int, msgspec.Meta(ge=1, le=65535)]
_Host = Annotated[str, msgspec.Meta(min_length=1, max_length=64)]
_Endpoints = Annotated[list[tuple[_Host, _Port]], msgspec.Meta(min_length=1, max_length=16)]


class Register(WireMessage, frozen=True, tag="register"):
    profile: Annotated[str, msgspec.Meta(min_length=1, max_length=32)]  # the sender's WAN profile name
    endpoints: _Endpoints  # its real IPv4 UDP host candidates (ip, port)


class Registered(WireMessage, frozen=True, tag="registered"):
    stand_ins: _Endpoints  # the relay address of each endpoint, in the request's order


class Refused(WireMessage, frozen=True, tag="refused"):
    reason: Annotated[str, msgspec.Meta(max_length=300)]


class StatsRequest(WireMessage, frozen=True, tag="stats"):
    pass


class HubStats(WireMessage, frozen=True, tag="hub_stats"):
    stats: dict[str, Any]  # what :meth:`WanHub.stats` returns


CONTROL: MessageSet = MessageSet("wan-hub", Union[Register, Registered, Refused, StatsRequest, HubStats],
                                 max_size=MAX_CONTROL_LINE_BYTES)


class _StandIn(asyncio.DatagramProtocol):
    def __init__(self, hub: "WanHub", real: Address, profile: str) -> None:
        self.hub, self.real, self.profile = hub, real, profile
        self.local: Address = ("", 0)
        self.transport: asyncio.DatagramTransport | None = None

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = transport  # type: ignore[assignment]

    def datagram_received(self, data: bytes, addr: tuple) -> None:
        self.hub._on_datagram(self, data, (addr[0], addr[1]))

    def error_received(self, exc: Exception) -> None:
        log.debug("hub socket for %s: %s", self.real, exc)


class _Pair:
    """The shaper and delivery queue of one direction of one link."""

    def __init__(self, hub: "WanHub", src: _StandIn, dst: _StandIn) -> None:
        self.counters = DirectionCounters()
        profile = link_impairment(hub.profiles[src.profile], hub.profiles[dst.profile])
        self.shaper = PacketShaper(profile, random.Random(hub._rng.getrandbits(64)), self.counters)
        self.queue = DeliveryQueue(hub._send)
        self.kind = f"{src.profile}->{dst.profile}"


class WanHub:
    """Stand-ins and per-link shapers for every node of a swarm; see the module docstring."""

    def __init__(self, profiles: Mapping[str, WanProfile], *, seed: int = 0, host: str = "127.0.0.1") -> None:
        self.profiles = dict(profiles)
        self.host = host
        self._rng = random.Random(seed)
        self._by_real: dict[Address, _StandIn] = {}
        self._pairs: dict[tuple[Address, Address], _Pair] = {}
        self._server: asyncio.AbstractServer | None = None
        self._starting: set[asyncio.Task] = set()
        self.dropped_unknown = 0
        self.refused = 0
        self.control_address: Address = ("", 0)
        self._closed = False

    # ------------------------------------------------------------ endpoints
    async def register(self, profile: str, endpoints: list[Address]) -> list[Address]:
        """Stand-ins for ``endpoints`` of a node on ``profile``, serving once this returns."""
        if profile not in self.profiles:
            raise ValueError(f"unknown WAN profile '{profile}' (known: {', '.join(sorted(self.profiles))})")
        new = [e for e in endpoints if (str(e[0]), int(e[1])) not in self._by_real]
        if len(self._by_real) + len(new) > MAX_ENDPOINTS:
            raise ValueError(f"the relay already stands in for {MAX_ENDPOINTS} endpoints")
        out = [self._add(profile, (str(e[0]), int(e[1]))) for e in endpoints]
        await asyncio.gather(*list(self._starting))
        return out

    def _add(self, profile: str, real: Address) -> Address:
        existing = self._by_real.get(real)
        if existing is not None:
            return existing.local
        sock = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, _RCVBUF_BYTES)
        sock.bind((self.host, 0))
        sock.setblocking(False)
        proto = _StandIn(self, real, profile)
        proto.local = sock.getsockname()[:2]
        self._by_real[real] = proto
        loop = asyncio.get_running_loop()
        task = loop.create_task(loop.create_datagram_endpoint(lambda: proto, sock=sock),
                                name=f"wan-hub-standin-{proto.local[1]}")
        self._starting.add(task)
        task.add_done_callback(self._starting.discard)
        return proto.local

    def _on_datagram(self, dst: _StandIn, data: bytes, src_addr: Address) -> None:
        src = self._by_real.get(src_addr)
        if self._closed or src is None or src is dst or src.transport is None:
            self.dropped_unknown += 1
            return
        key = (src.real, dst.real)
        pair = self._pairs.get(key)
        if pair is None:
            pair = self._pairs[key] = _Pair(self, src, dst)
        when = pair.shaper.admit(len(data), asyncio.get_running_loop().time())
        if when is not None:
            pair.queue.push(when, pair, src, data, dst.real)

    def _send(self, pair: _Pair, src: _StandIn, data: bytes, dst: Address) -> None:
        if self._closed or src.transport is None or src.transport.is_closing():
            return
        src.transport.sendto(data, dst)
        pair.counters.forwarded += 1
        pair.counters.bytes_forwarded += len(data)

    def stats(self) -> dict[str, Any]:
        """Counters summed per kind of link (``home->metro``), plus totals and unknown sources."""
        kinds: dict[str, Counter] = {}
        for pair in self._pairs.values():
            kinds.setdefault(pair.kind, Counter()).update({**asdict(pair.counters), "links": 1})
        total: Counter = Counter()
        for c in kinds.values():
            total.update(c)
        return {"kinds": {k: dict(v) for k, v in sorted(kinds.items())}, "total": dict(total),
                "endpoints": len(self._by_real), "dropped_unknown": self.dropped_unknown,
                "refused_requests": self.refused}

    # ------------------------------------------------------------ control
    async def start(self, port: int = 0) -> Address:
        """Serve the control address (``host``, ``port``; 0: any free port) and return it."""
        self._server = await asyncio.start_server(self._control, self.host, port, limit=MAX_CONTROL_LINE_BYTES)
        self.control_address = self._server.sockets[0].getsockname()[:2]
        return self.control_address

    async def _control(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        try:
            while line := await reader.readline():
                writer.write(encode_json(await self._answer(line)).encode() + b"\n")
                await writer.drain()
        except (ConnectionError, ValueError, asyncio.LimitOverrunError):
            pass  # a line over the cap or a vanished client: drop the connection
        finally:
            writer.close()

    async def _answer(self, line: bytes) -> WireMessage:
        try:
            request = CONTROL.decode_json(line)
        except ProtocolViolation as exc:
            self.refused += 1
            return Refused(reason=str(exc)[:300])
        if isinstance(request, StatsRequest):
            return HubStats(stats=self.stats())
        if not isinstance(request, Register):
            self.refused += 1
            return Refused(reason=f"'{type(request).__name__}' is not a request")
        try:
            stand_ins = await self.register(request.profile, list(request.endpoints))
        except (ValueError, OSError) as exc:
            self.refused += 1
            return Refused(reason=str(exc)[:300])
        return Registered(stand_ins=stand_ins)

    async def close(self) -> None:
        self._closed = True
        if self._server is not None:
            self._server.close()
        for pair in self._pairs.values():
            pair.queue.clear()
        await asyncio.gather(*list(self._starting), return_exceptions=True)
        for proto in self._by_real.values():
            if proto.transport is not None:
                proto.transport.close()

    async def __aenter__(self) -> "WanHub":
        await self.start()
        return self

    async def __aexit__(self, *exc_info: object) -> None:
        await self.close()


# ------------------------------------------------------------------ the node's side

async def ask_hub(control: Address, request: WireMessage, timeout_s: float = CONTROL_TIMEOUT_S) -> WireMessage:
    """One request to the hub at ``control`` and its decoded answer (raises OSError / ProtocolViolation)."""
    async def exchange() -> WireMessage:
        reader, writer = await asyncio.open_connection(control[0], control[1], limit=MAX_CONTROL_LINE_BYTES)
        try:
            writer.write(encode_json(request).encode() + b"\n")
            await writer.drain()
            return CONTROL.decode_json(await reader.readline())
        finally:
            writer.close()
    try:
        return await asyncio.wait_for(exchange(), timeout_s)
    except asyncio.TimeoutError:
        raise OSError(f"the WAN relay at {control[0]}:{control[1]} did not answer within {timeout_s} s") from None


async def relay_sdp(control: Address, profile: str, sdp: str) -> str:
    """``sdp`` with its IPv4 UDP host candidates registered at the hub and pointed at their stand-ins."""
    candidates = sdp_host_candidates(sdp)
    if not candidates:
        raise ValueError("SDP has no IPv4 UDP host candidate to relay")
    answer = await ask_hub(control, Register(profile=profile, endpoints=candidates[:16]))
    if not isinstance(answer, Registered):
        reason = answer.reason if isinstance(answer, Refused) else type(answer).__name__
        raise OSError(f"the WAN relay refused our endpoints: {reason}")
    stand_ins: list[Address] = [(str(host), int(port)) for host, port in answer.stand_ins]
    return rewrite_sdp_candidates(sdp, dict(zip(candidates[:16], stand_ins)))


def hub_sdp_filter(control: Address, profile: str) -> Callable[[str], Awaitable[str]]:
    """An async outgoing-SDP hook for ``PeerManager``: every link through the hub at ``control``."""
    return lambda sdp: relay_sdp(control, profile, sdp)


def parse_address(text: str) -> Address:
    """``HOST:PORT`` as an address (raises ValueError with what to write instead)."""
    host, _, port = text.rpartition(":")
    if not host or not port.isdigit() or not 1 <= int(port) <= 65535:
        raise ValueError(f"'{text}' is not HOST:PORT (e.g. 127.0.0.1:9000)")
    return host, int(port)
