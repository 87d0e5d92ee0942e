"""Transport measurements on loopback, as reusable async functions (``polis bench transport``).

* :class:`RawChannelPair` / :func:`raw_channel_throughput` - bare aiortc data channel,
  one process, no framing, the same ``bufferedAmount`` backpressure a link uses: the
  ceiling to compare with.
* :func:`framed_throughput_in_process` - PeerLink framing over the same setup
  (isolates framing cost from process effects).
* :func:`framed_goodput_two_processes` - a float32 tensor (encoded with the project
  codec) from this process to an :mod:`engine.net.echo_peer` child, through
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


class RawChannelPair:
    """Bare aiortc: one negotiated channel between two connections in this process, with
    the same backpressure thresholds and socket buffers a link uses (so only framing
    differs). Async context manager; :meth:`transfer` may be called repeatedly, so a
    measurement can run on a warmed-up association like a long-lived link does."""

    def __init__(self, *, high_water_bytes: int = LinkConfig.high_water_bytes,
                 low_water_bytes: int = LinkConfig.low_water_bytes,
                 socket_buffer_bytes: int = LinkConfig.socket_buffer_bytes) -> None:
        self.high_water_bytes = high_water_bytes
        self.low_water_bytes = low_water_bytes
        self.socket_buffer_bytes = socket_buffer_bytes
        self._received = 0
        self._target = 0
        self._done: asyncio.Future | None = None
        self._drained: asyncio.Future | None = None

    async def __aenter__(self) -> "RawChannelPair":
        from aiortc import RTCPeerConnection

        loop = asyncio.get_running_loop()
        self.pc_a, self.pc_b = RTCPeerConnection(), RTCPeerConnection()
        self.ch_a = self.pc_a.createDataChannel("raw", negotiated=True, id=0)
        ch_b = self.pc_b.createDataChannel("raw", negotiated=True, id=0)
        opened = [loop.create_future(), loop.create_future()]
        self.ch_a.on("open", lambda: opened[0].done() or opened[0].set_result(None))
        ch_b.on("open", lambda: opened[1].done() or opened[1].set_result(None))
        ch_b.on("message", self._on_message)
        self.ch_a.bufferedAmountLowThreshold = self.low_water_bytes
        self.ch_a.on("bufferedamountlow", self._on_low)
        try:
            await _negotiate(self.pc_a, self.pc_b)
            enlarge_socket_buffers(self.pc_a, self.socket_buffer_bytes)
            enlarge_socket_buffers(self.pc_b, self.socket_buffer_bytes)
            await asyncio.wait_for(asyncio.gather(*opened), 30.0)
        except BaseException:
            await self.__aexit__(None, None, None)
            raise
        return self

    async def __aexit__(self, *exc_info: Any) -> None:
        await self.pc_a.close()
        await self.pc_b.close()

    def _on_message(self, data: bytes) -> None:
        self._received += len(data)
        if self._done is not None and self._received >= self._target and not self._done.done():
            self._done.set_result(time.perf_counter())

    def _on_low(self) -> None:
        if self._drained is not None and not self._drained.done():
            self._drained.set_result(None)

    async def transfer(self, total_bytes: int, message_bytes: int = 255 * 1024) -> dict[str, Any]:
        """Send ``total_bytes`` in messages of ``message_bytes``; time until all arrived."""
        loop = asyncio.get_running_loop()
        self._received, self._target, self._done = 0, total_bytes, loop.create_future()
        block = os.urandom(message_bytes)
        start = time.perf_counter()
        sent = 0
        while sent < total_bytes:
            if self.ch_a.bufferedAmount > self.high_water_bytes:
                self._drained = loop.create_future()
                await self._drained
            self.ch_a.send(block)
            sent += message_bytes
        end = await asyncio.wait_for(self._done, 600.0)
        seconds = end - start
        return {"mb_s": self._received / seconds / MB, "seconds": seconds, "bytes": self._received,
                "message_bytes": message_bytes}


async def raw_channel_throughput(total_bytes: int = 16 * 1024 * 1024, message_bytes: int = 255 * 1024, *,
                                 high_water_bytes: int = LinkConfig.high_water_bytes,
                                 low_water_bytes: int = LinkConfig.low_water_bytes,
                                 socket_buffer_bytes: int = LinkConfig.socket_buffer_bytes) -> dict[str, Any]:
    """One transfer over a fresh :class:`RawChannelPair` (cold association)."""
    async with RawChannelPair(high_water_bytes=high_water_bytes, low_water_bytes=low_water_bytes,
                              socket_buffer_bytes=socket_buffer_bytes) as pair:
        return await pair.transfer(total_bytes, message_bytes)


async def _framed_transfer(a: PeerLink, b: PeerLink, total_bytes: int) -> dict[str, Any]:
    payload = os.urandom(total_bytes)
    start = time.perf_counter()
    receiver = asyncio.ensure_future(b.recv())
    await a.send({"type": "blob"}, payload, channel="bulk")
    _, got = await asyncio.wait_for(receiver, 600.0)
    seconds = time.perf_counter() - start
    return {"mb_s": total_bytes / seconds / MB, "seconds": seconds, "bytes": total_bytes,
            "frame_bytes": a.frame_bytes, "intact": got == payload}


async def framed_throughput_in_process(total_bytes: int = 16 * 1024 * 1024,
                                       config: LinkConfig | None = None) -> dict[str, Any]:
    """One message of ``total_bytes`` through two fresh PeerLinks in this process."""
    a, b = await link_pair(config)
    try:
        return await _framed_transfer(a, b, total_bytes)
    finally:
        await a.close()
        await b.close()


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
        from engine.net.echo_peer import ECHO_MESSAGES

        self.manager = PeerManager(self.client, PeerManagerConfig(link=self.link_config),
                                   validator=ECHO_MESSAGES.convert)
        return self

    async def __aexit__(self, *exc_info: Any) -> None:
        await self.manager.close()
        await self.client.close()
        await self.server.close()


async def framed_goodput_two_processes(elements: int = 4 * 1024 * 1024, *, encoding: str = "fp32",
                                       repeats: int = 1, link_config: LinkConfig | None = None,
                                       session: LoopbackSession | None = None,
                                       child: Any = None) -> dict[str, Any]:
    """Tensor goodput (payload bytes / second until acknowledged) to a child process;
    ``mb_s`` from the median of ``repeats`` transfers on one link."""
    from engine.net.echo_peer import PeerProcess, TensorAck, TensorMessage, make_tensor
    from engine.net.tensor_codec import encode_tensor

    async def run(sess: LoopbackSession, proc: PeerProcess) -> dict[str, Any]:
        import hashlib

        link = await sess.manager.ensure_link(proc.peer_id)
        array = make_tensor(elements, seed=7)
        encoded = encode_tensor(array, encoding)
        payload = encoded.payload
        sha = hashlib.sha256(array.tobytes()).hexdigest()
        times, intact = [], True
        for i in range(repeats):
            start = time.perf_counter()
            await link.send(TensorMessage(id=i + 1, tensor=encoded.header), payload, channel="bulk")
            reply, _ = await asyncio.wait_for(link.recv(), 600.0)
            times.append(time.perf_counter() - start)
            intact = intact and isinstance(reply, TensorAck) and reply.sha256 == sha
        median = statistics.median(times)
        return {"mb_s": len(payload) / median / MB, "seconds": median, "bytes": len(payload),
                "best_mb_s": len(payload) / min(times) / MB, "runs_mb_s": [len(payload) / t / MB for t in times],
                "fp32_equivalent_mb_s": elements * 4 / median / MB, "encoding": encoding,
                "frame_bytes": link.frame_bytes, "intact": intact}

    if session is not None and child is not None:
        return await run(session, child)
    async with LoopbackSession(link_config) as sess:
        async with PeerProcess(sess.server.url) as proc:
            return await run(sess, proc)


async def rtt_two_processes(count: int = 200, payload_bytes: int = 64, *,
                            session: LoopbackSession | None = None, child: Any = None) -> dict[str, Any]:
    """Round trips of small ``ping`` messages on the control channel to a child process."""
    from engine.net.echo_peer import PeerProcess, Ping

    async def run(sess: LoopbackSession, proc: PeerProcess) -> dict[str, Any]:
        link = await sess.manager.ensure_link(proc.peer_id)
        payload = b"r" * payload_bytes
        rtts = []
        for i in range(count + 10):
            start = time.perf_counter()
            await link.send(Ping(id=i), payload)
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
                            rtt_count: int = 200, rounds: int = 3) -> dict[str, Any]:
    """Raw vs framed throughput, two-process goodput and RTT, measured back to back.

    Raw aiortc and framed links in one process, and framed goodput to a second process,
    are measured on long-lived, warmed-up associations (one untimed transfer each first,
    as a link in a swarm is), in ``rounds`` alternating rounds so that load from elsewhere
    on the machine hits all three alike; ratios are of the medians, and every round is
    reported. One process runs both ends of its association on one core; two processes
    can use two.
    """
    from engine.net.echo_peer import PeerProcess

    if rounds < 1:
        raise ValueError("transport_summary needs rounds >= 1")
    total = int(total_mb * 1024 * 1024)
    message_bytes = min(frame_bytes, 256 * 1024)
    config = LinkConfig(frame_bytes=frame_bytes)
    runs: dict[str, list[float]] = {"raw_aiortc_mb_s": [], "framed_in_process_mb_s": [], "framed_goodput_mb_s": []}
    intact = True
    a, b = await link_pair(config)
    try:
        async with RawChannelPair() as raw_pair, LoopbackSession(config) as sess:
            async with PeerProcess(sess.server.url) as proc:
                await raw_pair.transfer(total // 4, message_bytes)
                intact = (await _framed_transfer(a, b, total // 4))["intact"]
                warm = await framed_goodput_two_processes(total // 16, session=sess, child=proc)
                intact = intact and warm["intact"]
                for _ in range(rounds):
                    runs["raw_aiortc_mb_s"].append((await raw_pair.transfer(total, message_bytes))["mb_s"])
                    local = await _framed_transfer(a, b, total)
                    runs["framed_in_process_mb_s"].append(local["mb_s"])
                    goodput = await framed_goodput_two_processes(total // 4, session=sess, child=proc)
                    runs["framed_goodput_mb_s"].append(goodput["mb_s"])
                    intact = intact and local["intact"] and goodput["intact"]
                rtt = await rtt_two_processes(rtt_count, session=sess, child=proc)
    finally:
        await a.close()
        await b.close()
    med = {k: statistics.median(v) for k, v in runs.items()}
    raw = med["raw_aiortc_mb_s"]
    return {"raw_aiortc_mb_s": raw, "framed_in_process_mb_s": med["framed_in_process_mb_s"],
            "framed_goodput_mb_s": med["framed_goodput_mb_s"], "goodput_ratio": med["framed_goodput_mb_s"] / raw,
            "in_process_ratio": med["framed_in_process_mb_s"] / raw, "rtt_ms": rtt["p50_ms"],
            "rtt_p90_ms": rtt["p90_ms"], "intact": intact, "frame_bytes": goodput["frame_bytes"],
            "rounds": {**runs, "goodput_ratio": [f / r for f, r in zip(runs["framed_goodput_mb_s"],
                                                                       runs["raw_aiortc_mb_s"])]}}
