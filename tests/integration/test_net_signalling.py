"""Signalling server and client over real websockets on 127.0.0.1 (one process)."""

import asyncio
import base64
import json
import os

import aiohttp
import pytest

from engine.net.errors import AuthenticationError, LinkClosed
from engine.net.identity import Identity
from engine.net.peer_manager import PeerManager
from engine.net.signalling import (
    SignallingClient,
    SignallingClientConfig,
    SignallingConfig,
    SignallingServer,
    registration_bytes,
    signal_bytes,
    start_signalling_server,
)

pytestmark = pytest.mark.network


def run(coro, timeout_s=60.0):
    return asyncio.run(asyncio.wait_for(coro, timeout_s))


def b64(raw: bytes) -> str:
    return base64.b64encode(raw).decode()


async def _raw_register(url, identity, *, sign_with=None, peer_id=None):
    """Register by hand; returns (session, ws, reply)."""
    session = aiohttp.ClientSession()
    ws = await session.ws_connect(url)
    challenge = json.loads((await ws.receive(timeout=5)).data)
    nonce = bytes.fromhex(challenge["nonce"])
    signer = sign_with or identity
    await ws.send_json({"type": "register", "peer_id": peer_id or identity.peer_id,
                        "public_key": b64(identity.public_key),
                        "signature": b64(signer.sign(registration_bytes(nonce, identity.public_key)))})
    msg = await ws.receive(timeout=5)
    reply = json.loads(msg.data) if msg.type == aiohttp.WSMsgType.TEXT else {"type": msg.type.name}
    return session, ws, reply


def test_registration_needs_a_signature_over_the_challenge_by_the_key_behind_the_peer_id():
    async def body():
        srv = await start_signalling_server()
        me, other = Identity.generate(), Identity.generate()
        try:
            for kwargs, fragment in [({"sign_with": other}, "signature"), ({"peer_id": other.peer_id}, "hash")]:
                session, ws, reply = await _raw_register(srv.url, me, **kwargs)
                assert reply["type"] == "error" and fragment in reply["reason"]
                assert (await ws.receive(timeout=5)).type in (aiohttp.WSMsgType.CLOSE, aiohttp.WSMsgType.CLOSED)
                await session.close()
            assert srv.server.peer_ids() == []
            session, ws, reply = await _raw_register(srv.url, me)
            assert reply == {"type": "registered", "peer_id": me.peer_id}
            assert srv.server.peer_ids() == [me.peer_id]
            assert srv.server.public_key(me.peer_id) == me.public_key
            await ws.close()
            await session.close()
        finally:
            await srv.close()
    run(body())


def test_malformed_messages_get_errors_and_then_the_socket_is_closed():
    async def body():
        srv = await start_signalling_server(server=SignallingServer(SignallingConfig(max_strikes=3)))
        me = Identity.generate()
        session, ws, reply = await _raw_register(srv.url, me)
        try:
            assert reply["type"] == "registered"
            bad = ["not json", "[1,2]", json.dumps({"type": "signal", "to": "x"}), "[" * 100_000,
                   json.dumps({"type": "signal", "to": "0" * 16, "kind": "offer", "session": "0" * 32,
                               "sdp": "x" * 100_000, "signature": "AA=="})]
            reasons = []
            for text in bad:
                await ws.send_str(text)
                msg = await ws.receive(timeout=5)
                if msg.type != aiohttp.WSMsgType.TEXT:
                    break
                reasons.append(json.loads(msg.data)["reason"])
            assert len(reasons) == 4 and all(reasons)
            assert (await ws.receive(timeout=5)).type in (aiohttp.WSMsgType.CLOSE, aiohttp.WSMsgType.CLOSED)
        finally:
            await session.close()
            await srv.close()
    run(body())


def test_signals_are_relayed_signed_and_verified_and_unknown_recipients_reported():
    async def body():
        srv = await start_signalling_server()
        a = SignallingClient(srv.url, Identity.generate())
        b = SignallingClient(srv.url, Identity.generate())
        got, problems = asyncio.Queue(), asyncio.Queue()
        try:
            await a.connect()
            await b.connect()
            b.on_signal = got.put_nowait
            a.on_problem = problems.put_nowait
            await a.send(b.peer_id, "offer", "1" * 32, "v=0 sdp text")
            signal = await asyncio.wait_for(got.get(), 5)
            assert (signal.kind, signal.sender, signal.session, signal.sdp) == \
                   ("offer", a.peer_id, "1" * 32, "v=0 sdp text")
            assert signal.sender_key == a.identity.public_key
            await a.send("f" * 16, "offer", "2" * 32, "x")
            problem = await asyncio.wait_for(problems.get(), 5)
            assert problem.session == "2" * 32 and "not connected" in problem.reason
            assert not problem.authentication_failed
        finally:
            for c in (a, b):
                await c.close()
            await srv.close()
    run(body())


