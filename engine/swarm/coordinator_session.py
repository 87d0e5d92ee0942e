"""A node's session with the coordinator: websocket, signed hello, welcome, reconnect with backoff.

:class:`CoordinatorSession` is the node's
:class:`~engine.swarm.node_context.CoordinatorSender`. ``serve`` connects to the
coordinator's ``/node`` websocket, answers the challenge with a signed hello
(:func:`hello_bytes`), waits for the welcome and hands it to ``on_welcome``
(loading runs on its own task, so heartbeats are answered during a long load),
then passes every validated message to ``on_message`` until the socket closes.
The coordinator proves its identity too: the hello carries the node's own nonce, and the
welcome the coordinator's public key and its signature over :func:`welcome_bytes`. A
URL that pins a key (``http://host:port/#key=...``, ``engine.net.identity.pin_url``)
makes the node refuse any coordinator that cannot prove that key; without a pin the
first proven key is kept for the life of the session object (trust on first use).
A key that comes without a valid signature is always refused. The proven key
(:attr:`CoordinatorSession.coordinator_key`) verifies the job tickets peers show.
If the coordinator goes away (or the node is paused) it calls ``on_lost`` and,
unless stopped or paused, tries again after a backoff that doubles up to
``reconnect_max_s``. Links to other nodes are not its business and survive.

What it does not know: what a welcome or a job means, stages, links.
"""

from __future__ import annotations

import asyncio
import base64
import binascii
import logging
import secrets
from collections.abc import Awaitable, Callable, Coroutine
from typing import Any, TypeVar

import aiohttp

from engine.net.errors import AuthenticationError, ProtocolViolation
from engine.net.identity import Identity, split_pinned_url, verify_signature
from engine.swarm import messages
from engine.swarm.node_context import TaskSpawner

log = logging.getLogger(__name__)

M = TypeVar("M")

HELLO_DOMAIN = b"polis-node-hello\x00"
WELCOME_DOMAIN = b"polis-coordinator-welcome\x00"
#: longest wait for the coordinator's next handshake message (seconds)
HANDSHAKE_TIMEOUT_S = 30.0
#: longest one message to the coordinator may take to send (seconds)
SEND_TIMEOUT_S = 10.0
#: websocket heartbeat: a coordinator silent for this long is taken as gone (seconds)
HEARTBEAT_S = 10.0
CONNECT_TIMEOUT_S = 10.0


def hello_bytes(nonce: str, public_key: bytes) -> bytes:
    """What a node signs to prove its identity to the coordinator."""
    return HELLO_DOMAIN + nonce.encode() + b"\x00" + public_key


def welcome_bytes(node_nonce: str, challenge_nonce: str, peer_id: str, coordinator_key: bytes) -> bytes:
    """What a coordinator signs in a welcome to prove its identity to the node ``peer_id``."""
    return (WELCOME_DOMAIN + node_nonce.encode() + b"\x00" + challenge_nonce.encode() + b"\x00"
            + peer_id.encode() + b"\x00" + coordinator_key)


