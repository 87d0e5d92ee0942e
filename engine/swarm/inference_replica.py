"""An inference replica's side of the weight stream: follow the stage leader's weights.

An inference replica (``NodeConfig.inference_only``) holds one stage without
optimiser state, takes no training work and only generates. It queues inbound
``wdelta``/``wlead`` (a few at most; overflow drops the oldest, which the
sequence check turns into a resync) and handles them in order on one task,
only while a stage is loaded. A delta is applied on the compute thread
(``set_weights`` with the new shadow values, so the served weights equal the
leader's shadow bit for bit, and the version), then ``served`` goes to the
coordinator. On a leader change, an out-of-sequence delta or a malformed one
(a strike against its sender) it fetches full weights first; a full load's
``served`` carries the digest of the weights received, which the coordinator
checks against its stage's majority (a leader that streams other weights
loses the lead).

Every inbound stream message is untrusted: it must come from a trainer of our
stage, name our stage, come from the leader the coordinator named for it in
``members`` (any other sender is ignored and counted in ``not_leader``: before
that, the smallest id or any trainer could take a replica over), and pass the follower's checks (names, shapes, dtype,
size cap, finite sums). The state machine is
``engine.swarm.weight_stream.StreamFollower``; the leader side is
``engine.swarm.weight_stream_leader``. What it does not know: generation or
training jobs, rewards, the codec's internals.
"""

from __future__ import annotations

import asyncio
import logging
from collections import deque
from typing import Any

from engine.net.errors import NetError, ProtocolViolation
from engine.net.shadow_delta import OutOfSequence
from engine.swarm import messages, tensor_bundle
from engine.swarm.messages import Abort, Apply, Sync, TrainIn, TrainOut, WDelta, Weights, WeightsReq, WLead
from engine.swarm.node_context import NodeContext
from engine.swarm.weight_stream import StreamFollower, WeightStreamConfig
from engine.swarm.weight_votes import weights_digest

log = logging.getLogger(__name__)

#: stream messages an inference replica keeps queued (each holds up to ~1/4 of the stage in bytes)
MAX_PENDING = 4
#: how long an inference replica waits for full weights from its leader
FETCH_TIMEOUT_S = 60.0
#: coordinator messages an inference replica never acts on (it does no training work)
TRAINING_MESSAGES = (TrainIn, TrainOut, Apply, Abort, Sync)


def _kind(header: WDelta | WLead) -> str:
    """The wire name of a stream message (``"wdelta"`` / ``"wlead"``)."""
    return "wdelta" if isinstance(header, WDelta) else "wlead"


