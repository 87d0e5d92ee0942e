"""A user-space UDP relay that makes a loopback path look like a WAN link.

Kernel traffic shaping (netem) is not available on these machines, so WebRTC
traffic between two local peers is sent through this relay instead. Each real
UDP endpoint (a peer's ICE host candidate) gets a *stand-in* socket on the relay.
A datagram from real endpoint ``src`` that arrives at the stand-in of ``dst`` is
impaired and then sent to ``dst`` **from the stand-in of ``src``**, so each peer
sees the other only at the stand-in address written into its SDP (no
peer-reflexive surprises for ICE, and no path around the relay).

Impairment, per direction (A->B and B->A separately), in netem's order:
random loss (``loss_percent``), a token-bucket rate limit (``bandwidth_mbps``,
``burst_bytes``) with a bounded queue and tail drop (``queue_limit_bytes``), then
one-way delay plus uniform jitter (``delay_ms``, ``jitter_ms``); packets keep
their order unless ``allow_reorder``. The RNG is seeded, so a run is repeatable
given the same arrivals. ``pause()`` cuts the link (both directions: packets in
flight and every packet until ``resume()`` are dropped, counted as
``dropped_paused``), as a dead uplink or a Wi-Fi hand-over would.

:func:`rewrite_sdp_candidates` points an SDP's candidates at stand-ins and drops
every candidate it cannot map; :class:`WanLink` does the bookkeeping for one
peer pair and hands out synchronous ``sdp_filter`` callables for the links.

What this module does not know: WebRTC itself, signalling, or the bytes it carries.
"""

from __future__ import annotations

import asyncio
import heapq
import logging
import random
import re
import socket
from dataclasses import asdict, dataclass
from typing import Callable, Literal, Mapping

log = logging.getLogger(__name__)

Side = Literal["a", "b"]
Address = tuple[str, int]
#: a bucket must hold at least one full-size (Ethernet MTU) packet
_MIN_BURST_BYTES = 1500
#: Most packets one direction emits per event-loop iteration. An asyncio UDP
#: endpoint reads one datagram per iteration, so a larger burst (after the loop
#: was busy) would overflow the receiver's socket buffer: loss the profile never asked for.
_MAX_PACKETS_PER_TICK = 4
#: Receive buffer asked for on relay sockets (the kernel caps it at rmem_max).
_RELAY_RCVBUF_BYTES = 4 * 1024 * 1024


@dataclass(frozen=True)
class ImpairmentProfile:
    """What one direction of the emulated link does to packets."""

    #: one-way delay added to every packet, milliseconds
    delay_ms: float = 0.0
    #: uniform jitter, +- this many milliseconds around ``delay_ms``
    jitter_ms: float = 0.0
    #: probability of dropping a packet, percent
    loss_percent: float = 0.0
    #: line rate in megabits per second (10**6 bit/s); None = unlimited
    bandwidth_mbps: float | None = None
    #: token-bucket depth: bytes that may pass at once after an idle spell
    burst_bytes: int = 16 * 1024
    #: bytes that may wait for the line; beyond it packets are tail-dropped
    queue_limit_bytes: int = 256 * 1024
    #: let jitter reorder packets (netem does); False keeps arrival order
    allow_reorder: bool = False

    def __post_init__(self) -> None:
        if self.delay_ms < 0 or self.jitter_ms < 0:
            raise ValueError("delay_ms and jitter_ms must be >= 0")
        if not 0 <= self.loss_percent <= 100:
            raise ValueError("loss_percent must be in [0, 100]")
        if self.bandwidth_mbps is not None and self.bandwidth_mbps <= 0:
            raise ValueError("bandwidth_mbps must be > 0 (or None for unlimited)")
        if self.burst_bytes < _MIN_BURST_BYTES or self.queue_limit_bytes < 0:
            raise ValueError(f"burst_bytes must be >= {_MIN_BURST_BYTES} and queue_limit_bytes >= 0")


@dataclass
class DirectionCounters:
    """What happened to the packets of one direction."""

    received: int = 0
    forwarded: int = 0
    dropped_loss: int = 0
    dropped_queue: int = 0
    bytes_forwarded: int = 0
    dropped_paused: int = 0

    @property
    def dropped(self) -> int:
        return self.dropped_loss + self.dropped_queue + self.dropped_paused


