"""PeerLink over real aiortc on loopback (one process): framing, backpressure, strikes, close."""

import asyncio
import os
import random
import socket
import sys
from typing import Annotated

import msgspec
import pytest

from engine.net.errors import LinkClosed
from engine.net.measure import link_pair
from engine.net.peer_link import LinkConfig, enlarge_socket_buffers, remote_max_message_bytes
from engine.net.wire import MessageSet, WireMessage
from tests.support.frame_fuzz import hostile_frame

pytestmark = pytest.mark.network


def run(coro, timeout_s=60.0):
    return asyncio.run(asyncio.wait_for(coro, timeout_s))


async def _closing(*links):
    for link in links:
        await link.close()


def test_remote_max_message_size_is_read_from_the_sdp():
    assert remote_max_message_bytes("v=0\r\na=max-message-size:262144\r\n") == 262144
    assert remote_max_message_bytes("v=0\r\na=max-message-size:0\r\n") is None
    assert remote_max_message_bytes("v=0\r\n") == 64 * 1024


def test_messages_of_all_sizes_cross_both_channels_intact_and_in_order():
    async def body():
        a, b = await link_pair(LinkConfig(frame_bytes=64 * 1024))
        try:
            assert a.frame_bytes == 64 * 1024
            sizes = [0, 1, 64 * 1024, 64 * 1024 + 1, 700_000]
            payloads = [os.urandom(n) for n in sizes]
            for i, p in enumerate(payloads):
                await a.send({"type": "m", "i": i}, p, channel="bulk" if i % 2 else "control")
            got = {}
            for _ in sizes:
                header, payload = await b.recv()
                got[header["i"]] = payload
            assert [got[i] for i in range(len(sizes))] == payloads
            assert b.stats.messages_received == len(sizes)
            assert b.stats.payload_bytes_received == sum(sizes)
            assert a.stats.frames_sent > len(sizes)  # the large ones were chunked
        finally:
            await _closing(a, b)
    run(body())


def test_backpressure_keeps_the_send_queue_bounded_and_control_messages_overtake_bulk():
    async def body():
        config = LinkConfig(high_water_bytes=512 * 1024, low_water_bytes=128 * 1024)
        a, b = await link_pair(config)
        peak, urgent_sent = 0, False
        try:
            bulk = asyncio.ensure_future(a.send({"type": "bulk"}, os.urandom(6 * 1024 * 1024), channel="bulk"))
            while not bulk.done():
                peak = max(peak, a._channels["bulk"].bufferedAmount)
                await asyncio.sleep(0.005)
                if a.stats.frames_sent >= 4 and not urgent_sent:
                    await a.send({"type": "urgent"}, b"!", channel="control")
                    urgent_sent = True
            await bulk
            assert urgent_sent
            first, _ = await b.recv()
            second, payload = await b.recv()
            assert first["type"] == "urgent"  # did not wait for the 6 MB ahead of it
            assert second["type"] == "bulk" and len(payload) == 6 * 1024 * 1024
            assert 0 < peak <= config.high_water_bytes + a.frame_bytes
        finally:
            await _closing(a, b)
    run(body(), 120.0)


def test_hostile_frames_earn_strikes_and_a_peer_over_the_limit_is_disconnected():
    async def body():
        a, b = await link_pair(LinkConfig(max_strikes=5))
        rng = random.Random(1)
        try:
            for i in range(5):
                await a._send_raw_frame(hostile_frame(rng), "control" if i % 2 else "bulk")
            await a.send({"type": "still-fine"}, b"ok")
            header, _ = await asyncio.wait_for(b.recv(), 10)
            assert header["type"] == "still-fine"
            assert b.stats.strikes == 5 and b.stats.frames_dropped == 5 and b.stats.last_violation
            assert not b.closed
            await a._send_raw_frame(hostile_frame(rng))
            await asyncio.wait_for(b.wait_closed(), 10)
            assert b.closed_reason == "strikes"
            await asyncio.wait_for(a.wait_closed(), 30)
            assert a.closed_reason in ("remote", "failed")
            with pytest.raises(LinkClosed):
                await a.send({"type": "late"})
        finally:
            await _closing(a, b)
    run(body())


class _Ping(WireMessage, frozen=True, tag="ping"):
    id: Annotated[int, msgspec.Meta(ge=0, le=10)]


