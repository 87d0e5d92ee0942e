"""A trainer's part in the weight stream: as its stage's leader, stream weights to inference replicas.

The leader is the trainer an ``apply`` message names as ``leader`` (the
coordinator chooses it by the replicas' weight votes, ``engine.swarm.weight_votes``;
never by peer id). After each applied step it sends every
inference replica of its stage a ``wdelta`` (int8 per-row deltas against that
replica's shadow, with the policy version), or a ``wlead`` when it holds no
stream for it, and reports ``streamed`` to the coordinator. It serves
``weights_req(stream=True)`` by reading weights and version together and
starting a stream on exactly those weights. One lock orders every snapshot,
encode and send, so a replica always gets full weights before their deltas.
A trainer that stops leading drops its streams; a later lead starts afresh.

The state machine is ``engine.swarm.weight_stream.StreamLeader``; this module
moves its frames. What it does not know: the follower side, training, rewards.
"""

from __future__ import annotations

import asyncio
import logging

from engine.net.errors import NetError, ProtocolViolation
from engine.swarm import messages, tensor_bundle
from engine.swarm.messages import Apply, WDelta, Weights, WeightsReq, WLead
from engine.swarm.node_context import NodeContext
from engine.swarm.weight_stream import DeltaFrame, StreamLeader, WeightStreamConfig

log = logging.getLogger(__name__)


class WeightStreamLeader:
    """Streams of one trainer to the inference replicas of its stage."""

    def __init__(self, ctx: NodeContext, config: WeightStreamConfig | None = None) -> None:
        self.ctx = ctx
        self.state = StreamLeader(config)
        self._lock = asyncio.Lock()
        self.stats = {"deltas_sent": 0, "delta_bytes_sent": 0}

    async def clear(self) -> None:
        """A new stage (or new weights) is about to load: every stream starts over."""
        async with self._lock:
            self.state.clear()

    # ------------------------------------------------------------------ inbound (loop, no await)
    def on_stream_request(self, sender: str, header: WeightsReq, payload: bytes) -> None:
        """``weights_req(stream=True)``: only an inference replica may follow a trainer's stream."""
        if self.ctx.role != "trainer" or sender not in self.ctx.membership.inference:
            raise ProtocolViolation(f"a weight stream asked by {sender}, not an inference replica, "
                                    f"or of a node that does not train")
        self.ctx.tasks.spawn(self._send_stream_weights(sender), f"polis-weights-{sender[:8]}")

    def after_step(self, msg: Apply) -> None:
        """An ``apply`` was stepped: stream it (in a named task) if we lead the stage."""
        self.ctx.tasks.spawn(self.stream_step(msg), f"polis-wstream-{msg.version}")

    # ------------------------------------------------------------------ streaming
    async def stream_step(self, msg: Apply) -> None:
        """If we lead the stage named by ``apply`` message ``msg``, stream to its inference replicas."""
        ctx = self.ctx
        leading = msg.leader == ctx.peer_id
        targets = sorted(set(msg.inference) - {ctx.peer_id}) if leading else []
        async with self._lock:  # the compute thread may be encoding: change streams only here
            self.state.retain(targets)  # not leading: drop them all; a later lead starts afresh
            if not targets:
                return
            version, frames = await ctx.compute.run(self._encode_streams, targets)
            stage = ctx.stage.spec.stage_index
            loop = asyncio.get_running_loop()
            await asyncio.gather(*(loop.create_task(self._push(peer, frames.get(peer), stage, version),
                                                    name=f"polis-wstream-{version}-{peer[:8]}")
                                   for peer in targets))
        if frames:
            await ctx.coordinator.send(messages.Streamed(
                version=version, streams=[messages.StreamReport(**f.report) for f in frames.values()]))

    async def _push(self, peer: str, frame: DeltaFrame | None, stage: int, version: int) -> None:
        try:
            if frame is None:
                await self.ctx.peers.send(peer, WLead(stage=stage, version=version))
            else:
                await self.ctx.peers.send(peer, WDelta(stage=stage, **frame.header), frame.payload)
                self.stats["deltas_sent"] += 1
                self.stats["delta_bytes_sent"] += len(frame.payload)
        except (NetError, OSError, asyncio.TimeoutError, ValueError) as exc:
            log.info("could not stream weights to %s: %s", peer, exc)

    def _encode_streams(self, targets: list[str]) -> tuple[int, dict[str, DeltaFrame]]:
        """Compute thread: one delta per replica we hold a stream for, all from one snapshot."""
        weights, version = self.ctx.stage.rt.snapshot()
        frames = {p: self.state.encode(p, weights, version) for p in targets if self.state.has(p)}
        return int(version), frames

    async def _send_stream_weights(self, peer: str) -> None:
        """Full weights, and a stream starting from exactly them."""
        ctx = self.ctx
        async with self._lock:
            entries, payload, version, stream_id = await ctx.compute.run(self._start_stream, peer)
            await ctx.peers.send(peer, Weights(stage=ctx.stage.spec.stage_index, version=version,
                                               config=ctx.stage.rt.model_config.to_hf_dict(),
                                               tensors=tensor_bundle.wire_entries(entries), stream=stream_id),
                                 payload)
        log.info("sent full weights (version %d) to inference replica %s; stream %d starts", version, peer,
                 stream_id)

    def _start_stream(self, peer: str) -> tuple[list, bytes, int, int]:
        weights, version = self.ctx.stage.rt.snapshot()
        stream_id = self.state.start(peer, weights, version)
        entries, payload = tensor_bundle.pack_arrays(weights)
        return entries, payload, int(version), stream_id
