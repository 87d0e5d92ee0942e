"""A scriptable Polis peer process, for integration tests and transport benches.

Run as ``python -m engine.net.loopback_peer --signalling ws://127.0.0.1:PORT/signal``.
It makes a throw-away identity, registers, accepts links, serves every link
(``ping`` -> ``pong``, ``tensor`` -> ``tensor_ack`` with the sha256 of the decoded
array, ``blob`` -> ``blob_ack``), and obeys JSON commands, one per line, on stdin.
It answers with JSON events, one per line, on stdout; the first is
``{"event": "ready", "peer_id": ...}``.

Commands (``peer`` is a peer id)::

    {"cmd": "dial", "peer": P}                       -> dialed {ok, error_type, error}
    {"cmd": "send_tensor", "peer": P, "elements": N, "seed": S, "encoding": "fp32"}
                                                     -> tensor_sent {ok, sha256, remote_sha256, seconds, bytes}
    {"cmd": "send_blob", "peer": P, "bytes": N}      -> blob_sent {ok, seconds, bytes}
    {"cmd": "ping", "peer": P, "count": N, "payload_bytes": B} -> pinged {rtt_ms: [...]}
    {"cmd": "fuzz", "peer": P, "frames": N, "seed": S} -> fuzzed {sent, link_closed}
    {"cmd": "wait_closed", "peer": P, "timeout_s": T} -> wait_closed {closed, reason}
    {"cmd": "stats"}                                 -> stats {links: {P: {...}}, banned: [...]}
    {"cmd": "quit"}

Unsolicited events: ``link_opened``, ``link_closed`` (with the reason), ``error``.
Every inbound message header is checked by :data:`LOOPBACK_SCHEMAS`.
"""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import hashlib
import json
import logging
import random
import sys
import threading
import time
from typing import Any

import numpy as np

from engine.net.errors import LinkClosed, NetError, ProtocolViolation
from engine.net.frame_fuzz import hostile_frame
from engine.net.identity import Identity
from engine.net.peer_link import LinkConfig, PeerLink
from engine.net.peer_manager import PeerManager, PeerManagerConfig
from engine.net.schema import Any_, Int, Schema, SchemaRegistry, Str
from engine.net.signalling_client import SignallingClient

log = logging.getLogger(__name__)

_ID = Int(0, 2**53)
_SHA = Str(64, 64)
LOOPBACK_SCHEMAS = SchemaRegistry([
    Schema("ping", {"id": _ID}),
    Schema("pong", {"id": _ID}),
    Schema("tensor", {"id": _ID, "tensor": Any_()}),  # the tensor header is checked by decode_tensor
    Schema("tensor_ack", {"id": _ID, "sha256": Str(0, 64), "error": Str(0, 300)}),
    Schema("blob", {"id": _ID}),
    Schema("blob_ack", {"id": _ID, "sha256": _SHA}),
])


def make_tensor(elements: int, seed: int) -> np.ndarray:
    """The float32 test tensor both ends can rebuild from (elements, seed)."""
    return np.random.default_rng(seed).standard_normal(elements, dtype=np.float32)


def encode_for_wire(array: np.ndarray, encoding: str) -> tuple[dict, bytes]:
    """(tensor header, payload) with the project codec when present, else raw float32 bytes."""
    try:
        from engine.net.tensor_codec import encode_tensor
    except ImportError:
        return {"dtype": "float32", "shape": list(array.shape), "encoding": "raw-fallback"}, array.tobytes()
    encoded = encode_tensor(array, encoding)
    return encoded.header, encoded.payload


def decode_from_wire(header: Any, payload: bytes, max_elements: int) -> np.ndarray:
    try:
        from engine.net.tensor_codec import decode_tensor
    except ImportError:
        if not isinstance(header, dict) or header.get("encoding") != "raw-fallback":
            raise ProtocolViolation("unknown tensor header")
        if len(payload) % 4 or len(payload) // 4 > max_elements:
            raise ProtocolViolation("bad raw tensor payload")
        return np.frombuffer(payload, dtype=np.float32)
    return decode_tensor(header, payload, max_elements=max_elements)


