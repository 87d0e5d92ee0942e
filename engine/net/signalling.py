"""The signalling server: authenticates peers and relays their signed SDP signals.

:class:`SignallingServer` mounts on any aiohttp application with
:meth:`~SignallingServer.add_routes` (the coordinator mounts it);
:func:`start_signalling_server` runs one standalone (tests, benches, a LAN
without a coordinator). Each websocket gets a random challenge; the peer
registers with its Ed25519 public key, a peer id that must equal hash(key) and a
signature over the challenge. The server then maps peer id -> websocket and
relays ``signal`` messages between registered peers, attaching the sender's id
and verified key; it rate-limits relays, strikes malformed messages and closes
sockets that keep sending them. It cannot alter what it relays undetected (see
:mod:`engine.net.signalling_protocol`).

The client lives in :mod:`engine.net.signalling_client` (re-exported here).
It knows nothing about WebRTC beyond carrying SDP text.
"""

from __future__ import annotations

import asyncio
import json
import logging
import secrets
from dataclasses import dataclass
from typing import Callable

import aiohttp
from aiohttp import web

from engine.net.errors import AuthenticationError, ProtocolViolation
from engine.net.identity import PUBLIC_KEY_BYTES, SIGNATURE_BYTES, peer_id_for, verify_signature
from engine.net.signalling_protocol import (
    NONCE_HEX_CHARS,
    PROTOCOL_VERSION,
    SERVER_INBOUND,
    SERVER_REGISTRATION,
    Challenge,
    DeliveredSignal,
    Error,
    Registered,
    SendSignal,
    b64,
    b64decode_exact,
    parse_json,
    registration_bytes,
)
from engine.net.wire import encode_json, to_dict

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class SignallingConfig:
    """Server-side limits.

    max_message_chars: largest websocket text frame accepted.
    register_timeout_s: a websocket that has not registered by then is closed.
    max_peers: most registered peers at once.
    heartbeat_s: websocket ping interval (dead peers are noticed within ~2x).
    max_strikes: malformed messages tolerated per websocket before it is closed.
    signals_per_s, signal_burst: token-bucket rate limit on relayed signals per peer.
    """

    max_message_chars: int = 64 * 1024
    register_timeout_s: float = 10.0
    max_peers: int = 4096
    heartbeat_s: float = 15.0
    max_strikes: int = 8
    signals_per_s: float = 20.0
    signal_burst: int = 40


@dataclass
class _Registered:
    ws: web.WebSocketResponse
    public_key: bytes
    tokens: float
    refilled_at: float


