"""The far end of the two-process transport measurements: a peer process that acknowledges.

``polis bench transport`` (through :mod:`engine.net.measure`) times real links
between this process and a child: ``python -m engine.net.echo_peer --signalling
ws://127.0.0.1:PORT/signal`` makes a throw-away identity, registers, accepts links
and serves each one: ``ping`` -> ``pong`` (payload echoed), ``tensor`` ->
``tensor_ack`` with the sha256 of the array it decoded (``engine.net.tensor_codec``),
``blob`` -> ``blob_ack`` with the sha256 of the payload. Its first stdout line is
``{"event": "ready", "peer_id": ...}``; a line ``quit`` or the end of stdin stops it.

Every inbound header is decoded into :data:`EchoMessage` (typed, bounded) before
use. :class:`PeerProcess` is the parent-side handle. It lives in ``engine.net``
because :mod:`engine.net.measure` (which must, being the one aiortc-level bench)
starts it; it knows nothing of swarms, and it has no test commands (the scriptable
test peer in ``tests/support/loopback_peer.py`` builds on it).
"""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import hashlib
import json
import logging
import os
import sys
import threading
import time
from pathlib import Path
from typing import Annotated, Any, Callable, Union

import numpy as np
from msgspec import Meta

from engine.net.errors import LinkClosed, ProtocolViolation
from engine.net.peer_link import LinkConfig, PeerLink
from engine.net.wire import MessageSet, WireMessage

log = logging.getLogger(__name__)

MessageId = Annotated[int, Meta(ge=0, le=2**53)]
Sha256Hex = Annotated[str, Meta(max_length=64)]
#: most elements of a tensor the echo peer decodes
MAX_ELEMENTS = 1 << 26


class Ping(WireMessage, frozen=True, tag="ping"):
    id: MessageId  # echoed in the pong


class Pong(WireMessage, frozen=True, tag="pong"):
    id: MessageId  # the ping's id


class TensorMessage(WireMessage, frozen=True, tag="tensor"):
    id: MessageId  # echoed in the ack
    tensor: Annotated[dict[str, Any], Meta(max_length=16)]  # tensor_codec header, checked by decode_tensor


class TensorAck(WireMessage, frozen=True, tag="tensor_ack"):
    id: MessageId  # the tensor's id
    sha256: Sha256Hex  # of the decoded array's bytes ("" if it did not decode)
    error: Annotated[str, Meta(max_length=300)]  # why it did not decode ("" if it did)


class Blob(WireMessage, frozen=True, tag="blob"):
    id: MessageId  # echoed in the ack


class BlobAck(WireMessage, frozen=True, tag="blob_ack"):
    id: MessageId  # the blob's id
    sha256: Annotated[str, Meta(min_length=64, max_length=64)]  # of the payload


EchoMessage = Union[Ping, Pong, TensorMessage, TensorAck, Blob, BlobAck]
ECHO_MESSAGES: MessageSet[EchoMessage] = MessageSet("echo", EchoMessage, max_size=64 * 1024)


def make_tensor(elements: int, seed: int) -> np.ndarray:
    """The float32 test tensor both ends can rebuild from (elements, seed)."""
    return np.random.default_rng(seed).standard_normal(elements, dtype=np.float32)


def tensor_ack(message: TensorMessage, payload: bytes) -> TensorAck:
    """Decode a tensor message's array; the ack carries its sha256 or why it did not decode."""
    from engine.net.tensor_codec import decode_tensor

    try:
        array = decode_tensor(message.tensor, payload, max_elements=MAX_ELEMENTS)
    except ProtocolViolation as exc:
        return TensorAck(id=message.id, sha256="", error=str(exc)[:300])
    digest = hashlib.sha256(np.ascontiguousarray(array).tobytes()).hexdigest()
    return TensorAck(id=message.id, sha256=digest, error="")


async def serve_link(link: PeerLink, on_reply: Callable[[Any, bytes], None] | None = None) -> None:
    """Answer pings, tensors and blobs on ``link`` until it closes; replies to our own
    requests (pong, tensor_ack, blob_ack) go to ``on_reply``."""
    async for header, payload in link:
        try:
            if isinstance(header, Ping):
                await link.send(Pong(id=header.id), payload)
            elif isinstance(header, Blob):
                await link.send(BlobAck(id=header.id, sha256=hashlib.sha256(payload).hexdigest()))
            elif isinstance(header, TensorMessage):
                await link.send(tensor_ack(header, payload))
            elif on_reply is not None:
                on_reply(header, payload)
        except LinkClosed:
            return