class LoopbackPeer:
    """The peer's behaviour; :func:`main` wires it to stdin/stdout."""

    def __init__(self, manager: PeerManager, emit) -> None:
        self.manager = manager
        self.emit = emit
        self._waiters: dict[tuple[str, int], asyncio.Future] = {}
        self._next_id = 0
        self._tasks: set[asyncio.Task] = set()
        manager.on_link = self._on_link

    def _spawn(self, coro, name: str) -> None:
        task = asyncio.get_running_loop().create_task(coro, name=name)
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    def _on_link(self, link: PeerLink) -> None:
        self.emit({"event": "link_opened", "peer": link.peer_id})
        link.add_close_callback(lambda l: self.emit({"event": "link_closed", "peer": l.peer_id,
                                                     "reason": l.closed_reason}))
        self._spawn(self._serve(link), f"polis-loopback-serve-{link.peer_id}")

    async def _serve(self, link: PeerLink) -> None:
        async for header, payload in link:
            kind, msg_id = header["type"], header["id"]
            try:
                if kind == "ping":
                    await link.send({"type": "pong", "id": msg_id}, payload)
                elif kind == "blob":
                    digest = hashlib.sha256(payload).hexdigest()
                    await link.send({"type": "blob_ack", "id": msg_id, "sha256": digest})
                elif kind == "tensor":
                    try:
                        array = decode_from_wire(header["tensor"], payload, max_elements=1 << 26)
                        reply = {"sha256": hashlib.sha256(np.ascontiguousarray(array).tobytes()).hexdigest(),
                                 "error": ""}
                    except ProtocolViolation as exc:
                        reply = {"sha256": "", "error": str(exc)[:300]}
                    await link.send({"type": "tensor_ack", "id": msg_id, **reply})
                else:
                    waiter = self._waiters.pop((kind, msg_id), None)
                    if waiter is not None and not waiter.done():
                        waiter.set_result((header, payload))
            except LinkClosed:
                return

    async def _request(self, link: PeerLink, header: dict, payload: Any, reply_type: str,
                       channel: str = "control", timeout_s: float = 120.0) -> tuple[dict, bytes]:
        self._next_id += 1
        msg_id = self._next_id
        fut = asyncio.get_running_loop().create_future()
        self._waiters[(reply_type, msg_id)] = fut
        try:
            await link.send({**header, "id": msg_id}, payload, channel=channel)
            return await asyncio.wait_for(fut, timeout_s)
        finally:
            self._waiters.pop((reply_type, msg_id), None)

    async def handle(self, cmd: dict) -> None:
        name = cmd.get("cmd")
        try:
            await getattr(self, f"cmd_{name}")(cmd)
        except (NetError, asyncio.TimeoutError, KeyError, ValueError, AttributeError) as exc:
            self.emit({"event": "error", "cmd": name, "error_type": type(exc).__name__, "error": str(exc)})

    async def cmd_dial(self, cmd: dict) -> None:
        try:
            await self.manager.connect(cmd["peer"], cmd.get("timeout_s"))
            self.emit({"event": "dialed", "peer": cmd["peer"], "ok": True, "error_type": None, "error": None})
        except (NetError, asyncio.TimeoutError) as exc:
            self.emit({"event": "dialed", "peer": cmd["peer"], "ok": False, "error_type": type(exc).__name__,
                       "error": str(exc)})

    async def cmd_send_tensor(self, cmd: dict) -> None:
        array = make_tensor(int(cmd["elements"]), int(cmd.get("seed", 0)))
        header, payload = encode_for_wire(array, cmd.get("encoding", "fp32"))
        link = await self.manager.ensure_link(cmd["peer"])
        start = time.perf_counter()
        reply, _ = await self._request(link, {"type": "tensor", "tensor": header}, payload, "tensor_ack", "bulk")
        seconds = time.perf_counter() - start
        sent = hashlib.sha256(array.tobytes()).hexdigest()
        self.emit({"event": "tensor_sent", "ok": reply["sha256"] == sent, "sha256": sent,
                   "remote_sha256": reply["sha256"], "remote_error": reply["error"], "seconds": seconds,
                   "bytes": len(payload)})

    async def cmd_send_blob(self, cmd: dict) -> None:
        payload = np.random.default_rng(1).integers(0, 256, int(cmd["bytes"]), dtype=np.uint8).tobytes()
        link = await self.manager.ensure_link(cmd["peer"])
        start = time.perf_counter()
        reply, _ = await self._request(link, {"type": "blob"}, payload, "blob_ack", "bulk")
        seconds = time.perf_counter() - start
        self.emit({"event": "blob_sent", "ok": reply["sha256"] == hashlib.sha256(payload).hexdigest(),
                   "seconds": seconds, "bytes": len(payload)})

    async def cmd_ping(self, cmd: dict) -> None:
        link = await self.manager.ensure_link(cmd["peer"])
        payload = b"p" * int(cmd.get("payload_bytes", 64))
        rtts = []
        for _ in range(int(cmd.get("count", 50))):
            start = time.perf_counter()
            await self._request(link, {"type": "ping"}, payload, "pong", timeout_s=10.0)
            rtts.append((time.perf_counter() - start) * 1000.0)
        self.emit({"event": "pinged", "rtt_ms": rtts})

    async def cmd_fuzz(self, cmd: dict) -> None:
        link = self.manager.link(cmd["peer"])
        if link is None:
            raise LinkClosed(f"no link to {cmd['peer']}")
        rng = random.Random(int(cmd.get("seed", 0)))
        sent = 0
        for _ in range(int(cmd["frames"])):
            try:
                await link._send_raw_frame(hostile_frame(rng, link.config.limits),
                                           rng.choice(["control", "bulk"]))
            except LinkClosed:
                break
            sent += 1
        self.emit({"event": "fuzzed", "sent": sent, "link_closed": link.closed})

    async def cmd_wait_closed(self, cmd: dict) -> None:
        link = self.manager._links.get(cmd["peer"])
        if link is not None:
            try:
                await asyncio.wait_for(link.wait_closed(), float(cmd.get("timeout_s", 10.0)))
            except asyncio.TimeoutError:
                pass
        self.emit({"event": "wait_closed", "closed": link is None or link.closed,
                   "reason": None if link is None else link.closed_reason})

    async def cmd_stats(self, cmd: dict) -> None:
        self.emit({"event": "stats", "links": {p: l.stats.as_dict() for p, l in self.manager._links.items()},
                   "banned": sorted(p for p in self.manager._banned_until if self.manager.is_banned(p))})

    async def close(self) -> None:
        for task in list(self._tasks):
            task.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)


