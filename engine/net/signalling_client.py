"""The signalling client: one peer's authenticated websocket to a signalling server.

:class:`SignallingClient` answers the server's challenge with its identity,
keeps the websocket up (reconnecting and re-registering with backoff), signs
every outgoing signal and verifies every incoming one
(:func:`~engine.net.signalling_protocol.verify_delivered`): verified signals go
to ``on_signal``; server errors and signals that fail verification go to
``on_problem``. What to do with offers and answers is
:mod:`engine.net.peer_manager`'s business.
"""

from __future__ import annotations

import asyncio
import logging
from dataclasses import dataclass
from typing import Callable

import aiohttp

from engine.net.errors import AuthenticationError, LinkClosed, ProtocolViolation
from engine.net.identity import Identity
from engine.net.signalling_protocol import (
    CLIENT_INBOUND,
    SIGNAL_KINDS,
    Challenge,
    ClientInbound,
    DeliveredSignal,
    Error,
    Register,
    Registered,
    SendSignal,
    SignalProblem,
    SignedSignal,
    b64,
    parse_json,
    registration_bytes,
    signal_bytes,
    verify_delivered,
)
from engine.net.wire import encode_json

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class SignallingClientConfig:
    """Client-side behaviour.

    connect_timeout_s: time allowed to open the websocket and register.
    reconnect: re-open and re-register when the websocket drops.
    reconnect_initial_s, reconnect_max_s: exponential backoff bounds between attempts.
    max_message_chars: largest inbound text frame accepted.
    heartbeat_s: websocket ping interval.
    """

    connect_timeout_s: float = 10.0
    reconnect: bool = True
    reconnect_initial_s: float = 0.5
    reconnect_max_s: float = 30.0
    max_message_chars: int = 64 * 1024
    heartbeat_s: float = 15.0