def _stdin_lines(loop: asyncio.AbstractEventLoop, queue: asyncio.Queue) -> None:
    for line in sys.stdin:
        loop.call_soon_threadsafe(queue.put_nowait, line)
    loop.call_soon_threadsafe(queue.put_nowait, None)


def emit_line(event: dict) -> None:
    """One JSON event line on stdout (the parent reads them)."""
    sys.stdout.write(json.dumps(event) + "\n")
    sys.stdout.flush()


def _is_quit(line: str) -> bool:
    try:
        cmd = json.loads(line)
    except ValueError:
        return line.strip() == "quit"
    return isinstance(cmd, dict) and cmd.get("cmd") == "quit"


async def run_child(signalling_url: str, max_strikes: int, socket_buffer_bytes: int | None,
                    make_handler: Callable[[Any], Any] | None = None) -> None:
    """Register, accept links, serve them; read stdin lines until EOF or ``quit``.

    ``make_handler(manager)`` may return an object with ``on_link(link)``, ``handle(line)``
    (returns False to stop) and ``close()`` (the scriptable test peer does); by default
    every link is served by :func:`serve_link`.
    """
    from engine.net.identity import Identity
    from engine.net.peer_manager import PeerManager, PeerManagerConfig
    from engine.net.signalling_client import SignallingClient

    client = SignallingClient(signalling_url, Identity.generate())
    await client.connect()
    link_config = LinkConfig(max_strikes=max_strikes)
    if socket_buffer_bytes is not None:
        link_config = dataclasses.replace(link_config, socket_buffer_bytes=socket_buffer_bytes)
    manager = PeerManager(client, PeerManagerConfig(link=link_config), validator=ECHO_MESSAGES.convert)
    handler = make_handler(manager) if make_handler is not None else None
    tasks: set[asyncio.Task] = set()

    def spawn(coro, name: str) -> None:
        task = asyncio.get_running_loop().create_task(coro, name=name)
        tasks.add(task)
        task.add_done_callback(tasks.discard)

    if handler is None:
        manager.on_link = lambda link: spawn(serve_link(link), f"polis-echo-serve-{link.peer_id}")
    else:
        manager.on_link = handler.on_link
    queue: asyncio.Queue = asyncio.Queue(maxsize=1024)
    threading.Thread(target=_stdin_lines, args=(asyncio.get_running_loop(), queue), daemon=True,
                     name="polis-echo-stdin").start()
    emit_line({"event": "ready", "peer_id": client.peer_id})
    try:
        while True:
            line = await queue.get()
            if line is None or _is_quit(line):
                break
            if handler is not None and not await handler.handle(line):
                break
    finally:
        for task in list(tasks):
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        if handler is not None:
            await handler.close()
        await manager.close()
        await client.close()


def child_main(description: str, make_handler: Callable[[Any], Any] | None = None,
               argv: list[str] | None = None) -> int:
    """The command line of a child peer process (this module's, or the test peer's)."""
    parser = argparse.ArgumentParser(description=description)
    parser.add_argument("--signalling", required=True, help="signalling websocket URL")
    parser.add_argument("--max-strikes", type=int, default=16, help="protocol violations tolerated per link")
    parser.add_argument("--socket-buffer-bytes", type=int, default=None, help="UDP buffer size (default: LinkConfig's)")
    parser.add_argument("--log-level", default="WARNING")
    args = parser.parse_args(argv)
    logging.basicConfig(level=args.log_level, stream=sys.stderr,
                        format="%(asctime)s peer-process %(levelname)s %(name)s: %(message)s")
    asyncio.run(run_child(args.signalling, args.max_strikes, args.socket_buffer_bytes, make_handler=make_handler))
    return 0