class PacketShaper:
    """Loss, token bucket with tail drop, delay and jitter for one direction."""

    def __init__(self, profile: ImpairmentProfile, rng: random.Random, counters: DirectionCounters) -> None:
        self.profile = profile
        self._rng = rng
        self.counters = counters
        self._rate_bytes_s = profile.bandwidth_mbps * 1e6 / 8 if profile.bandwidth_mbps else None
        self._tokens = float(profile.burst_bytes)  # bucket content at time self._token_time
        self._token_time = float("-inf")  # last scheduled departure (may lie in the future)
        self._last_delivery = float("-inf")

    def admit(self, nbytes: int, now: float) -> float | None:
        """Delivery time (loop clock) for a packet arriving ``now``, or None if dropped."""
        p = self.profile
        self.counters.received += 1
        if p.loss_percent and self._rng.random() * 100 < p.loss_percent:
            self.counters.dropped_loss += 1
            return None
        departure = now
        if self._rate_bytes_s is not None:
            rate = self._rate_bytes_s
            start = max(now, self._token_time)  # FIFO: not before the packet ahead
            elapsed = start - self._token_time if self._token_time > float("-inf") else float("inf")
            tokens = min(float(p.burst_bytes), self._tokens + elapsed * rate)
            departure = start if tokens >= nbytes else start + (nbytes - tokens) / rate
            if (departure - now) * rate > p.queue_limit_bytes:
                self.counters.dropped_queue += 1
                return None
            self._tokens = max(0.0, tokens - nbytes)
            self._token_time = departure
        delivery = departure + p.delay_ms / 1e3
        if p.jitter_ms:
            delivery = max(departure, delivery + self._rng.uniform(-p.jitter_ms, p.jitter_ms) / 1e3)
        if not p.allow_reorder:
            delivery = max(delivery, self._last_delivery)
            self._last_delivery = delivery
        return delivery


class DeliveryQueue:
    """Packets of one direction waiting for their delivery time; one timer, FIFO on ties.

    (asyncio's own timers do not keep FIFO order among equal deadlines, which
    would reorder packets that a rate limit schedules back to back.)
    """

    def __init__(self, send: Callable[..., None]) -> None:
        self._send = send
        self._heap: list[tuple[float, int, tuple]] = []
        self._seq = 0
        self._timer: asyncio.TimerHandle | None = None
        self._timer_when = float("inf")

    def push(self, when: float, *packet: object) -> None:
        heapq.heappush(self._heap, (when, self._seq, packet))
        self._seq += 1
        if when < self._timer_when:
            self._arm(when)

    def _arm(self, when: float) -> None:
        if self._timer is not None:
            self._timer.cancel()
        self._timer_when = when
        self._timer = asyncio.get_running_loop().call_at(when, self._fire)

    def _fire(self) -> None:
        self._timer, self._timer_when = None, float("inf")
        now = asyncio.get_running_loop().time()
        sent = 0
        while self._heap and self._heap[0][0] <= now and sent < _MAX_PACKETS_PER_TICK:
            self._send(*heapq.heappop(self._heap)[2])
            sent += 1
        if self._heap:
            # late packets go out a few per loop iteration, as a real line would pace them
            self._arm(max(self._heap[0][0], now))

    def __len__(self) -> int:
        return len(self._heap)

    def clear(self) -> int:
        """Forget every waiting packet; returns how many there were."""
        if self._timer is not None:
            self._timer.cancel()
        self._timer, self._timer_when = None, float("inf")
        waiting = len(self._heap)
        self._heap.clear()
        return waiting


class LinkSwitch:
    """The on/off state of an emulated link: while off, every packet is dropped.

    Shared by both relays; ``pause`` also drops what the delivery queues hold
    (packets on the wire when the line went dead).
    """

    def __init__(self, queues: Mapping[str, DeliveryQueue], counters: Mapping[str, DirectionCounters]) -> None:
        self._queues, self._counters = queues, counters
        self.paused = False
        self.pauses = 0

    def pause(self) -> None:
        if self.paused:
            return
        self.paused, self.pauses = True, self.pauses + 1
        for side, queue in self._queues.items():
            self._counters[side].dropped_paused += queue.clear()
        log.info("emulated link paused")

    def resume(self) -> None:
        if self.paused:
            self.paused = False
            log.info("emulated link resumed")

    def drops(self, side: str) -> bool:
        """True (and counted) if a packet from ``side`` must be dropped now."""
        if self.paused:
            self._counters[side].dropped_paused += 1
        return self.paused


