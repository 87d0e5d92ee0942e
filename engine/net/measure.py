"""Transport measurements on loopback, as reusable async functions (``polis bench transport``).

* :func:`raw_channel_throughput` - bare aiortc data channel, one process, no framing,
  the same ``bufferedAmount`` backpressure a link uses: the ceiling to compare with.
* :func:`framed_throughput_in_process` - PeerLink framing over the same setup
  (isolates framing cost from process effects).
* :func:`framed_goodput_two_processes` - a float32 tensor (encoded with the project
  codec) from this process to a :mod:`engine.net.loopback_peer` child, through
  signed signalling, until the child acknowledges the sha256 of what it decoded.
* :func:`rtt_two_processes` - small-message round trips over the control channel.

Each returns a plain dict of figures (MB = 10**6 bytes). Python SCTP/DTLS is
CPU-bound, so figures depend on what else the machine runs: compare ratios
measured in one run. Nothing here prints.
"""

from __future__ import annotations

import asyncio
import os
import statistics
import time
from typing import Any

from engine.net.peer_link import LinkConfig, PeerLink, enlarge_socket_buffers

MB = 1e6


async def _negotiate(offerer_pc, answerer_pc) -> None:
    from aiortc import RTCSessionDescription

    await offerer_pc.setLocalDescription(await offerer_pc.createOffer())
    await answerer_pc.setRemoteDescription(RTCSessionDescription(offerer_pc.localDescription.sdp, "offer"))
    await answerer_pc.setLocalDescription(await answerer_pc.createAnswer())
    await offerer_pc.setRemoteDescription(RTCSessionDescription(answerer_pc.localDescription.sdp, "answer"))


async def link_pair(config: LinkConfig | None = None) -> tuple[PeerLink, PeerLink]:
    """Two open PeerLinks joined directly in this process (no signalling)."""
    config = config or LinkConfig()
    a = PeerLink.create("pair-b", config)
    b = PeerLink.create("pair-a", config)
    await _negotiate(a.pc, b.pc)
    await asyncio.gather(a.wait_open(), b.wait_open())
    return a, b


async def raw_channel_throughput(total_bytes: int = 16 * 1024 * 1024, message_bytes: int = 255 * 1024, *,
                                 high_water_bytes: int = LinkConfig.high_water_bytes,
                                 low_water_bytes: int = LinkConfig.low_water_bytes,
                                 socket_buffer_bytes: int = LinkConfig.socket_buffer_bytes) -> dict[str, Any]:
    """Bare aiortc: one negotiated channel between two connections in this process, with the
    same backpressure thresholds and socket buffers a link uses (so only framing differs)."""
    from aiortc import RTCPeerConnection

    pc_a, pc_b = RTCPeerConnection(), RTCPeerConnection()
    ch_a = pc_a.createDataChannel("raw", negotiated=True, id=0)
    ch_b = pc_b.createDataChannel("raw", negotiated=True, id=0)
    loop = asyncio.get_running_loop()
    opened = [loop.create_future(), loop.create_future()]
    ch_a.on("open", lambda: opened[0].done() or opened[0].set_result(None))
    ch_b.on("open", lambda: opened[1].done() or opened[1].set_result(None))
    done = loop.create_future()
    received = 0

    def on_message(data: bytes) -> None:
        nonlocal received
        received += len(data)
        if received >= total_bytes and not done.done():
            done.set_result(time.perf_counter())

    ch_b.on("message", on_message)
    drained: list[asyncio.Future | None] = [None]

    def on_low() -> None:
        if drained[0] is not None and not drained[0].done():
            drained[0].set_result(None)

    ch_a.bufferedAmountLowThreshold = low_water_bytes
    ch_a.on("bufferedamountlow", on_low)
    try:
        await _negotiate(pc_a, pc_b)
        enlarge_socket_buffers(pc_a, socket_buffer_bytes)
        enlarge_socket_buffers(pc_b, socket_buffer_bytes)
        await asyncio.wait_for(asyncio.gather(*opened), 30.0)
        block = os.urandom(message_bytes)
        start = time.perf_counter()
        sent = 0
        while sent < total_bytes:
            if ch_a.bufferedAmount > high_water_bytes:
                drained[0] = loop.create_future()
                await drained[0]
            ch_a.send(block)
            sent += message_bytes
        end = await asyncio.wait_for(done, 600.0)
    finally:
        await pc_a.close()
        await pc_b.close()
    seconds = end - start
    return {"mb_s": received / seconds / MB, "seconds": seconds, "bytes": received, "message_bytes": message_bytes}


async def framed_throughput_in_process(total_bytes: int = 16 * 1024 * 1024,
                                       config: LinkConfig | None = None) -> dict[str, Any]:
    """One message of ``total_bytes`` through two PeerLinks in this process."""
    a, b = await link_pair(config)
    try:
        payload = os.urandom(total_bytes)
        start = time.perf_counter()
        receiver = asyncio.ensure_future(b.recv())
        await a.send({"type": "blob"}, payload, channel="bulk")
        _, got = await asyncio.wait_for(receiver, 600.0)
        seconds = time.perf_counter() - start
        intact = got == payload
    finally:
        await a.close()
        await b.close()
    return {"mb_s": total_bytes / seconds / MB, "seconds": seconds, "bytes": total_bytes,
            "frame_bytes": a.frame_bytes, "intact": intact}