class SignallingServer:
    """Registers peers by challenge-response and relays their signed signals.

    ``on_register(peer_id, public_key)`` / ``on_unregister(peer_id)`` let the
    coordinator track membership. :meth:`relay_transform` is the one place a
    relayed message passes through (tests override it to play a malicious relay).
    """

    def __init__(self, config: SignallingConfig | None = None, *,
                 on_register: Callable[[str, bytes], None] | None = None,
                 on_unregister: Callable[[str], None] | None = None) -> None:
        self.config = config or SignallingConfig()
        self.on_register = on_register
        self.on_unregister = on_unregister
        self._peers: dict[str, _Registered] = {}
        self._sockets: set[web.WebSocketResponse] = set()

    def add_routes(self, app: web.Application, path: str = "/signal") -> None:
        """Mount the websocket endpoint at ``path`` on ``app``."""
        app.router.add_get(path, self.handle)

    def peer_ids(self) -> list[str]:
        return sorted(self._peers)

    def public_key(self, peer_id: str) -> bytes | None:
        entry = self._peers.get(peer_id)
        return entry.public_key if entry else None

    def relay_transform(self, message: dict) -> dict:
        """The message as forwarded to its recipient (identity here)."""
        return message

    async def close(self) -> None:
        for ws in list(self._sockets):
            await ws.close(code=aiohttp.WSCloseCode.GOING_AWAY, message=b"server shutting down")

    async def handle(self, request: web.Request) -> web.WebSocketResponse:
        cfg = self.config
        ws = web.WebSocketResponse(heartbeat=cfg.heartbeat_s, max_msg_size=cfg.max_message_chars * 4)
        await ws.prepare(request)
        self._sockets.add(ws)
        peer_id: str | None = None
        try:
            peer_id = await self._register(ws)
            if peer_id is not None:
                await self._serve(ws, peer_id)
        except ConnectionError:
            pass
        finally:
            self._sockets.discard(ws)
            if peer_id is not None and self._peers.get(peer_id) is not None and self._peers[peer_id].ws is ws:
                del self._peers[peer_id]
                log.info("signalling: %s left", peer_id)
                if self.on_unregister:
                    self.on_unregister(peer_id)
            if not ws.closed:
                await ws.close()
        return ws

    async def _reject(self, ws: web.WebSocketResponse, reason: str) -> None:
        log.info("signalling: refused a registration: %s", reason)
        if not ws.closed:
            await self._send_error(ws, reason)
            await ws.close(code=aiohttp.WSCloseCode.POLICY_VIOLATION, message=b"registration refused")

    async def _register(self, ws: web.WebSocketResponse) -> str | None:
        cfg = self.config
        nonce = secrets.token_bytes(NONCE_HEX_CHARS // 2)
        await ws.send_str(encode_json(Challenge(nonce=nonce.hex(), protocol=PROTOCOL_VERSION)))
        try:
            msg = await ws.receive(timeout=cfg.register_timeout_s)
        except asyncio.TimeoutError:
            await self._reject(ws, f"no registration within {cfg.register_timeout_s} s")
            return None
        if msg.type != aiohttp.WSMsgType.TEXT:
            return None
        try:
            reg = parse_json(msg.data, SERVER_REGISTRATION, cfg.max_message_chars)
            key = b64decode_exact(reg.public_key, PUBLIC_KEY_BYTES, "public_key")
            signature = b64decode_exact(reg.signature, SIGNATURE_BYTES, "signature")
            if peer_id_for(key) != reg.peer_id:
                raise AuthenticationError("peer id is not the hash of the public key")
            verify_signature(key, registration_bytes(nonce, key), signature)
        except (ProtocolViolation, AuthenticationError) as exc:
            await self._reject(ws, f"registration refused: {exc}")
            return None
        peer_id = reg.peer_id
        previous = self._peers.get(peer_id)
        if previous is None and len(self._peers) >= cfg.max_peers:
            await self._reject(ws, "the signalling server is full")
            return None
        loop = asyncio.get_running_loop()
        self._peers[peer_id] = _Registered(ws, key, float(cfg.signal_burst), loop.time())
        if previous is not None and not previous.ws.closed:
            log.info("signalling: %s registered again; closing its previous websocket", peer_id)
            await previous.ws.close(code=aiohttp.WSCloseCode.POLICY_VIOLATION, message=b"replaced")
        await ws.send_str(encode_json(Registered(peer_id=peer_id)))
        log.info("signalling: %s registered", peer_id)
        if self.on_register:
            self.on_register(peer_id, key)
        return peer_id

    def _take_token(self, entry: _Registered) -> bool:
        now = asyncio.get_running_loop().time()
        entry.tokens = min(float(self.config.signal_burst),
                           entry.tokens + (now - entry.refilled_at) * self.config.signals_per_s)
        entry.refilled_at = now
        if entry.tokens < 1.0:
            return False
        entry.tokens -= 1.0
        return True

    async def _serve(self, ws: web.WebSocketResponse, peer_id: str) -> None:
        strikes = 0
        async for msg in ws:
            if msg.type != aiohttp.WSMsgType.TEXT:
                reason = f"unexpected websocket message type {msg.type.name}"
                message = None
            else:
                try:
                    message = parse_json(msg.data, SERVER_INBOUND, self.config.max_message_chars)
                    reason = ""
                except ProtocolViolation as exc:
                    message, reason = None, str(exc)
            if message is None:
                strikes += 1
                log.warning("signalling: bad message from %s: %s (strike %d)", peer_id, reason, strikes)
                await self._send_error(ws, reason)
                if strikes > self.config.max_strikes:
                    await ws.close(code=aiohttp.WSCloseCode.POLICY_VIOLATION, message=b"too many bad messages")
                    return
                continue
            entry = self._peers.get(peer_id)
            if entry is None or entry.ws is not ws:
                return  # replaced by a newer registration
            if not self._take_token(entry):
                await self._send_error(ws, "rate limit exceeded", message)
                continue
            target = self._peers.get(message.to)
            if target is None or target.ws.closed:
                await self._send_error(ws, f"peer {message.to} is not connected", message)
                continue
            delivered = DeliveredSignal(to=message.to, kind=message.kind, session=message.session, sdp=message.sdp,
                                        signature=message.signature, sender=peer_id, from_key=b64(entry.public_key))
            forwarded = self.relay_transform(to_dict(delivered))
            try:
                await target.ws.send_str(json.dumps(forwarded))
            except ConnectionError:
                await self._send_error(ws, f"peer {message.to} went away", message)

    @staticmethod
    async def _send_error(ws: web.WebSocketResponse, reason: str, about: SendSignal | None = None) -> None:
        error = Error(reason=reason[:400]) if about is None else Error(reason=reason[:400], session=about.session,
                                                                     to=about.to)
        await ws.send_str(encode_json(error))


@dataclass
class RunningSignallingServer:
    """A standalone signalling server (tests, benches, a coordinator-less LAN)."""

    server: SignallingServer
    runner: web.AppRunner
    url: str

    async def close(self) -> None:
        await self.server.close()
        await self.runner.cleanup()


async def start_signalling_server(host: str = "127.0.0.1", port: int = 0, *,
                                  server: SignallingServer | None = None,
                                  path: str = "/signal") -> RunningSignallingServer:
    """Serve ``server`` (a new one by default) on ``host:port`` (0 = any free port)."""
    server = server or SignallingServer()
    app = web.Application()
    server.add_routes(app, path)
    runner = web.AppRunner(app, handle_signals=False, access_log=None)
    await runner.setup()
    site = web.TCPSite(runner, host, port)
    await site.start()
    bound = runner.addresses[0][1] if runner.addresses else port
    return RunningSignallingServer(server, runner, f"ws://{host}:{bound}{path}")


# The client and the wire protocol, re-exported so callers need one import.
from engine.net.signalling_client import SignallingClient, SignallingClientConfig  # noqa: E402
from engine.net.signalling_protocol import SESSION_HEX_CHARS, SIGNAL_KINDS, SignalProblem, SignedSignal, signal_bytes  # noqa: E402

__all__ = ["SignallingServer", "SignallingConfig", "RunningSignallingServer", "start_signalling_server",
           "SignallingClient", "SignallingClientConfig", "SignalProblem", "SignedSignal", "SESSION_HEX_CHARS",
           "SIGNAL_KINDS", "registration_bytes", "signal_bytes"]
