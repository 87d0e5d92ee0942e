"""Links across a dead line or a changed address: a 10 s outage is ridden out by SCTP itself
(retransmitting what was in flight, nothing lost); an address change is survived by a fresh
connection through signalling, which replaces the dead link."""

import asyncio
import hashlib
import os
import time

import pytest

from engine.net.wan_emulator import ImpairmentProfile, WanLink
from engine.net.wan_measure import connect_through

pytestmark = pytest.mark.network


@pytest.mark.slow
def test_a_transfer_survives_a_ten_second_dead_line_mid_message_without_losing_a_message():
    profile = ImpairmentProfile(delay_ms=20, loss_percent=0.5, bandwidth_mbps=16)
    payloads = [os.urandom(1024 * 1024) for _ in range(3)]

    async def scenario():
        wan = WanLink(profile, seed=5)
        try:
            a, b = await connect_through(wan.sdp_filter("a"), wan.sdp_filter("b"))
        except BaseException:
            await wan.close()
            raise
        try:

            async def send_all():
                for i, payload in enumerate(payloads):
                    await a.send({"type": "blob", "i": i}, payload, channel="bulk")
                await a.send({"type": "done"}, b"", channel="control")

            async def receive_all():
                got = []
                while len(got) < len(payloads) + 1:
                    got.append(await asyncio.wait_for(b.recv(), 60))
                return got

            receiver = asyncio.ensure_future(receive_all())
            sender = asyncio.ensure_future(send_all())
            while b.stats.wire_bytes_received < 512 * 1024:
                await asyncio.sleep(0.05)  # the first message is on its way
            wan.pause()
            paused_at = time.monotonic()
            await asyncio.sleep(10)
            during = (b.stats.wire_bytes_received, a.is_open, b.is_open)
            await asyncio.sleep(0.5)
            stalled = b.stats.wire_bytes_received == during[0]
            wan.resume()
            got = await asyncio.wait_for(receiver, 90)
            await sender
            return got, during, stalled, time.monotonic() - paused_at, wan.stats(), a.is_open and b.is_open
        finally:
            await asyncio.gather(a.close(), b.close(), return_exceptions=True)
            await wan.close()

    got, (received_at_pause, a_open, b_open), stalled, seconds, stats, still_open = asyncio.run(scenario())
    assert stalled and a_open and b_open and still_open  # the line was dead; neither side gave the link up
    assert stats["a_to_b"]["dropped_paused"] > 0
    blobs = [(h["i"], p) for h, p in got if h["type"] == "blob"]  # control may overtake bulk: other stream
    assert [i for i, _ in blobs] == [0, 1, 2] and [h["type"] for h, _ in got].count("done") == 1
    assert [hashlib.sha256(p).digest() for _, p in blobs] == [hashlib.sha256(p).digest() for p in payloads]
    assert received_at_pause < 3 * 1024 * 1024 and seconds >= 10


def test_after_an_address_change_a_fresh_connection_through_signalling_replaces_the_dead_link():
    """aiortc has no ICE restart: the path is a new RTCPeerConnection negotiated through signalling
    (PeerManager.connect, which replaces the old link), gathering candidates at the new address."""
    from engine.net.identity import Identity
    from engine.net.peer_manager import PeerManager
    from engine.net.signalling import SignallingClient, start_signalling_server

    profile = ImpairmentProfile(delay_ms=10, bandwidth_mbps=20)

    async def scenario():
        srv = await start_signalling_server()
        a, b = SignallingClient(srv.url, Identity.generate()), SignallingClient(srv.url, Identity.generate())
        old_path, new_path = WanLink(profile, seed=1), WanLink(profile, seed=2)
        manager_a = PeerManager(a, sdp_filter=old_path.sdp_filter("a"))
        manager_b = PeerManager(b, sdp_filter=old_path.sdp_filter("b"))
        try:
            await a.connect()
            await b.connect()
            old = await manager_a.connect(b.peer_id, timeout_s=20)
            old_b = await manager_b.accept(20)
            await old.send({"type": "hello"}, b"over the old path")
            first = await asyncio.wait_for(old_b.recv(), 20)

            await old_path.close()  # the address changed: the old path is gone, the link does not know yet
            manager_a.sdp_filter, manager_b.sdp_filter = new_path.sdp_filter("a"), new_path.sdp_filter("b")
            new = await manager_a.connect(b.peer_id, timeout_s=20)
            new_b = await manager_b.accept(20)
            await new.send({"type": "hello"}, b"over the new path")
            second = await asyncio.wait_for(new_b.recv(), 20)
            await asyncio.wait_for(old_b.wait_closed(), 20)
            return (first[1], second[1], old.closed, old_b.closed_reason, manager_a.link(b.peer_id) is new,
                    new_path.stats()["a_to_b"]["forwarded"])
        finally:
            await manager_a.close()
            await manager_b.close()
            for client in (a, b):
                await client.close()
            await asyncio.gather(old_path.close(), new_path.close())
            await srv.close()

    first, second, old_closed, old_b_reason, current, forwarded = asyncio.run(asyncio.wait_for(scenario(), 90))
    assert (first, second) == (b"over the old path", b"over the new path")
    assert old_closed and old_b_reason is not None and current
    assert forwarded > 0  # the new link really crosses the new path
