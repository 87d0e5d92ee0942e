"""Goodput of one emulated WAN link, stock aiortc against Polis links (``polis bench transport``).

One *cell* is one impairment (RTT, loss, line rate) applied to both directions
by a :class:`~engine.net.wan_emulator.WanLink` relay in this process, and two
fresh connections across it:

* ``stock``: one plain aiortc ``RTCPeerConnection`` pair, one reliable ordered
  data channel, default SCTP, 255 KiB messages with the same ``bufferedAmount``
  backpressure a link uses;
* ``polis``: two :class:`~engine.net.peer_link.PeerLink` s built with the given
  :class:`~engine.net.link_config.LinkConfig` (its SCTP tuning included),
  sending framed messages on the bulk channel.

Both send for at most ``budget_s`` seconds or ``budget_bytes`` bytes, whichever
comes first; goodput is the bytes of *complete* messages the receiver got
divided by the time from the first send to the stop (slow start included, the
same for both). CPU seconds of this process are reported too: sender, receiver
and relay all run on this one event loop, so on a busy machine the figures are
bound by CPU as much as by the emulated line.

What this module does not know: the table layout or the CLI (see
:mod:`engine.bench.transport`).
"""

from __future__ import annotations

import asyncio
import os
import time
from dataclasses import dataclass
from typing import Any

from engine.net.link_config import LinkConfig
from engine.net.peer_link import PeerLink
from engine.net.wan_emulator import ImpairmentProfile, WanLink

MB = 1e6
#: message size of both senders (one PeerLink frame, one stock data-channel message)
CELL_MESSAGE_BYTES = 255 * 1024 - 64


@dataclass(frozen=True)
class Cell:
    """One emulated link: round trip, random loss per direction, line rate per direction."""

    rtt_ms: float
    loss_percent: float
    bandwidth_mbps: float

    def profile(self) -> ImpairmentProfile:
        # queue of ~one bandwidth-delay product (at least 64 KiB), like a sanely sized router buffer
        bdp_bytes = int(self.bandwidth_mbps * 1e6 / 8 * self.rtt_ms / 1e3)
        return ImpairmentProfile(delay_ms=self.rtt_ms / 2, loss_percent=self.loss_percent,
                                 bandwidth_mbps=self.bandwidth_mbps,
                                 queue_limit_bytes=max(64 * 1024, bdp_bytes))

    @property
    def line_mb_s(self) -> float:
        return self.bandwidth_mbps / 8


async def _negotiate_through(wan: WanLink, pc_a, pc_b) -> None:
    from aiortc import RTCSessionDescription

    await pc_a.setLocalDescription(await pc_a.createOffer())
    offer = wan.rewrite(pc_a.localDescription.sdp, "a")
    await pc_b.setRemoteDescription(RTCSessionDescription(offer, "offer"))
    await pc_b.setLocalDescription(await pc_b.createAnswer())
    answer = wan.rewrite(pc_b.localDescription.sdp, "b")
    await pc_a.setRemoteDescription(RTCSessionDescription(answer, "answer"))


class _Meter:
    """Counts received bytes and says when the budget is met."""

    def __init__(self, budget_bytes: int) -> None:
        self.budget_bytes = budget_bytes
        self.bytes = 0
        self.done = asyncio.get_running_loop().create_future()

    def add(self, nbytes: int) -> None:
        self.bytes += nbytes
        if self.bytes >= self.budget_bytes and not self.done.done():
            self.done.set_result(None)


async def _timed(meter: _Meter, sender: asyncio.Task, budget_s: float) -> tuple[float, float]:
    """Wait for the budget (bytes or seconds); (wall seconds, CPU seconds) from now."""
    wall, cpu = time.perf_counter(), time.process_time()
    try:
        await asyncio.wait_for(asyncio.shield(meter.done), budget_s)
    except asyncio.TimeoutError:
        pass
    wall, cpu = time.perf_counter() - wall, time.process_time() - cpu
    sender.cancel()
    await asyncio.gather(sender, return_exceptions=True)
    return wall, cpu