class LoopbackSession:
    """A signalling server and a local peer in this process, plus child peer processes."""

    def __init__(self, link_config: LinkConfig | None = None) -> None:
        self.link_config = link_config or LinkConfig()

    async def __aenter__(self) -> "LoopbackSession":
        from engine.net.identity import Identity
        from engine.net.peer_manager import PeerManager, PeerManagerConfig
        from engine.net.signalling import start_signalling_server
        from engine.net.signalling_client import SignallingClient

        self.server = await start_signalling_server()
        self.client = SignallingClient(self.server.url, Identity.generate())
        await self.client.connect()
        self.manager = PeerManager(self.client, PeerManagerConfig(link=self.link_config))
        return self

    async def __aexit__(self, *exc_info: Any) -> None:
        await self.manager.close()
        await self.client.close()
        await self.server.close()


async def framed_goodput_two_processes(elements: int = 4 * 1024 * 1024, *, encoding: str = "fp32",
                                       repeats: int = 1, link_config: LinkConfig | None = None,
                                       session: LoopbackSession | None = None,
                                       child: Any = None) -> dict[str, Any]:
    """Tensor goodput (payload bytes / second until acknowledged) to a child process."""
    from engine.net.loopback_peer import PeerProcess, encode_for_wire, make_tensor

    async def run(sess: LoopbackSession, proc: PeerProcess) -> dict[str, Any]:
        import hashlib

        link = await sess.manager.ensure_link(proc.peer_id)
        array = make_tensor(elements, seed=7)
        header, payload = encode_for_wire(array, encoding)
        sha = hashlib.sha256(array.tobytes()).hexdigest()
        times, intact = [], True
        for i in range(repeats):
            start = time.perf_counter()
            await link.send({"type": "tensor", "id": i + 1, "tensor": header}, payload, channel="bulk")
            reply, _ = await asyncio.wait_for(link.recv(), 600.0)
            times.append(time.perf_counter() - start)
            intact = intact and reply.get("type") == "tensor_ack" and reply.get("sha256") == sha
        best = min(times)
        return {"mb_s": len(payload) / best / MB, "seconds": best, "bytes": len(payload),
                "fp32_equivalent_mb_s": elements * 4 / best / MB, "encoding": encoding,
                "frame_bytes": link.frame_bytes, "intact": intact}

    if session is not None and child is not None:
        return await run(session, child)
    async with LoopbackSession(link_config) as sess:
        async with PeerProcess(sess.server.url) as proc:
            return await run(sess, proc)


async def rtt_two_processes(count: int = 200, payload_bytes: int = 64, *,
                            session: LoopbackSession | None = None, child: Any = None) -> dict[str, Any]:
    """Round trips of small ``ping`` messages on the control channel to a child process."""
    from engine.net.loopback_peer import PeerProcess

    async def run(sess: LoopbackSession, proc: PeerProcess) -> dict[str, Any]:
        link = await sess.manager.ensure_link(proc.peer_id)
        payload = b"r" * payload_bytes
        rtts = []
        for i in range(count + 10):
            start = time.perf_counter()
            await link.send({"type": "ping", "id": i}, payload)
            await asyncio.wait_for(link.recv(), 10.0)
            if i >= 10:  # warm-up
                rtts.append((time.perf_counter() - start) * 1000.0)
        rtts.sort()
        return {"p50_ms": statistics.median(rtts), "p90_ms": rtts[int(0.9 * (len(rtts) - 1))],
                "mean_ms": statistics.fmean(rtts), "count": len(rtts)}

    if session is not None and child is not None:
        return await run(session, child)
    async with LoopbackSession() as sess:
        async with PeerProcess(sess.server.url) as proc:
            return await run(sess, proc)


async def transport_summary(total_mb: float = 16.0, frame_bytes: int = 255 * 1024,
                            rtt_count: int = 200) -> dict[str, Any]:
    """Raw vs framed throughput, two-process goodput and RTT, measured back to back."""
    from engine.net.loopback_peer import PeerProcess

    total = int(total_mb * 1024 * 1024)
    config = LinkConfig(frame_bytes=frame_bytes)
    raw = await raw_channel_throughput(total, min(frame_bytes, 256 * 1024))
    in_process = await framed_throughput_in_process(total, config)
    async with LoopbackSession(config) as sess:
        async with PeerProcess(sess.server.url) as proc:
            goodput = await framed_goodput_two_processes(total // 4, session=sess, child=proc)
            rtt = await rtt_two_processes(rtt_count, session=sess, child=proc)
    return {"raw_aiortc_mb_s": raw["mb_s"], "framed_in_process_mb_s": in_process["mb_s"],
            "framed_goodput_mb_s": goodput["mb_s"], "goodput_ratio": goodput["mb_s"] / raw["mb_s"],
            "in_process_ratio": in_process["mb_s"] / raw["mb_s"], "rtt_ms": rtt["p50_ms"],
            "rtt_p90_ms": rtt["p90_ms"], "intact": bool(in_process["intact"] and goodput["intact"]),
            "frame_bytes": goodput["frame_bytes"]}