class _StandIn(asyncio.DatagramProtocol):
    """The relay socket that represents one real endpoint."""

    def __init__(self, relay: "UdpImpairmentRelay", real: Address, side: Side) -> None:
        self.relay, self.real, self.side = relay, real, side
        self.local: Address = ("", 0)  # the stand-in's own address, set once bound
        self.transport: asyncio.DatagramTransport | None = None

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = transport  # type: ignore[assignment]

    def datagram_received(self, data: bytes, addr: tuple) -> None:
        self.relay._on_datagram(self, data, (addr[0], addr[1]))

    def error_received(self, exc: Exception) -> None:
        log.debug("relay socket for %s: %s", self.real, exc)


class UdpImpairmentRelay:
    """Stand-in sockets for real endpoints of side "a" and side "b", impaired per direction.

    Create, register endpoints with :meth:`add_endpoint` (or the synchronous
    :meth:`add_endpoint_nowait` from inside an SDP filter), then :meth:`close`.
    All methods run on the event loop thread.
    """

    def __init__(self, a_to_b: ImpairmentProfile, b_to_a: ImpairmentProfile | None = None, *,
                 seed: int = 0, host: str = "127.0.0.1") -> None:
        self.host = host
        self.counters: dict[str, DirectionCounters] = {"a_to_b": DirectionCounters(),
                                                       "b_to_a": DirectionCounters()}
        self.dropped_unknown = 0
        rng = random.Random(seed)
        self._shapers = {
            "a": PacketShaper(a_to_b, random.Random(rng.getrandbits(64)), self.counters["a_to_b"]),
            "b": PacketShaper(b_to_a or a_to_b, random.Random(rng.getrandbits(64)), self.counters["b_to_a"]),
        }
        self._by_real: dict[Address, _StandIn] = {}
        self._queues = {"a": DeliveryQueue(self._send), "b": DeliveryQueue(self._send)}
        self._switch = LinkSwitch(self._queues, {side: shaper.counters for side, shaper in self._shapers.items()})
        self._starting: set[asyncio.Task] = set()
        self._closed = False

    @property
    def paused(self) -> bool:
        return self._switch.paused

    def pause(self) -> None:
        """Cut the link both ways (packets in flight are lost) until :meth:`resume`."""
        self._switch.pause()

    def resume(self) -> None:
        self._switch.resume()

    def stand_in(self, real: Address) -> Address | None:
        """The relay address that stands for ``real`` (None if not registered)."""
        proto = self._by_real.get(real)
        return None if proto is None else proto.local

    def add_endpoint_nowait(self, real: Address, side: Side) -> Address:
        """Register ``real`` on ``side``; bind its stand-in now, start serving it on the loop."""
        if side not in ("a", "b"):
            raise ValueError("side must be 'a' or 'b'")
        real = (str(real[0]), int(real[1]))
        existing = self._by_real.get(real)
        if existing is not None:
            return existing.local
        sock = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, _RELAY_RCVBUF_BYTES)
        sock.bind((self.host, 0))
        sock.setblocking(False)
        proto = _StandIn(self, real, side)
        proto.local = sock.getsockname()[:2]
        self._by_real[real] = proto
        loop = asyncio.get_running_loop()
        task = loop.create_task(loop.create_datagram_endpoint(lambda: proto, sock=sock),
                                name=f"wan-relay-standin-{proto.local[1]}")
        self._starting.add(task)
        task.add_done_callback(self._starting.discard)
        return proto.local

    async def add_endpoint(self, real: Address, side: Side) -> Address:
        """Like :meth:`add_endpoint_nowait`, returning once the stand-in is serving."""
        local = self.add_endpoint_nowait(real, side)
        await asyncio.gather(*list(self._starting))
        return local

    def _on_datagram(self, dst: _StandIn, data: bytes, src_addr: Address) -> None:
        src = self._by_real.get(src_addr)
        if self._closed or src is None or src.side == dst.side or src.transport is None:
            self.dropped_unknown += 1
            return
        if self._switch.drops(src.side):
            return
        now = asyncio.get_running_loop().time()
        when = self._shapers[src.side].admit(len(data), now)
        if when is not None:
            self._queues[src.side].push(when, src, data, dst.real)

    def _send(self, src: _StandIn, data: bytes, dst: Address) -> None:
        if self._closed or src.transport is None or src.transport.is_closing():
            return
        src.transport.sendto(data, dst)
        counters = self._shapers[src.side].counters
        counters.forwarded += 1
        counters.bytes_forwarded += len(data)

    def stats(self) -> dict[str, dict[str, int]]:
        """Counters per direction, plus datagrams from unknown sources."""
        out = {name: {**asdict(c), "dropped": c.dropped} for name, c in self.counters.items()}
        out["unknown"] = {"dropped": self.dropped_unknown}
        return out

    async def close(self) -> None:
        self._closed = True
        for queue in self._queues.values():
            queue.clear()
        await asyncio.gather(*list(self._starting), return_exceptions=True)
        for proto in self._by_real.values():
            if proto.transport is not None:
                proto.transport.close()

    async def __aenter__(self) -> "UdpImpairmentRelay":
        return self

    async def __aexit__(self, *exc_info: object) -> None:
        await self.close()


