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

Both send 64 KiB messages without pause: first for ``warmup_s`` (slow start and
the first loss events, not counted), then for ``window_s``; goodput is the bytes
of *complete* messages the receiver got within the window divided by its
length: the steady state a long-lived link sees. CPU seconds of this process are reported too: sender, receiver
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
from engine.net.wan_emulator import ImpairmentProfile, WanLink
from engine.net.wan_measure import connect_through, negotiate_through

MB = 1e6
#: message size of both senders (small enough that a slow cell still counts many)
CELL_MESSAGE_BYTES = 64 * 1024


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

    def warmup_s(self) -> float:
        """Time to leave slow start behind: about 15 round trips, at least a second."""
        return max(1.0, 15 * self.rtt_ms / 1e3)


class _Meter:
    """Counts the bytes of complete messages received."""

    def __init__(self) -> None:
        self.bytes = 0

    def add(self, nbytes: int) -> None:
        self.bytes += nbytes


async def _timed(meter: _Meter, sender: asyncio.Task, warmup_s: float, window_s: float) -> dict[str, float]:
    """Let ``sender`` run ``warmup_s``, then count ``window_s``; stop it."""
    try:
        await asyncio.sleep(warmup_s)
        start_bytes, wall, cpu = meter.bytes, time.perf_counter(), time.process_time()
        await asyncio.sleep(window_s)
        nbytes = meter.bytes - start_bytes
        wall, cpu = time.perf_counter() - wall, time.process_time() - cpu
    finally:
        sender.cancel()
        await asyncio.gather(sender, return_exceptions=True)
    failure = sender.exception() if sender.done() and not sender.cancelled() else None
    if failure is not None:
        raise failure
    return {"bytes": nbytes, "seconds": wall, "cpu_s": cpu}


def _resolve(future: asyncio.Future) -> None:
    if not future.done():
        future.set_result(None)


def _resolve_all(futures: list[asyncio.Future]) -> None:
    for future in futures:
        _resolve(future)


def _figures(kind: str, cell: Cell, timed: dict[str, float], wan: WanLink) -> dict[str, Any]:
    goodput = timed["bytes"] / timed["seconds"] / MB
    return {"kind": kind, "rtt_ms": cell.rtt_ms, "loss_percent": cell.loss_percent,
            "bandwidth_mbps": cell.bandwidth_mbps, "goodput_mb_s": goodput,
            "link_share": goodput / cell.line_mb_s, "bytes": timed["bytes"], "seconds": timed["seconds"],
            "cpu_s_per_mb": timed["cpu_s"] / max(timed["bytes"] / MB, 1e-3), "relay": wan.stats()["a_to_b"]}


async def stock_cell(cell: Cell, *, window_s: float, seed: int = 0, open_timeout_s: float = 30.0) -> dict[str, Any]:
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
        ch_a.on("open", lambda: _resolve(opened[0]))
        ch_b.on("open", lambda: _resolve(opened[1]))
        meter = _Meter()
        ch_b.on("message", lambda data: meter.add(len(data)))
        ch_a.bufferedAmountLowThreshold = config.low_water_bytes
        drained: list[asyncio.Future] = []
        ch_a.on("bufferedamountlow", lambda: _resolve_all(drained))
        await negotiate_through(pc_a, pc_b, wan.sdp_filter("a"), wan.sdp_filter("b"))
        await asyncio.wait_for(asyncio.gather(*opened), open_timeout_s)

        async def send_forever() -> None:
            block = os.urandom(CELL_MESSAGE_BYTES)
            while True:
                if ch_a.bufferedAmount > config.high_water_bytes:
                    drained[:] = [loop.create_future()]
                    await drained[0]
                ch_a.send(block)

        sender = loop.create_task(send_forever(), name="wan-goodput-stock-sender")
        return _figures("stock", cell, await _timed(meter, sender, cell.warmup_s(), window_s), wan)
    finally:
        await asyncio.gather(pc_a.close(), pc_b.close(), return_exceptions=True)
        await wan.close()


async def polis_cell(cell: Cell, *, window_s: float, config: LinkConfig | None = None, seed: int = 0) -> dict[str, Any]:
    """Goodput of framed messages between two PeerLinks (``config``) across ``cell``."""
    loop = asyncio.get_running_loop()
    config = config or LinkConfig()
    wan = WanLink(cell.profile(), seed=seed)
    try:
        a, b = await connect_through(wan.sdp_filter("a"), wan.sdp_filter("b"), config=config)
    except BaseException:
        await wan.close()
        raise
    try:
        meter = _Meter()

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
            timed = await _timed(meter, sender, cell.warmup_s(), window_s)
        finally:
            receiver.cancel()
            await asyncio.gather(receiver, return_exceptions=True)
        return {**_figures("polis", cell, timed, wan), "sctp": config.sctp.as_dict()}
    finally:
        await asyncio.gather(a.close(), b.close(), return_exceptions=True)
        await wan.close()