class SignallingClient:
    """One peer's authenticated connection to a signalling server.

    ``on_signal(SignedSignal)`` receives verified signals; ``on_problem(SignalProblem)``
    receives server errors (e.g. an unknown recipient) and signals that failed
    verification. Both are plain callables run on the loop.
    """

    def __init__(self, url: str, identity: Identity, config: SignallingClientConfig | None = None) -> None:
        self.url = url
        self.identity = identity
        self.config = config or SignallingClientConfig()
        self.on_signal: Callable[[SignedSignal], None] | None = None
        self.on_problem: Callable[[SignalProblem], None] | None = None
        self._session: aiohttp.ClientSession | None = None
        self._ws: aiohttp.ClientWebSocketResponse | None = None
        self._task: asyncio.Task | None = None
        self._closing = False
        self.registered = asyncio.Event()

    @property
    def peer_id(self) -> str:
        return self.identity.peer_id

    async def connect(self) -> None:
        """Open and register (raises on failure); then keep the connection up."""
        if self._session is None:
            self._session = aiohttp.ClientSession()
        await self._open()
        self._task = asyncio.get_running_loop().create_task(self._run(), name=f"polis-signalling-{self.peer_id}")

    async def _open(self) -> None:
        cfg = self.config
        assert self._session is not None
        try:
            ws = await asyncio.wait_for(
                self._session.ws_connect(self.url, heartbeat=cfg.heartbeat_s,
                                         max_msg_size=cfg.max_message_chars * 4),
                cfg.connect_timeout_s)
        except (aiohttp.ClientError, OSError, asyncio.TimeoutError) as exc:
            raise LinkClosed(f"cannot reach the signalling server at {self.url}: {exc}") from exc
        try:
            challenge = await self._receive_json(ws, cfg.connect_timeout_s)
            if not isinstance(challenge, Challenge):
                raise ProtocolViolation(f"expected a challenge, got {type(challenge).__name__}")
            try:
                nonce = bytes.fromhex(challenge.nonce)
            except ValueError:
                raise ProtocolViolation("the challenge nonce is not hex") from None
            signature = self.identity.sign(registration_bytes(nonce, self.identity.public_key))
            await ws.send_str(encode_json(Register(peer_id=self.peer_id, public_key=b64(self.identity.public_key),
                                                   signature=b64(signature))))
            reply = await self._receive_json(ws, cfg.connect_timeout_s)
            if isinstance(reply, Error):
                raise AuthenticationError(f"signalling server refused registration: {reply.reason}")
            if not isinstance(reply, Registered) or reply.peer_id != self.peer_id:
                raise ProtocolViolation("unexpected registration reply")
        except BaseException:
            await ws.close()
            raise
        self._ws = ws
        self.registered.set()
        log.info("registered %s with %s", self.peer_id, self.url)

    async def _receive_json(self, ws, timeout_s: float) -> ClientInbound:
        try:
            msg = await ws.receive(timeout=timeout_s)
        except asyncio.TimeoutError as exc:
            raise LinkClosed("the signalling server did not answer in time") from exc
        if msg.type != aiohttp.WSMsgType.TEXT:
            raise LinkClosed(f"signalling connection ended ({msg.type.name})")
        return parse_json(msg.data, CLIENT_INBOUND, self.config.max_message_chars)

    async def _run(self) -> None:
        delay = self.config.reconnect_initial_s
        while not self._closing:
            ws = self._ws
            if ws is not None:
                await self._read(ws)
                self.registered.clear()
                self._ws = None
                delay = self.config.reconnect_initial_s
            if self._closing or not self.config.reconnect:
                return
            log.info("signalling connection lost; reconnecting in %.1f s", delay)
            await asyncio.sleep(delay)
            try:
                await self._open()
            except (LinkClosed, ProtocolViolation, AuthenticationError, OSError) as exc:
                log.warning("signalling reconnect failed: %s", exc)
                delay = min(self.config.reconnect_max_s, delay * 2)

    async def _read(self, ws) -> None:
        async for msg in ws:
            if msg.type != aiohttp.WSMsgType.TEXT:
                log.warning("signalling: ignored a non-text message")
                continue
            try:
                message = parse_json(msg.data, CLIENT_INBOUND, self.config.max_message_chars)
            except ProtocolViolation as exc:
                log.warning("signalling: dropped a bad message from the server: %s", exc)
                continue
            try:
                if isinstance(message, Error):
                    log.info("signalling server: %s", message.reason)
                    if self.on_problem:
                        self.on_problem(SignalProblem(message.reason, session=message.session,
                                                      recipient=message.to))
                elif isinstance(message, DeliveredSignal):
                    self._deliver(message)
            except Exception:  # an observer's bug must not end the signalling connection
                log.exception("signalling: a handler failed")

    def _deliver(self, message: DeliveredSignal) -> None:
        try:
            signal = verify_delivered(message, self.peer_id)
        except (AuthenticationError, ProtocolViolation) as exc:
            log.warning("refused a %s from %s: %s", message.kind, message.sender, exc)
            if self.on_problem:
                self.on_problem(SignalProblem(f"signature check failed: {exc}", session=message.session,
                                              kind=message.kind, sender=message.sender,
                                              authentication_failed=True))
            return
        if self.on_signal:
            self.on_signal(signal)

    async def send(self, to: str, kind: str, session: str, sdp: str = "") -> None:
        """Sign and send a signal to peer ``to``; raises LinkClosed when not connected."""
        if kind not in SIGNAL_KINDS:
            raise ValueError(f"unknown signal kind {kind!r}")
        ws = self._ws
        if ws is None or ws.closed:
            raise LinkClosed("not connected to the signalling server")
        signature = self.identity.sign(signal_bytes(kind, self.peer_id, to, session, sdp))
        await ws.send_str(encode_json(SendSignal(to=to, kind=kind, session=session, sdp=sdp,  # type: ignore[arg-type]
                                                 signature=b64(signature))))

    async def close(self) -> None:
        self._closing = True
        if self._ws is not None:
            await self._ws.close()
        if self._task is not None:
            self._task.cancel()
            try:
                await self._task
            except (asyncio.CancelledError, Exception):
                pass
        if self._session is not None:
            await self._session.close()