class PeerProcess:
    """Parent-side handle of a child peer process (async context manager).

    ``module`` is the child's ``python -m`` module (this one by default).
    ``await proc.command({...}, "event_name")`` sends a command line and returns the
    next event of that name; unsolicited events are kept in :attr:`events`.
    """

    def __init__(self, signalling_url: str, *, max_strikes: int = 16, log_level: str = "WARNING",
                 socket_buffer_bytes: int | None = None, python: str | None = None,
                 module: str = "engine.net.echo_peer") -> None:
        self.argv = [python or sys.executable, "-m", module, "--signalling", signalling_url,
                     "--max-strikes", str(max_strikes), "--log-level", log_level]
        if socket_buffer_bytes is not None:
            self.argv += ["--socket-buffer-bytes", str(socket_buffer_bytes)]
        self.proc: asyncio.subprocess.Process | None = None
        self.peer_id = ""
        self.events: list[dict] = []
        self._arrived = asyncio.Event()
        self._reader: asyncio.Task | None = None

    async def __aenter__(self) -> "PeerProcess":
        root = str(Path(__file__).resolve().parents[2])
        env = {**os.environ, "PYTHONPATH": root + os.pathsep + os.environ.get("PYTHONPATH", "")}
        self.proc = await asyncio.create_subprocess_exec(
            *self.argv, stdin=asyncio.subprocess.PIPE, stdout=asyncio.subprocess.PIPE, env=env, cwd=root,
            limit=16 * 1024 * 1024)
        self._reader = asyncio.get_running_loop().create_task(self._read(), name="polis-peer-process-reader")
        ready = await self.wait_for("ready", 60.0)
        self.peer_id = ready["peer_id"]
        return self

    async def _read(self) -> None:
        assert self.proc is not None and self.proc.stdout is not None
        while True:
            line = await self.proc.stdout.readline()
            if not line:
                self.events.append({"event": "exited"})
                self._arrived.set()
                return
            try:
                self.events.append(json.loads(line))
            except ValueError:
                continue
            self._arrived.set()

    async def wait_for(self, name: str, timeout_s: float = 60.0, *, error_for: str | None = None,
                       **match: Any) -> dict:
        """Remove and return the first event called ``name`` (whose fields equal ``match``).

        With ``error_for``, an ``error`` event of that command raises RuntimeError instead.
        """
        deadline = time.monotonic() + timeout_s
        while True:
            for i, event in enumerate(self.events):
                if event.get("event") == name and all(event.get(k) == v for k, v in match.items()):
                    return self.events.pop(i)
                if error_for is not None and event.get("event") == "error" and event.get("cmd") == error_for:
                    self.events.pop(i)
                    raise RuntimeError(f"peer process: {error_for} failed: {event.get('error_type')}: "
                                       f"{event.get('error')}")
                if event.get("event") == "exited" and name != "exited":
                    raise LinkClosed(f"peer process exited while waiting for {name!r}")
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                raise asyncio.TimeoutError(f"no {name!r} event within {timeout_s} s; events: {self.events[-5:]}")
            self._arrived.clear()
            try:
                await asyncio.wait_for(self._arrived.wait(), remaining)
            except asyncio.TimeoutError:
                pass

    async def send(self, cmd: dict) -> None:
        assert self.proc is not None and self.proc.stdin is not None
        self.proc.stdin.write((json.dumps(cmd) + "\n").encode())
        await self.proc.stdin.drain()

    async def command(self, cmd: dict, reply: str, timeout_s: float = 120.0) -> dict:
        """Send ``cmd`` and return its ``reply`` event (RuntimeError if the command failed)."""
        await self.send(cmd)
        return await self.wait_for(reply, timeout_s, error_for=cmd.get("cmd"))

    @property
    def running(self) -> bool:
        return self.proc is not None and self.proc.returncode is None

    async def __aexit__(self, *exc_info: Any) -> None:
        if self.proc is None:
            return
        if self.proc.returncode is None:
            try:
                await self.send({"cmd": "quit"})
                await asyncio.wait_for(self.proc.wait(), 10.0)
            except (asyncio.TimeoutError, ConnectionError, BrokenPipeError):
                self.proc.kill()
                await self.proc.wait()
        if self._reader is not None:
            self._reader.cancel()


if __name__ == "__main__":
    sys.exit(child_main(__doc__.splitlines()[0]))
