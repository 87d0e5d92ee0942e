"""A scriptable Polis peer process for integration tests (built on engine.net.echo_peer).

Run as ``python -m tests.support.loopback_peer --signalling ws://127.0.0.1:PORT/signal``
(:class:`PeerProcess` does). Like the echo peer it serves every link (``ping`` ->
``pong``, ``tensor`` -> ``tensor_ack``, ``blob`` -> ``blob_ack``), and it obeys JSON
commands, one per line, on stdin, answering with JSON events on stdout::

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
"""

from __future__ import annotations

import asyncio
import hashlib
import json
import random
import sys
import time
from typing import Any

import numpy as np

from engine.net import echo_peer
from engine.net.echo_peer import Blob, BlobAck, Ping, Pong, TensorAck, TensorMessage, emit_line, make_tensor
from engine.net.errors import LinkClosed, NetError
from engine.net.peer_link import PeerLink
from engine.net.peer_manager import PeerManager
from engine.net.tensor_codec import encode_tensor
from tests.support.frame_fuzz import hostile_frame

__all__ = ["PeerProcess", "make_tensor"]


class PeerProcess(echo_peer.PeerProcess):
    """The parent-side handle, starting this module as the child."""

    def __init__(self, signalling_url: str, **kwargs: Any) -> None:
        super().__init__(signalling_url, module="tests.support.loopback_peer", **kwargs)


class LoopbackPeer:
    """The peer's behaviour; :func:`echo_peer.run_child` wires it to stdin/stdout."""

    def __init__(self, manager: PeerManager) -> None:
        self.manager = manager
        self.emit = emit_line
        self._waiters: dict[tuple[type, int], asyncio.Future] = {}
        self._next_id = 0
        self._tasks: set[asyncio.Task] = set()

    def _spawn(self, coro, name: str) -> None:
        task = asyncio.get_running_loop().create_task(coro, name=name)
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    def on_link(self, link: PeerLink) -> None:
        self.emit({"event": "link_opened", "peer": link.peer_id})
        link.add_close_callback(lambda closed: self.emit({"event": "link_closed", "peer": closed.peer_id,
                                                     "reason": closed.closed_reason}))
        self._spawn(echo_peer.serve_link(link, self._on_reply), f"polis-loopback-serve-{link.peer_id}")

    def _on_reply(self, header: Any, payload: bytes) -> None:
        waiter = self._waiters.pop((type(header), getattr(header, "id", -1)), None)
        if waiter is not None and not waiter.done():
            waiter.set_result((header, payload))

    async def _request(self, link: PeerLink, make: Any, payload: Any, reply_type: type,
                       channel: str = "control", timeout_s: float = 120.0) -> tuple[Any, bytes]:
        self._next_id += 1
        msg_id = self._next_id
        fut = asyncio.get_running_loop().create_future()
        self._waiters[(reply_type, msg_id)] = fut
        try:
            await link.send(make(msg_id), payload, channel=channel)
            return await asyncio.wait_for(fut, timeout_s)
        finally:
            self._waiters.pop((reply_type, msg_id), None)

    async def handle(self, line: str) -> bool:
        try:
            cmd = json.loads(line)
        except ValueError:
            self.emit({"event": "error", "error": "command is not JSON"})
            return True
        if not isinstance(cmd, dict):
            return True
        self._spawn(self._run(cmd), f"polis-loopback-{cmd.get('cmd')}")
        return True

    async def _run(self, cmd: dict) -> None:
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
        encoded = encode_tensor(array, cmd.get("encoding", "fp32"))
        link = await self.manager.ensure_link(cmd["peer"])
        start = time.perf_counter()
        reply, _ = await self._request(link, lambda i: TensorMessage(id=i, tensor=encoded.header), encoded.payload,
                                       TensorAck, "bulk")
        seconds = time.perf_counter() - start
        sent = hashlib.sha256(array.tobytes()).hexdigest()
        self.emit({"event": "tensor_sent", "ok": reply.sha256 == sent, "sha256": sent,
                   "remote_sha256": reply.sha256, "remote_error": reply.error, "seconds": seconds,
                   "bytes": len(encoded.payload)})

    async def cmd_send_blob(self, cmd: dict) -> None:
        payload = np.random.default_rng(1).integers(0, 256, int(cmd["bytes"]), dtype=np.uint8).tobytes()
        link = await self.manager.ensure_link(cmd["peer"])
        start = time.perf_counter()
        reply, _ = await self._request(link, lambda i: Blob(id=i), payload, BlobAck, "bulk")
        seconds = time.perf_counter() - start
        self.emit({"event": "blob_sent", "ok": reply.sha256 == hashlib.sha256(payload).hexdigest(),
                   "seconds": seconds, "bytes": len(payload)})

    async def cmd_ping(self, cmd: dict) -> None:
        link = await self.manager.ensure_link(cmd["peer"])
        payload = b"p" * int(cmd.get("payload_bytes", 64))
        rtts = []
        for _ in range(int(cmd.get("count", 50))):
            start = time.perf_counter()
            await self._request(link, lambda i: Ping(id=i), payload, Pong, timeout_s=10.0)
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
        links = {peer: link.stats.as_dict() for peer, link in self.manager._links.items()}
        self.emit({"event": "stats", "links": links,
                   "banned": sorted(p for p in self.manager._banned_until if self.manager.is_banned(p))})

    async def close(self) -> None:
        for task in list(self._tasks):
            task.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)


if __name__ == "__main__":
    sys.exit(echo_peer.child_main(__doc__.splitlines()[0], LoopbackPeer))