def _stdin_lines(loop: asyncio.AbstractEventLoop, queue: asyncio.Queue) -> None:
    for line in sys.stdin:
        loop.call_soon_threadsafe(queue.put_nowait, line)
    loop.call_soon_threadsafe(queue.put_nowait, None)


async def run_peer(signalling_url: str, max_strikes: int, socket_buffer_bytes: int | None = None) -> None:
    def emit(event: dict) -> None:
        sys.stdout.write(json.dumps(event) + "\n")
        sys.stdout.flush()

    client = SignallingClient(signalling_url, Identity.generate())
    await client.connect()
    link_config = LinkConfig(max_strikes=max_strikes)
    if socket_buffer_bytes is not None:
        link_config = dataclasses.replace(link_config, socket_buffer_bytes=socket_buffer_bytes)
    manager = PeerManager(client, PeerManagerConfig(link=link_config),
                          validator=LOOPBACK_SCHEMAS.validate)
    peer = LoopbackPeer(manager, emit)
    queue: asyncio.Queue = asyncio.Queue()
    threading.Thread(target=_stdin_lines, args=(asyncio.get_running_loop(), queue), daemon=True,
                     name="polis-loopback-stdin").start()
    emit({"event": "ready", "peer_id": client.peer_id})
    commands: set[asyncio.Task] = set()
    try:
        while True:
            line = await queue.get()
            if line is None:
                break
            try:
                cmd = json.loads(line)
            except ValueError:
                emit({"event": "error", "error": "command is not JSON"})
                continue
            if not isinstance(cmd, dict):
                continue
            if cmd.get("cmd") == "quit":
                break
            task = asyncio.get_running_loop().create_task(peer.handle(cmd), name=f"polis-loopback-{cmd.get('cmd')}")
            commands.add(task)
            task.add_done_callback(commands.discard)
    finally:
        for task in list(commands):
            task.cancel()
        await peer.close()
        await manager.close()
        await client.close()


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--signalling", required=True, help="signalling websocket URL")
    parser.add_argument("--max-strikes", type=int, default=16, help="protocol violations tolerated per link")
    parser.add_argument("--socket-buffer-bytes", type=int, default=None, help="UDP buffer size (default: LinkConfig's)")
    parser.add_argument("--log-level", default="WARNING")
    args = parser.parse_args(argv)
    logging.basicConfig(level=args.log_level, stream=sys.stderr,
                        format="%(asctime)s loopback-peer %(levelname)s %(name)s: %(message)s")
    asyncio.run(run_peer(args.signalling, args.max_strikes, args.socket_buffer_bytes))
    return 0


if __name__ == "__main__":
    sys.exit(main())


class PeerProcess:
    """Parent-side handle of a loopback peer child process (async context manager).

    ``await proc.command({...}, "event_name")`` sends a command and returns the
    next event of that name; unsolicited events are kept in :attr:`events`.
    """

    def __init__(self, signalling_url: str, *, max_strikes: int = 16, log_level: str = "WARNING",
                 socket_buffer_bytes: int | None = None, python: str | None = None) -> None:
        self.argv = [python or sys.executable, "-m", "engine.net.loopback_peer", "--signalling", signalling_url,
                     "--max-strikes", str(max_strikes), "--log-level", log_level]
        if socket_buffer_bytes is not None:
            self.argv += ["--socket-buffer-bytes", str(socket_buffer_bytes)]
        self.proc: asyncio.subprocess.Process | None = None
        self.peer_id = ""
        self.events: list[dict] = []
        self._arrived = asyncio.Event()
        self._reader: asyncio.Task | None = None

    async def __aenter__(self) -> "PeerProcess":
        import os
        from pathlib import Path

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
