"""A two-socket WAN relay that learns its peers from traffic, so peers may live in other processes.

:class:`~engine.net.wan_emulator.WanLink` must see both peers' SDPs in its own
process (it registers their real candidate ports). :class:`UdpRelayPair` needs
nothing from them: it binds two sockets, ``a_sends_to`` (where peer A is told
peer B lives) and ``b_sends_to`` (the reverse). Whatever sends to ``a_sends_to``
*is* A (its real address is learned from that traffic), whatever sends to
``b_sends_to`` is B; a datagram from A leaves through ``b_sends_to`` towards B,
so B sees A exactly where A's SDP said, and vice versa, with the same
per-direction impairment as the WanLink relay. Each peer's process only needs
``static_sdp_filter(pair.advertised_by(side))``, a pure function of one address
that a command-line flag can carry.

Only one UDP endpoint per side is supported (the filter keeps one IPv4 host
candidate); a later source on the same side replaces the learned address.

What this module does not know: WebRTC, signalling, or which process runs what.
"""

from __future__ import annotations

import asyncio
import logging
import random
import socket
from dataclasses import asdict
from typing import Callable

from engine.net.wan_emulator import (
    Address,
    DeliveryQueue,
    DirectionCounters,
    ImpairmentProfile,
    LinkSwitch,
    PacketShaper,
    rewrite_sdp_candidates,
    sdp_host_candidates,
)

log = logging.getLogger(__name__)

_RCVBUF_BYTES = 4 * 1024 * 1024


def static_sdp_filter(advertise: Address) -> Callable[[str], str]:
    """An outgoing-SDP hook that keeps the first IPv4 UDP host candidate, pointed at ``advertise``."""
    advertise = (str(advertise[0]), int(advertise[1]))

    def rewrite(sdp: str) -> str:
        candidates = sdp_host_candidates(sdp)
        if not candidates:
            raise ValueError("SDP has no IPv4 UDP host candidate to relay")
        return rewrite_sdp_candidates(sdp, {candidates[0]: advertise})
    return rewrite


class _Side(asyncio.DatagramProtocol):
    def __init__(self, pair: "UdpRelayPair", name: str) -> None:
        self.pair, self.name = pair, name
        self.transport: asyncio.DatagramTransport | None = None
        self.learned: Address | None = None

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = transport  # type: ignore[assignment]

    def datagram_received(self, data: bytes, addr: tuple) -> None:
        self.pair._on_datagram(self, data, (addr[0], addr[1]))

    def error_received(self, exc: Exception) -> None:
        log.debug("relay pair socket %s: %s", self.name, exc)


class UdpRelayPair:
    """Relay between one peer A (sending to ``a_sends_to``) and one peer B (to ``b_sends_to``)."""

    def __init__(self, a_to_b: ImpairmentProfile, b_to_a: ImpairmentProfile | None = None, *,
                 seed: int = 0, host: str = "127.0.0.1") -> None:
        self.host = host
        self.counters = {"a_to_b": DirectionCounters(), "b_to_a": DirectionCounters()}
        rng = random.Random(seed)
        self._shapers = {
            "a": PacketShaper(a_to_b, random.Random(rng.getrandbits(64)), self.counters["a_to_b"]),
            "b": PacketShaper(b_to_a or a_to_b, random.Random(rng.getrandbits(64)), self.counters["b_to_a"]),
        }
        self._sides = {"a": _Side(self, "a"), "b": _Side(self, "b")}
        self._queues = {"a": DeliveryQueue(self._send), "b": DeliveryQueue(self._send)}
        self._switch = LinkSwitch(self._queues, {side: shaper.counters for side, shaper in self._shapers.items()})
        self.waiting_for_peer = 0  # datagrams dropped because the other side was not yet known
        self.a_sends_to: Address = ("", 0)
        self.b_sends_to: Address = ("", 0)
        self._closed = False

    async def start(self) -> "UdpRelayPair":
        loop = asyncio.get_running_loop()
        for name, side in self._sides.items():
            sock = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, _RCVBUF_BYTES)
            sock.bind((self.host, 0))
            await loop.create_datagram_endpoint(lambda side=side: side, sock=sock)
            setattr(self, f"{name}_sends_to", sock.getsockname()[:2])
        return self

    @property
    def paused(self) -> bool:
        return self._switch.paused

    def pause(self) -> None:
        """Cut the link both ways (packets in flight are lost) until :meth:`resume`."""
        self._switch.pause()

    def resume(self) -> None:
        self._switch.resume()

    def advertised_by(self, side: str) -> Address:
        """The address ``side``'s outgoing SDP must carry (where the other peer will send)."""
        if side not in ("a", "b"):
            raise ValueError("side must be 'a' or 'b'")
        return self.b_sends_to if side == "a" else self.a_sends_to

    def _on_datagram(self, side: _Side, data: bytes, src: Address) -> None:
        if self._closed:
            return
        side.learned = src
        other = self._sides["b" if side.name == "a" else "a"]
        if other.learned is None:
            self.waiting_for_peer += 1
            return
        if self._switch.drops(side.name):
            return
        when = self._shapers[side.name].admit(len(data), asyncio.get_running_loop().time())
        if when is not None:
            self._queues[side.name].push(when, side.name, other, data)

    def _send(self, from_name: str, other: _Side, data: bytes) -> None:
        if self._closed or other.transport is None or other.learned is None:
            return
        other.transport.sendto(data, other.learned)
        counters = self._shapers[from_name].counters
        counters.forwarded += 1
        counters.bytes_forwarded += len(data)

    def stats(self) -> dict[str, dict[str, int]]:
        out = {name: {**asdict(c), "dropped": c.dropped} for name, c in self.counters.items()}
        out["unknown"] = {"dropped": self.waiting_for_peer}
        return out

    async def close(self) -> None:
        self._closed = True
        for queue in self._queues.values():
            queue.clear()
        for side in self._sides.values():
            if side.transport is not None:
                side.transport.close()

    async def __aenter__(self) -> "UdpRelayPair":
        return await self.start()

    async def __aexit__(self, *exc_info: object) -> None:
        await self.close()
