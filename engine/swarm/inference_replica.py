"""A node's part in the weight stream: stage leaders stream, inference replicas follow.

:class:`InferenceReplica` is mixed into :class:`engine.swarm.node.Node` (over its
attributes ``config``, ``identity``, ``rt``, ``compute``, ``spec``, ``members``,
``_pm``, ``_weights_waiter`` and methods ``_send``, ``_send_coordinator``,
``_spawn``, ``_stage_members``, ``_expect_weights``). The state machines are in
``engine.swarm.weight_stream``; this module moves their frames.

* **Leader** (the trainer listed first in an ``apply`` message, the same leader
  that writes stage checkpoints): after each applied step it sends every
  inference replica of its stage a ``wdelta`` (int8 per-row deltas against that
  replica's shadow, with the policy version), or a ``wlead`` when it holds no
  stream for it, and reports ``streamed`` to the coordinator. It serves
  ``weights_req(stream=True)`` by reading weights and version together and
  starting a stream on exactly those weights. One lock orders every snapshot,
  encode and send, so a replica always gets full weights before their deltas.
* **Inference replica** (``NodeConfig.inference_only``): queues inbound
  ``wdelta``/``wlead`` (a few at most; overflow drops the oldest, which the
  sequence check turns into a resync) and handles them in order on one task,
  only while a stage is loaded. A delta is applied on the compute thread
  (``set_weights`` with the new shadow values, so the served weights equal the
  leader's shadow bit for bit, and the version), then ``served`` goes to the
  coordinator. On a leader change, an out-of-sequence delta or a malformed one
  (a strike against its sender) it fetches full weights first.

Every inbound stream message is untrusted: it must come from a trainer of our
stage, name our stage, and pass the follower's checks (names, shapes, dtype,
size cap, finite sums). What it does not know: generation or training jobs,
rewards, the codec's internals.
"""

from __future__ import annotations

import asyncio
import logging
from collections import deque
from typing import Any

from engine.net.errors import NetError, ProtocolViolation
from engine.net.shadow_delta import OutOfSequence
from engine.swarm import tensor_bundle
from engine.swarm.weight_stream import DeltaFrame, StreamFollower, StreamLeader, WeightStreamConfig

log = logging.getLogger(__name__)

#: stream messages an inference replica keeps queued (each holds up to ~1/4 of the stage in bytes)
MAX_PENDING = 4
#: how long an inference replica waits for full weights from its leader
FETCH_TIMEOUT_S = 60.0
#: coordinator messages an inference replica never acts on (it does no training work)
TRAINING_MESSAGES = frozenset({"train_in", "train_out", "apply", "abort", "sync"})


