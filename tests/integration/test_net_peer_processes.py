"""Peers in separate processes (tests.support.loopback_peer) over real aiortc on 127.0.0.1,
with the signalling server in the test process."""

import asyncio
import hashlib
import random
import re

import pytest

from engine.net.errors import LinkClosed
from engine.net.identity import Identity
from engine.net.peer_manager import PeerManager
from engine.net.signalling import SignallingClient, SignallingServer, start_signalling_server
from tests.support.loopback_peer import PeerProcess, make_tensor

pytestmark = pytest.mark.network

_FINGERPRINT = re.compile(r"^(a=fingerprint:sha-256 )([0-9A-F:]+)\s*$", re.MULTILINE)


def run(coro, timeout_s=150.0):
    return asyncio.run(asyncio.wait_for(coro, timeout_s))


class FingerprintSwappingRelay(SignallingServer):
    """A relay that replaces the DTLS fingerprint in offers or answers (``tamper``)."""

    tamper: str | None = None
    swapped = 0

    def relay_transform(self, message):
        if message["kind"] != self.tamper:
            return message
        fake = ":".join(f"{random.randrange(256):02X}" for _ in range(32))
        sdp, n = _FINGERPRINT.subn(lambda m: m.group(1) + fake, message["sdp"])
        assert n >= 1, "no fingerprint to swap"
        self.swapped += 1
        return {**message, "sdp": sdp}


def test_a_relay_that_swaps_the_dtls_fingerprint_is_refused_in_either_direction():
    async def body():
        relay = FingerprintSwappingRelay()
        srv = await start_signalling_server(server=relay)
        try:
            async with PeerProcess(srv.url) as a, PeerProcess(srv.url) as b:
                for tamper in ("offer", "answer"):
                    relay.tamper = tamper
                    result = await a.command({"cmd": "dial", "peer": b.peer_id, "timeout_s": 15}, "dialed", 30)
                    assert result["ok"] is False and result["error_type"] == "AuthenticationError", result
                    assert "signature" in result["error"]
                assert relay.swapped == 2
                assert not [e for e in a.events + b.events if e["event"] == "link_opened"]
                relay.tamper = None  # the same peers connect fine through an honest relay
                result = await a.command({"cmd": "dial", "peer": b.peer_id}, "dialed", 30)
                assert result["ok"] is True, result
                pinged = await a.command({"cmd": "ping", "peer": b.peer_id, "count": 5}, "pinged")
                assert len(pinged["rtt_ms"]) == 5
        finally:
            await srv.close()
    run(body())


def test_a_chunked_10_mb_tensor_crosses_processes_intact_and_the_link_reconnects():
    elements = 10 * 1024 * 1024 // 4

    async def body():
        srv = await start_signalling_server()
        try:
            async with PeerProcess(srv.url) as a, PeerProcess(srv.url) as b:
                assert (await a.command({"cmd": "dial", "peer": b.peer_id}, "dialed", 30))["ok"]
                sent = await a.command({"cmd": "send_tensor", "peer": b.peer_id, "elements": elements,
                                        "seed": 11}, "tensor_sent", 240)
                expected = hashlib.sha256(make_tensor(elements, 11).tobytes()).hexdigest()
                assert sent["sha256"] == expected and sent["remote_sha256"] == expected and sent["ok"]
                assert sent["bytes"] == elements * 4
                stats = (await b.command({"cmd": "stats"}, "stats"))["links"][a.peer_id]
                assert stats["frames_received"] >= elements * 4 // (256 * 1024)
                assert stats["strikes"] == 0
                # reconnect: a fresh offer/answer replaces the link and traffic flows again
                assert (await a.command({"cmd": "dial", "peer": b.peer_id}, "dialed", 30))["ok"]
                await b.wait_for("link_closed", 30, peer=a.peer_id)
                pinged = await a.command({"cmd": "ping", "peer": b.peer_id, "count": 3}, "pinged")
                assert len(pinged["rtt_ms"]) == 3
        finally:
            await srv.close()
    run(body(), 300.0)


def test_fuzzed_frames_over_a_live_link_are_survived_and_the_abuser_disconnected_and_refused():
    strikes = 8

    async def body():
        srv = await start_signalling_server()
        me = SignallingClient(srv.url, Identity.generate())
        manager = PeerManager(me)
        try:
            await me.connect()
            async with PeerProcess(srv.url, max_strikes=strikes) as victim, PeerProcess(srv.url) as abuser:
                assert (await abuser.command({"cmd": "dial", "peer": victim.peer_id}, "dialed", 30))["ok"]
                fuzzed = await abuser.command({"cmd": "fuzz", "peer": victim.peer_id, "frames": strikes,
                                               "seed": 3}, "fuzzed")
                assert fuzzed["sent"] == strikes
                pinged = await abuser.command({"cmd": "ping", "peer": victim.peer_id, "count": 2}, "pinged")
                assert len(pinged["rtt_ms"]) == 2  # under the limit: still served
                stats = (await victim.command({"cmd": "stats"}, "stats"))["links"][abuser.peer_id]
                assert stats["strikes"] == strikes and stats["frames_dropped"] == strikes
                await abuser.command({"cmd": "fuzz", "peer": victim.peer_id, "frames": 50, "seed": 4}, "fuzzed")
                closed = await victim.wait_for("link_closed", 30, peer=abuser.peer_id)
                assert closed["reason"] == "strikes"
                assert (await abuser.command({"cmd": "wait_closed", "peer": victim.peer_id, "timeout_s": 30},
                                             "wait_closed"))["closed"]
                assert abuser.peer_id in (await victim.command({"cmd": "stats"}, "stats"))["banned"]
                redial = await abuser.command({"cmd": "dial", "peer": victim.peer_id, "timeout_s": 15}, "dialed")
                assert redial["ok"] is False and "banned" in redial["error"]
                # the victim process survived and serves everyone else
                link = await manager.connect(victim.peer_id)
                await link.send({"type": "ping", "id": 1}, b"hello")
                header, payload = await asyncio.wait_for(link.recv(), 10)
                assert header == {"type": "pong", "id": 1} and payload == b"hello"
                assert victim.running
        finally:
            await manager.close()
            await me.close()
            await srv.close()
    run(body())


def test_dialing_a_peer_that_is_not_registered_fails_fast():
    async def body():
        srv = await start_signalling_server()
        me = SignallingClient(srv.url, Identity.generate())
        manager = PeerManager(me)
        try:
            await me.connect()
            with pytest.raises(LinkClosed, match="not connected"):
                await manager.connect("0123456789abcdef", timeout_s=10)
        finally:
            await manager.close()
            await me.close()
            await srv.close()
    run(body(), 30)