def _figures(kind: str, cell: Cell, meter: _Meter, wall_s: float, cpu_s: float, wan: WanLink) -> dict[str, Any]:
    goodput = meter.bytes / wall_s / MB
    return {"kind": kind, "rtt_ms": cell.rtt_ms, "loss_percent": cell.loss_percent,
            "bandwidth_mbps": cell.bandwidth_mbps, "goodput_mb_s": goodput,
            "link_share": goodput / cell.line_mb_s, "bytes": meter.bytes, "seconds": wall_s,
            "cpu_s_per_mb": cpu_s / max(meter.bytes / MB, 1e-9), "relay": wan.stats()["a_to_b"]}


async def stock_cell(cell: Cell, *, budget_bytes: int, budget_s: float, seed: int = 0,
                     open_timeout_s: float = 30.0) -> dict[str, Any]:
    """Goodput of one stock aiortc data channel across ``cell``."""
    from aiortc import RTCPeerConnection

    loop = asyncio.get_running_loop()
    config = LinkConfig()
    wan = WanLink(cell.profile(), seed=seed)
    pc_a, pc_b = RTCPeerConnection(), RTCPeerConnection()
    try:
        ch_a = pc_a.createDataChannel("stock", negotiated=True, id=0)
        ch_b = pc_b.createDataChannel("stock", negotiated=True, id=0)
        opened = [loop.create_future(), loop.create_future()]
        ch_a.on("open", lambda: opened[0].done() or opened[0].set_result(None))
        ch_b.on("open", lambda: opened[1].done() or opened[1].set_result(None))
        meter = _Meter(budget_bytes)
        ch_b.on("message", lambda data: meter.add(len(data)))
        ch_a.bufferedAmountLowThreshold = config.low_water_bytes
        drained: list[asyncio.Future] = []
        ch_a.on("bufferedamountlow", lambda: [f.done() or f.set_result(None) for f in drained])
        await _negotiate_through(wan, pc_a, pc_b)
        await asyncio.wait_for(asyncio.gather(*opened), open_timeout_s)

        async def send_forever() -> None:
            block = os.urandom(CELL_MESSAGE_BYTES)
            while True:
                if ch_a.bufferedAmount > config.high_water_bytes:
                    drained[:] = [loop.create_future()]
                    await drained[0]
                ch_a.send(block)

        sender = loop.create_task(send_forever(), name="wan-goodput-stock-sender")
        wall_s, cpu_s = await _timed(meter, sender, budget_s)
        return _figures("stock", cell, meter, wall_s, cpu_s, wan)
    finally:
        await asyncio.gather(pc_a.close(), pc_b.close(), return_exceptions=True)
        await wan.close()


async def polis_cell(cell: Cell, *, budget_bytes: int, budget_s: float, config: LinkConfig | None = None,
                     seed: int = 0) -> dict[str, Any]:
    """Goodput of framed messages between two PeerLinks (``config``) across ``cell``."""
    loop = asyncio.get_running_loop()
    config = config or LinkConfig()
    wan = WanLink(cell.profile(), seed=seed)
    a, b = PeerLink.create("wan-goodput-b", config), PeerLink.create("wan-goodput-a", config)
    try:
        await _negotiate_through(wan, a.pc, b.pc)
        await asyncio.gather(a.wait_open(), b.wait_open())
        meter = _Meter(budget_bytes)

        async def receive_forever() -> None:
            async for _header, payload in b:
                meter.add(len(payload))

        async def send_forever() -> None:
            block = os.urandom(CELL_MESSAGE_BYTES)
            while True:
                await a.send({"type": "blob"}, block, channel="bulk")

        receiver = loop.create_task(receive_forever(), name="wan-goodput-polis-receiver")
        sender = loop.create_task(send_forever(), name="wan-goodput-polis-sender")
        try:
            wall_s, cpu_s = await _timed(meter, sender, budget_s)
        finally:
            receiver.cancel()
            await asyncio.gather(receiver, return_exceptions=True)
        return {**_figures("polis", cell, meter, wall_s, cpu_s, wan), "sctp": config.sctp.as_dict()}
    finally:
        await asyncio.gather(a.close(), b.close(), return_exceptions=True)
        await wan.close()