class InferenceReplica:
    """Weight-stream handlers of a node (mixed into ``Node``)."""

    def _init_weight_stream(self, config: WeightStreamConfig | None = None) -> None:
        self.inference_peers: set[str] = set()
        self._stream_leader = StreamLeader(config)
        self._stream_follower = StreamFollower(config)
        self._stream_inbox: deque[tuple[str, dict, bytes]] = deque()
        self._stream_wakeup = asyncio.Event()
        self._stream_loaded = asyncio.Event()
        self._stream_lock = asyncio.Lock()
        self._stream_task: asyncio.Task | None = None
        self.stream_stats = {"deltas_sent": 0, "delta_bytes_sent": 0, "deltas_applied": 0, "full_loads": 0,
                             "resyncs": 0, "dropped": 0}

    @property
    def role(self) -> str:
        """``"inference"`` (generates only, follows a weight stream) or ``"trainer"``."""
        return "inference" if self.config.inference_only else "trainer"

    # ------------------------------------------------------------------ loading hooks
    async def _stream_before_load(self) -> None:
        """A new stage (or new weights) is about to load: stop following the old stream."""
        self._stream_loaded.clear()
        self._stream_inbox.clear()
        if self._stream_task is not None and not self._stream_task.done():
            self._stream_task.cancel()  # a fetch or apply for the old stage must not land on the new one
        await self.compute.run(self._stream_follower.forget)
        async with self._stream_lock:
            self._stream_leader.clear()

    def _stream_after_load(self) -> None:
        self._stream_loaded.set()

    async def _stream_joined(self, source: str, header: dict, weights: dict) -> None:
        """Full weights from ``source`` were just loaded: follow its stream if it started one."""
        if self.role != "inference" or header.get("stream") is None:
            return
        await self.compute.run(self._stream_follower.reset, source, header["stream"], weights, header["version"])
        self.stream_stats["full_loads"] += 1
        checksum = await self.compute.run(self.rt.checksum)
        await self._send_coordinator({"type": "served", "version": header["version"], "checksum": checksum,
                                      "source": source, "full": True})

    # ------------------------------------------------------------------ leader side
    async def _stream_after_step(self, m: dict) -> None:
        """Trainer, after an applied step: if we lead the stage, stream to its inference replicas."""
        me = self.identity.peer_id
        leading = m["replicas"][0] == me
        targets = sorted(set(m.get("inference") or ()) - {me}) if leading else []
        async with self._stream_lock:  # the compute thread may be encoding: change streams only here
            self._stream_leader.retain(targets)  # not leading: drop them all; a later lead starts afresh
            if not targets:
                return
            version, frames = await self.compute.run(self._encode_streams, targets)
            stage = self.spec.stage_index

            async def push(peer: str) -> None:
                frame = frames.get(peer)
                try:
                    if frame is None:
                        await self._send(peer, {"type": "wlead", "stage": stage, "version": version})
                    else:
                        await self._send(peer, {"type": "wdelta", "stage": stage, **frame.header}, frame.payload)
                        self.stream_stats["deltas_sent"] += 1
                        self.stream_stats["delta_bytes_sent"] += len(frame.payload)
                except (NetError, OSError, asyncio.TimeoutError, ValueError) as exc:
                    log.info("could not stream weights to %s: %s", peer, exc)

            await asyncio.gather(*(push(p) for p in targets))
        if frames:
            await self._send_coordinator({"type": "streamed", "version": version,
                                          "streams": [f.report for f in frames.values()]})

    def _encode_streams(self, targets: list[str]) -> tuple[int, dict[str, DeltaFrame]]:
        """Compute thread: one delta per replica we hold a stream for, all from one snapshot."""
        weights, version = self.rt.snapshot()
        frames = {p: self._stream_leader.encode(p, weights, version) for p in targets if self._stream_leader.has(p)}
        return version, frames

    async def _send_stream_weights(self, peer: str) -> None:
        """Serve ``weights_req(stream=True)``: full weights, and a stream starting from exactly them."""
        async with self._stream_lock:
            entries, payload, version, stream_id = await self.compute.run(self._start_stream, peer)
            await self._send(peer, {"type": "weights", "stage": self.spec.stage_index, "version": version,
                                    "config": self.rt.model_config.to_hf_dict(), "tensors": entries,
                                    "stream": stream_id}, payload)
        log.info("sent full weights (version %d) to inference replica %s; stream %d starts", version, peer,
                 stream_id)

    def _start_stream(self, peer: str) -> tuple[list, bytes, int, int]:
        weights, version = self.rt.snapshot()
        stream_id = self._stream_leader.start(peer, weights, version)
        entries, payload = tensor_bundle.pack_arrays(weights)
        return entries, payload, version, stream_id

    # ------------------------------------------------------------------ inference side
    def _on_stream_message(self, sender: str, h: dict, payload: bytes) -> None:
        """Loop: a ``wdelta``/``wlead`` arrived; queue it for the follower task."""
        if self.role != "inference":
            raise ProtocolViolation(f"'{h['type']}' sent to a trainer")
        if len(self._stream_inbox) >= MAX_PENDING:
            self._stream_inbox.popleft()  # the sequence check will ask for full weights
            self.stream_stats["dropped"] += 1
        self._stream_inbox.append((sender, h, payload))
        self._stream_wakeup.set()
        if self._stream_task is None or self._stream_task.done():
            self._stream_task = self._spawn(self._stream_follow(), "polis-wstream-follow")

    async def _stream_follow(self) -> None:
        while True:
            if not self._stream_inbox:
                self._stream_wakeup.clear()
                await self._stream_wakeup.wait()
                continue
            await self._stream_loaded.wait()
            if not self._stream_inbox:
                continue
            sender, h, payload = self._stream_inbox.popleft()
            try:
                await self._stream_handle(sender, h, payload)
            except asyncio.CancelledError:
                raise
            except (NetError, OSError, asyncio.TimeoutError, ValueError, RuntimeError) as exc:
                log.warning("weight stream from %s: %s", sender, exc)

    def _strike(self, peer: str, reason: str) -> None:
        log.warning("weight stream from %s refused: %s", peer, reason)
        link = self._pm.link(peer) if self._pm is not None else None
        if link is not None:
            link.report_violation(reason)

    async def _stream_handle(self, sender: str, h: dict, payload: bytes) -> None:
        if self.spec is None or self.rt.backend is None:
            return
        if h["stage"] != self.spec.stage_index or sender not in self._stage_members() \
                or sender in self.inference_peers:
            self._strike(sender, f"'{h['type']}' for stage {h['stage']} from a peer that does not train "
                                 f"stage {self.spec.stage_index}")
            return
        action = self._stream_follower.decide(sender, h["type"], h["version"], h.get("stream"))
        if action == StreamFollower.IGNORE:
            return
        if action == StreamFollower.APPLY:
            try:
                version, checksum = await self.compute.run(self._apply_stream_delta, h, payload)
            except OutOfSequence as exc:
                log.info("weight stream from %s out of sequence (%s); fetching full weights", sender, exc)
            except ProtocolViolation as exc:
                self._strike(sender, f"bad weight delta: {exc}")
            else:
                self.stream_stats["deltas_applied"] += 1
                await self._send_coordinator({"type": "served", "version": version, "checksum": checksum,
                                              "source": sender, "full": False})
                self._emit_status()
                return
        await self._stream_fetch(sender)

    def _apply_stream_delta(self, h: dict, payload: bytes) -> tuple[int, float]:
        """Compute thread: the delta to the shadow, the new values into the backend, the new version."""
        updated = self._stream_follower.apply(h["delta"], payload, h["version"])
        try:
            self.rt.set_weights(updated, h["version"])
        except Exception:
            self._stream_follower.forget()  # backend and shadow may now disagree: full weights next
            raise
        return self.rt.version, self.rt.checksum()

    async def _stream_fetch(self, source: str) -> None:
        """Full weights from ``source`` with a fresh stream; both shadows restart from them."""
        if self._weights_waiter is not None and not self._weights_waiter.done():
            return  # a load is in flight already
        self.stream_stats["resyncs"] += 1
        waiter = self._expect_weights(source)
        try:
            await self._send(source, {"type": "weights_req", "stage": self.spec.stage_index, "stream": True})
            # asyncio.wait, not wait_for: on 3.10/3.11 wait_for can swallow a cancellation that
            # races with the answer, and this task must stop when the node stops
            await asyncio.wait({waiter}, timeout=FETCH_TIMEOUT_S)
        finally:
            if not waiter.done():
                waiter.cancel()  # never leave a pending waiter behind: it would block later fetches
        if waiter.cancelled():
            raise asyncio.TimeoutError(f"no weights from {source} in {FETCH_TIMEOUT_S:.0f} s")
        header, payload, _ = waiter.result()
        if header.get("stream") is None or header["stage"] != self.spec.stage_index:
            self._strike(source, "weights without a stream, or of another stage")
            return
        version, checksum = await self.compute.run(self._reset_stream_from, source, header, payload)
        self.stream_stats["full_loads"] += 1
        log.info("inference replica: full weights of stage %d (version %d) from %s, stream %d",
                 self.spec.stage_index, version, source, header["stream"])
        await self._send_coordinator({"type": "served", "version": version, "checksum": checksum,
                                      "source": source, "full": True})
        self._emit_status()

    def _reset_stream_from(self, source: str, header: dict, payload: Any) -> tuple[int, float]:
        """Compute thread: install full weights and follow ``source``'s stream from exactly them."""
        weights = tensor_bundle.unpack(header["tensors"], payload, self.rt.shapes(), require_all=True)
        self.rt.set_weights(weights, header["version"])
        self._stream_follower.reset(source, header["stream"], weights, header["version"])
        return self.rt.version, self.rt.checksum()