class InferenceReplica:
    """The follower: applies the leader's deltas in order, fetches full weights when it must."""

    def __init__(self, ctx: NodeContext, config: WeightStreamConfig | None = None) -> None:
        self.ctx = ctx
        self.follower = StreamFollower(config)
        self._inbox: deque[tuple[str, WDelta | WLead, bytes]] = deque()
        self._wakeup = asyncio.Event()
        self._loaded = asyncio.Event()
        self._task: asyncio.Task | None = None
        self._handling = False
        self.stats = {"deltas_applied": 0, "full_loads": 0, "resyncs": 0, "dropped": 0, "not_leader": 0}

    def idle(self) -> bool:
        """Nothing queued and nothing being applied or fetched."""
        return not self._inbox and not self._handling

    # ------------------------------------------------------------------ loading hooks
    async def before_load(self) -> None:
        """A new stage (or new weights) is about to load: stop following the old stream."""
        self._loaded.clear()
        self._inbox.clear()
        if self._task is not None and not self._task.done():
            self._task.cancel()  # a fetch or apply for the old stage must not land on the new one
        await self.ctx.compute.run(self.follower.forget)

    def after_load(self) -> None:
        self._loaded.set()

    async def joined(self, source: str, header: Weights, weights: dict) -> None:
        """Full weights from ``source`` were just loaded: follow its stream if it started one."""
        ctx = self.ctx
        if ctx.role != "inference" or header.stream is None:
            return
        await ctx.compute.run(self.follower.reset, source, header.stream, weights, header.version)
        self.stats["full_loads"] += 1
        checksum = await ctx.compute.run(ctx.stage.rt.checksum)
        digest = await ctx.compute.run(weights_digest, weights)
        await ctx.coordinator.send(messages.Served(version=header.version, checksum=float(checksum), source=source,
                                                   full=True, weights_hash=digest))

    # ------------------------------------------------------------------ inbound (loop, no await)
    def on_stream_message(self, sender: str, header: WDelta | WLead, payload: bytes) -> None:
        """A ``wdelta``/``wlead`` arrived (even while loading): queue it for the follower task."""
        if self.ctx.role != "inference":
            raise ProtocolViolation(f"'{_kind(header)}' sent to a trainer")
        if len(self._inbox) >= MAX_PENDING:
            self._inbox.popleft()  # the sequence check will ask for full weights
            self.stats["dropped"] += 1
        self._inbox.append((sender, header, payload))
        self._wakeup.set()
        if self._task is None or self._task.done():
            self._task = self.ctx.tasks.spawn(self._follow(), "polis-wstream-follow")

    async def _follow(self) -> None:
        while True:
            if not self._inbox:
                self._wakeup.clear()
                await self._wakeup.wait()
                continue
            await self._loaded.wait()
            if not self._inbox:
                continue
            sender, header, payload = self._inbox.popleft()
            self._handling = True
            try:
                await self._handle(sender, header, payload)
            except asyncio.CancelledError:
                raise
            except (NetError, OSError, asyncio.TimeoutError, ValueError, RuntimeError) as exc:
                log.warning("weight stream from %s: %s", sender, exc)
            finally:
                self._handling = False

    def _strike(self, peer: str, reason: str) -> None:
        log.warning("weight stream from %s refused: %s", peer, reason)
        self.ctx.peers.strike(peer, reason)

    async def _handle(self, sender: str, header: WDelta | WLead, payload: bytes) -> None:
        ctx = self.ctx
        if not ctx.stage.loaded():
            return
        stage = ctx.stage.spec.stage_index
        if header.stage != stage or sender not in ctx.stage_members() or sender in ctx.membership.inference:
            self._strike(sender, f"'{_kind(header)}' for stage {header.stage} from a peer that does not train "
                                 f"stage {stage}")
            return
        if sender != ctx.membership.leader_of(stage):
            self.stats["not_leader"] += 1
            log.info("ignored '%s' from %s: the coordinator named %s to lead stage %d", _kind(header), sender,
                     ctx.membership.leader_of(stage), stage)
            return
        action = self.follower.decide(sender, _kind(header), header.version, getattr(header, "stream", None))
        if action == StreamFollower.IGNORE:
            return
        if action == StreamFollower.APPLY:
            try:
                version, checksum = await ctx.compute.run(self._apply_delta, header, payload)
            except OutOfSequence as exc:
                log.info("weight stream from %s out of sequence (%s); fetching full weights", sender, exc)
            except ProtocolViolation as exc:
                self._strike(sender, f"bad weight delta: {exc}")
            else:
                self.stats["deltas_applied"] += 1
                await ctx.coordinator.send(messages.Served(version=int(version), checksum=float(checksum),
                                                           source=sender, full=False))
                ctx.on_status()
                return
        await self._fetch(sender)

    def _apply_delta(self, header: WDelta, payload: bytes) -> tuple[int, float]:
        """Compute thread: the delta to the shadow, the new values into the backend, the new version."""
        rt = self.ctx.stage.rt
        updated = self.follower.apply(header.delta, payload, header.version)
        try:
            rt.set_weights(updated, header.version)
        except Exception:
            self.follower.forget()  # backend and shadow may now disagree: full weights next
            raise
        return rt.version, rt.checksum()

    async def _fetch(self, source: str) -> None:
        """Full weights from ``source`` with a fresh stream; both shadows restart from them."""
        ctx = self.ctx
        if ctx.weights.busy():
            return  # a load is in flight already
        self.stats["resyncs"] += 1
        waiter = ctx.weights.expect(source)
        try:
            await ctx.peers.send(source, WeightsReq(stage=ctx.stage.spec.stage_index, stream=True))
            # asyncio.wait, not wait_for: on 3.10/3.11 wait_for can swallow a cancellation that
            # races with the answer, and this task must stop when the node stops
            await asyncio.wait({waiter}, timeout=FETCH_TIMEOUT_S)
        finally:
            if not waiter.done():
                waiter.cancel()  # never leave a pending waiter behind: it would block later fetches
        if waiter.cancelled():
            raise asyncio.TimeoutError(f"no weights from {source} in {FETCH_TIMEOUT_S:.0f} s")
        header, payload = waiter.result()
        if header.stream is None or header.stage != ctx.stage.spec.stage_index:
            self._strike(source, "weights without a stream, or of another stage")
            return
        version, checksum, digest = await ctx.compute.run(self._reset_from, source, header, payload)
        self.stats["full_loads"] += 1
        log.info("inference replica: full weights of stage %d (version %d) from %s, stream %d",
                 ctx.stage.spec.stage_index, version, source, header.stream)
        await ctx.coordinator.send(messages.Served(version=int(version), checksum=float(checksum), source=source,
                                                   full=True, weights_hash=digest))
        ctx.on_status()

    def _reset_from(self, source: str, header: Weights, payload: Any) -> tuple[int, float, str]:
        """Compute thread: install full weights and follow ``source``'s stream from exactly them."""
        rt = self.ctx.stage.rt
        weights = tensor_bundle.unpack(header.tensors, payload, rt.shapes(), require_all=True)
        rt.set_weights(weights, header.version)
        self.follower.reset(source, header.stream, weights, header.version)
        return rt.version, rt.checksum(), weights_digest(weights)