class KeySwappingRelay(SignallingServer):
    """A relay that substitutes its own key and signature for the sender's."""

    def __init__(self):
        super().__init__()
        self.impostor = Identity.generate()

    def relay_transform(self, message):
        forged = signal_bytes(message["kind"], message["from"], message["to"], message["session"], message["sdp"])
        return {**message, "from_key": b64(self.impostor.public_key), "signature": b64(self.impostor.sign(forged))}


def test_a_relay_cannot_impersonate_a_peer_with_its_own_key():
    async def body():
        srv = await start_signalling_server(server=KeySwappingRelay())
        a = SignallingClient(srv.url, Identity.generate())
        b = SignallingClient(srv.url, Identity.generate())
        manager_a, manager_b = PeerManager(a), PeerManager(b)
        try:
            await a.connect()
            await b.connect()
            with pytest.raises(AuthenticationError, match="does not hash"):
                await manager_a.connect(b.peer_id, timeout_s=10)
            assert manager_a.links == {} and manager_b.links == {}
        finally:
            await manager_a.close()
            await manager_b.close()
            for c in (a, b):
                await c.close()
            await srv.close()
    run(body())


def test_the_client_registers_again_after_the_server_drops_it():
    async def body():
        registrations = []
        server = SignallingServer(on_register=lambda peer, key: registrations.append(peer))
        srv = await start_signalling_server(server=server)
        client = SignallingClient(srv.url, Identity.generate(),
                                  SignallingClientConfig(reconnect_initial_s=0.05))
        try:
            await client.connect()
            assert registrations == [client.peer_id]
            await server.close()  # drops every websocket, keeps serving
            for _ in range(500):
                await asyncio.sleep(0.02)
                if len(registrations) == 2:
                    break
            assert registrations == [client.peer_id, client.peer_id]
            assert client.registered.is_set() and server.peer_ids() == [client.peer_id]
        finally:
            await client.close()
            await srv.close()
    run(body())


def test_an_unreachable_server_is_a_clear_error():
    async def body():
        client = SignallingClient("ws://127.0.0.1:9/signal", Identity.generate(),
                                  SignallingClientConfig(connect_timeout_s=3))
        try:
            with pytest.raises(LinkClosed, match="cannot reach"):
                await client.connect()
        finally:
            await client.close()
    run(body())


def test_simultaneous_connects_between_two_peers_end_in_one_working_link():
    async def body():
        srv = await start_signalling_server()
        a = SignallingClient(srv.url, Identity.generate())
        b = SignallingClient(srv.url, Identity.generate())
        manager_a, manager_b = PeerManager(a), PeerManager(b)
        try:
            await a.connect()
            await b.connect()
            link_a, link_b = await asyncio.gather(manager_a.connect(b.peer_id), manager_b.connect(a.peer_id))
            await asyncio.sleep(0.2)
            assert list(manager_a.links) == [b.peer_id] and list(manager_b.links) == [a.peer_id]
            assert manager_a.links[b.peer_id] is link_a and manager_b.links[a.peer_id] is link_b
            await link_a.send({"type": "hi"}, b"from a")
            await link_b.send({"type": "hi"}, b"from b")
            assert (await asyncio.wait_for(link_b.recv(), 10))[1] == b"from a"
            assert (await asyncio.wait_for(link_a.recv(), 10))[1] == b"from b"
        finally:
            await manager_a.close()
            await manager_b.close()
            for c in (a, b):
                await c.close()
            await srv.close()
    run(body())


def test_the_sdp_filter_rewrites_outgoing_sdp_before_it_is_signed():
    def advertise_small_messages(sdp: str) -> str:
        assert "a=max-message-size:262144" in sdp
        return sdp.replace("a=max-message-size:262144", "a=max-message-size:100000")

    async def body():
        srv = await start_signalling_server()
        a = SignallingClient(srv.url, Identity.generate())
        b = SignallingClient(srv.url, Identity.generate())
        manager_a = PeerManager(a, sdp_filter=advertise_small_messages)
        manager_b = PeerManager(b)
        try:
            await a.connect()
            await b.connect()
            link_a = await manager_a.connect(b.peer_id, timeout_s=20)
            link_b = await manager_b.accept(10)
            # b saw a's filtered (and still validly signed) offer and frames below a's advertised size
            assert link_b.frame_bytes == 100000 and link_a.frame_bytes == link_a.config.frame_bytes
            payload = os.urandom(300_000)
            await link_b.send({"type": "big"}, payload, channel="bulk")
            assert (await asyncio.wait_for(link_a.recv(), 30))[1] == payload
            assert link_b.stats.frames_sent == 4
        finally:
            await manager_a.close()
            await manager_b.close()
            for c in (a, b):
                await c.close()
            await srv.close()
    run(body())