class CoordinatorSession:
    """One node's connection to its coordinator; see the module docstring."""

    def __init__(self, url: str, identity: Identity, tasks: TaskSpawner, *,
                 hello_fields: Callable[[], dict[str, Any]],
                 on_welcome: Callable[[messages.Welcome], Awaitable[None]],
                 on_message: Callable[[messages.CoordinatorToNode], None],
                 on_members: Callable[[messages.Members], None],
                 while_connected: Callable[[], Coroutine[Any, Any, None]],
                 emit: Callable[..., None], set_state: Callable[[str, str], None],
                 reconnect_max_s: float = 10.0) -> None:
        #: the URL without its pin, and the key it pins (None: trust the first key proven)
        self.url, self.pinned_key = split_pinned_url(url)
        #: the coordinator key the last welcome proved (None until then, or from a coordinator without one)
        self.coordinator_key: bytes | None = None
        self.identity = identity
        self.tasks = tasks
        self.hello_fields = hello_fields
        self.on_welcome = on_welcome
        self.on_message = on_message
        self.on_members = on_members
        self.while_connected = while_connected
        self.emit = emit
        self.set_state = set_state
        self.reconnect_max_s = reconnect_max_s
        self._ws: aiohttp.ClientWebSocketResponse | None = None

    # ------------------------------------------------------------------ CoordinatorSender
    async def send(self, message: messages.NodeToCoordinator) -> None:
        ws = self._ws
        if ws is None or ws.closed:
            log.debug("coordinator away; dropped %s", type(message).__name__)
            return
        await asyncio.wait_for(ws.send_str(messages.encode(message)), SEND_TIMEOUT_S)

    async def close(self) -> None:
        """Leave this coordinator now (``serve`` then reconnects unless stopped or paused)."""
        if self._ws is not None:
            await self._ws.close()

    # ------------------------------------------------------------------ reconnecting
    async def serve(self, stop: asyncio.Event, running: asyncio.Event, on_lost: Callable[[], None]) -> None:
        """Stay connected until ``stop``; while ``running`` is clear (paused), stay away."""
        delay = 0.5
        while not stop.is_set():
            if not running.is_set():
                await running.wait()
                continue
            self.set_state("connecting", f"reaching the coordinator at {self.url}")
            try:
                await self._connect_once(stop, running)
                delay = 0.5
            except (aiohttp.ClientError, OSError, asyncio.TimeoutError, ConnectionError) as exc:
                log.info("coordinator unreachable (%s); retrying in %.1f s", exc, delay)
                self.emit("log", level="warning",
                          message=f"Cannot reach the coordinator ({exc.__class__.__name__}); retrying.")
            except ProtocolViolation as exc:
                log.warning("coordinator sent something invalid: %s", exc)
            except AuthenticationError as exc:
                log.error("refusing the coordinator at %s: %s", self.url, exc)
                self.emit("error", message=f"The coordinator at {self.url} could not prove its identity: {exc}",
                          hint="Check the swarm link (its '#key=' part names the coordinator's key); "
                               "not joining until a coordinator proves it.", fatal=False)
            on_lost()
            if stop.is_set():
                break
            if not running.is_set():
                delay = 0.5
                continue
            try:
                await asyncio.wait_for(stop.wait(), delay)
            except asyncio.TimeoutError:
                pass
            delay = min(delay * 2, self.reconnect_max_s)

    async def _connect_once(self, stop: asyncio.Event, running: asyncio.Event) -> None:
        url = self.url.rstrip("/") + "/node"
        timeout = aiohttp.ClientTimeout(total=None, connect=CONNECT_TIMEOUT_S)
        async with aiohttp.ClientSession(timeout=timeout) as http:
            async with http.ws_connect(url, max_msg_size=messages.MAX_WS_MESSAGE_CHARS,
                                       heartbeat=HEARTBEAT_S) as ws:
                challenge = await self._recv(ws, messages.Challenge)
                own_nonce = secrets.token_hex(16)
                await asyncio.wait_for(ws.send_str(messages.encode(self._hello(challenge.nonce, own_nonce))),
                                       SEND_TIMEOUT_S)
                welcome = await self._recv(ws, messages.Welcome)
                self._check_coordinator(welcome, own_nonce, challenge.nonce)
                self._ws = ws
                side = [self.tasks.spawn(self.on_welcome(welcome), "polis-node-load"),
                        self.tasks.spawn(self.while_connected(), "polis-node-report"),
                        self.tasks.spawn(self._close_on_stop(ws, stop, running), "polis-node-stopper")]
                try:
                    async for msg in ws:
                        if msg.type != aiohttp.WSMsgType.TEXT:
                            break
                        try:
                            data = messages.decode_from_coordinator(msg.data)
                        except ProtocolViolation as exc:
                            log.warning("dropped an invalid coordinator message: %s", exc)
                            continue
                        self.on_message(data)
                finally:
                    for task in side:
                        task.cancel()
                    self._ws = None

    @staticmethod
    async def _close_on_stop(ws, stop: asyncio.Event, running: asyncio.Event) -> None:
        """Close the session when the node is stopped or paused."""
        while not stop.is_set() and running.is_set():
            await asyncio.sleep(0.1)
        await ws.close()

    async def _recv(self, ws, kind: type[M]) -> M:
        """The next handshake message, which must be a ``kind`` (member lists may come first)."""
        name = kind.__struct_config__.tag
        while True:
            msg = await asyncio.wait_for(ws.receive(), HANDSHAKE_TIMEOUT_S)
            if msg.type != aiohttp.WSMsgType.TEXT:
                raise ConnectionError(f"coordinator closed the connection while we waited for '{name}'")
            data = messages.decode_from_coordinator(msg.data)
            if isinstance(data, messages.Shutdown):
                raise ConnectionError(f"coordinator refused us: {data.reason}")
            if isinstance(data, messages.Members):
                self.on_members(data)
                continue
            if not isinstance(data, kind):
                raise ProtocolViolation(f"expected '{name}', got '{data.__struct_config__.tag}'")
            return data

    def _hello(self, nonce: str, own_nonce: str) -> messages.Hello:
        identity = self.identity
        return messages.Hello(
            peer_id=identity.peer_id, public_key=base64.b64encode(identity.public_key).decode(),
            signature=base64.b64encode(identity.sign(hello_bytes(nonce, identity.public_key))).decode(),
            nonce=own_nonce, **self.hello_fields())

    def _check_coordinator(self, welcome: messages.Welcome, own_nonce: str, challenge_nonce: str) -> None:
        """Raise ``AuthenticationError`` unless the welcome proves the key we pinned (or first saw)."""
        if welcome.coordinator_key is None:
            if self.pinned_key is not None or self.coordinator_key is not None:
                raise AuthenticationError("its welcome names no key, but this node expects one")
            return  # a coordinator without a key (tickets are then not checked)
        try:
            key = base64.b64decode(welcome.coordinator_key, validate=True)
            signature = base64.b64decode(welcome.coordinator_signature or "", validate=True)
        except (ValueError, binascii.Error) as exc:
            raise AuthenticationError("its key or signature is not base64") from exc
        expected = self.pinned_key or self.coordinator_key
        if expected is not None and key != expected:
            raise AuthenticationError("it holds another key than the one this node trusts")
        verify_signature(key, welcome_bytes(own_nonce, challenge_nonce, self.identity.peer_id, key), signature)
        self.coordinator_key = key