def test_a_header_decoder_turns_unknown_messages_into_strikes_and_yields_typed_headers():
    pings = MessageSet("test", _Ping, max_size=1024)

    async def body():
        a, b = await link_pair(LinkConfig(max_strikes=10))
        b._validator = pings.convert
        try:
            await a.send({"type": "ping", "id": 11})
            await a.send({"type": "surprise"})
            await a.send(_Ping(id=3))
            header, _ = await asyncio.wait_for(b.recv(), 10)
            assert header == _Ping(id=3)
            assert b.stats.strikes == 2 and "surprise" in b.stats.last_violation
        finally:
            await _closing(a, b)
    run(body())


def test_close_wakes_readers_and_refuses_further_sends():
    async def body():
        a, b = await link_pair()
        reader = asyncio.ensure_future(b.recv())
        await asyncio.sleep(0.05)
        await a.close()
        with pytest.raises(LinkClosed):
            await asyncio.wait_for(reader, 30)
        assert a.closed_reason == "local" and b.closed_reason in ("remote", "failed")
        with pytest.raises(LinkClosed):
            await a.send({"type": "x"})
        await b.close()
    run(body())


def test_headers_and_payloads_over_the_limits_are_refused_locally():
    async def body():
        a, b = await link_pair()
        try:
            with pytest.raises(ValueError):
                await a.send({"no_type": 1})
            with pytest.raises(ValueError):
                await a.send({"type": "x", "blob": b"a" * (a.config.limits.max_header_bytes + 1)})
            with pytest.raises(ValueError):
                await a.send({"type": "x"}, b"a", channel="video")
        finally:
            await _closing(a, b)
    run(body())


def test_a_cancelled_send_still_delivers_whole_messages_in_call_order():
    async def body():
        a, b = await link_pair(LinkConfig(frame_bytes=16 * 1024, high_water_bytes=64 * 1024,
                                          low_water_bytes=16 * 1024))
        try:
            big = os.urandom(2 * 1024 * 1024)
            sender = asyncio.ensure_future(a.send({"type": "big"}, big, channel="bulk"))
            small = asyncio.ensure_future(a.send({"type": "small"}, b"s", channel="bulk"))
            await asyncio.sleep(0.05)
            sender.cancel()
            await asyncio.gather(sender, small, return_exceptions=True)
            first, payload = await asyncio.wait_for(b.recv(), 60)
            second, _ = await asyncio.wait_for(b.recv(), 60)
            assert first["type"] == "big" and payload == big and second["type"] == "small"
            assert b.stats.strikes == 0 and b._reassemblers["bulk"].partial_messages == 0
        finally:
            await _closing(a, b)
    run(body(), 120.0)


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="Linux socket buffer accounting")
def test_link_sockets_get_udp_buffers_that_hold_the_sctp_window():
    async def body():
        a, b = await link_pair(LinkConfig(socket_buffer_bytes=1024 * 1024))
        try:
            transport = a.pc.sctp.transport.transport._connection._protocols[0].transport
            sock = transport.get_extra_info("socket")
            limit = int(open("/proc/sys/net/core/rmem_max").read())
            assert sock.getsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF) >= min(1024 * 1024, limit)
            assert enlarge_socket_buffers(a.pc, 1024 * 1024) >= 1
        finally:
            await _closing(a, b)
    run(body())


def test_a_peer_that_stops_draining_sctp_closes_the_link_after_the_drain_timeout_instead_of_freezing_the_sender():
    async def body():
        config = LinkConfig(high_water_bytes=256 * 1024, low_water_bytes=64 * 1024, drain_timeout_s=1.0)
        a, b = await link_pair(config)

        async def ignore(chunk):  # b's SCTP stops processing everything: no data read, no SACK sent
            return None
        b.pc.sctp._receive_chunk = ignore
        try:
            started = asyncio.get_running_loop().time()
            with pytest.raises(LinkClosed, match="stalled"):
                await a.send({"type": "bulk"}, os.urandom(4 * 1024 * 1024), channel="bulk")
            waited = asyncio.get_running_loop().time() - started
            assert a.closed_reason == "stalled" and 1.0 <= waited < 10.0
            with pytest.raises(LinkClosed):
                await a.send({"type": "late"})
        finally:
            await _closing(a, b)
    run(body())
