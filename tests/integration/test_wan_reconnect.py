"""A link whose line goes dead for 10 s comes back by itself and delivers everything sent."""

import asyncio
import hashlib
import os
import time

import pytest

from engine.net.wan_emulator import ImpairmentProfile, WanLink
from engine.net.wan_measure import connect_through

pytestmark = [pytest.mark.network, pytest.mark.slow]


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
    assert [h.get("i") for h, _ in got] == [0, 1, 2, None] and got[-1][0]["type"] == "done"
    assert [hashlib.sha256(p).digest() for _, p in got[:3]] == [hashlib.sha256(p).digest() for p in payloads]
    assert received_at_pause < 3 * 1024 * 1024 and seconds >= 10