# ------------------------------------------------------------------------------ SDP

_CANDIDATE_RE = re.compile(
    r"^a=candidate:(?P<foundation>\S+) (?P<component>\d+) (?P<transport>\S+) (?P<priority>\d+) "
    r"(?P<ip>\S+) (?P<port>\d+) typ (?P<type>\S+)(?P<rest>.*)$")


def sdp_host_candidates(sdp: str) -> list[Address]:
    """(ip, port) of every IPv4 UDP host candidate in ``sdp``."""
    found = []
    for line in sdp.splitlines():
        match = _CANDIDATE_RE.match(line.strip())
        if match and match["transport"].lower() == "udp" and match["type"] == "host" and ":" not in match["ip"]:
            found.append((match["ip"], int(match["port"])))
    return found


def rewrite_sdp_candidates(sdp: str, port_map: Mapping[Address, Address]) -> str:
    """``sdp`` with each candidate in ``port_map`` pointed at its new (ip, port).

    Candidates not in the map are removed, so no path can bypass the relay; the
    ``c=`` and ``m=`` lines follow the first mapped candidate.
    """
    newline = "\r\n" if "\r\n" in sdp else "\n"
    lines = sdp.split(newline)
    first: Address | None = None
    out = []
    for line in lines:
        match = _CANDIDATE_RE.match(line)
        if match:
            target = port_map.get((match["ip"], int(match["port"])))
            if target is None:
                continue
            first = first or target
            rest = re.sub(r" raddr \S+ rport \d+", "", match["rest"])
            line = (f"a=candidate:{match['foundation']} {match['component']} {match['transport']} "
                    f"{match['priority']} {target[0]} {target[1]} typ {match['type']}{rest}")
        out.append(line)
    if first is not None:
        out = [_rewrite_connection_line(line, first) for line in out]
    return newline.join(out)


def _rewrite_connection_line(line: str, address: Address) -> str:
    if line.startswith("c=IN IP"):
        return f"c=IN IP4 {address[0]}"
    if line.startswith("m="):
        parts = line.split(" ")
        if len(parts) > 1 and parts[1].isdigit():
            parts[1] = str(address[1])
            return " ".join(parts)
    return line


class WanLink:
    """An emulated WAN between two WebRTC peers ("a" and "b") on this machine.

    Give ``sdp_filter("a")`` to peer a's link and ``sdp_filter("b")`` to peer b's:
    each filter registers its side's host candidates with the relay and rewrites
    the outgoing SDP to point at their stand-ins. ``forward`` shapes a->b,
    ``reverse`` (default: the same) shapes b->a.
    """

    def __init__(self, forward: ImpairmentProfile, reverse: ImpairmentProfile | None = None, *,
                 seed: int = 0, host: str = "127.0.0.1") -> None:
        self.relay = UdpImpairmentRelay(forward, reverse, seed=seed, host=host)

    def rewrite(self, sdp: str, side: Side) -> str:
        """Register ``side``'s host candidates in ``sdp`` and point them at the relay."""
        port_map = {real: self.relay.add_endpoint_nowait(real, side) for real in sdp_host_candidates(sdp)}
        if not port_map:
            raise ValueError("SDP has no IPv4 UDP host candidate to relay")
        return rewrite_sdp_candidates(sdp, port_map)

    def sdp_filter(self, side: Side) -> Callable[[str], str]:
        """A synchronous outgoing-SDP hook for ``side``'s link (call it on the loop thread)."""
        return lambda sdp: self.rewrite(sdp, side)

    def stats(self) -> dict[str, dict[str, int]]:
        return self.relay.stats()

    @property
    def paused(self) -> bool:
        return self.relay.paused

    def pause(self) -> None:
        """Cut the emulated link both ways until :meth:`resume` (see :meth:`UdpImpairmentRelay.pause`)."""
        self.relay.pause()

    def resume(self) -> None:
        self.relay.resume()

    async def close(self) -> None:
        await self.relay.close()
