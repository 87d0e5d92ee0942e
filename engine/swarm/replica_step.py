"""The optimiser step of a stage and everything between its replicas: shares, weights, resync.

On ``apply`` (from the coordinator, naming the stage's trainers) each trainer compresses its
accumulated gradient (``engine.swarm.replica_sync``), sends it to the other trainers (``share``),
waits for theirs up to ``share_timeout_s`` or ``apply``'s ``peer_wait_s``, the sooner (a replica
that left the stage is not waited for, nor one that ``apply`` gives no token share: it trained
nothing, the aggregate leaves it out; and our sends go out in the background, so one replica
that stopped draining cannot hold the others),
aggregates identically to every other replica (weighted by each replica's token share when
``apply`` names unequal ones); the first and the last stage of a tied-embedding model then sum
their gradients of the shared matrix and clip as one unit (``engine.swarm.tied_sync``); it
applies, optionally writes the stage checkpoint, and reports ``stepped`` with a digest of its full
weights (``engine.swarm.weight_votes``: the coordinator's majority vote). A replica that joins or
was outvoted asks another for full weights (``weights_req`` / ``weights``; ``sync`` from the
coordinator names the source, the version and the majority's digest, and weights that do not match
are refused: a strike and ``weights_refused``, nothing installed); a trainer gets the source's
AdamW moments with them (``engine.swarm.adamw_transfer``), so its next step is its siblings'.

With ``replica_sync.mode = "diloco"`` a trainer steps on its own gradient (no share) and,
at versions that are multiples of ``inner_steps``, right after that inner step, sends its
compressed pseudo-gradient (``share`` keyed by that version), waits for the others' as above
and takes the identical outer step (``engine.swarm.outer_sync``). A replica's full weights
are then the anchor (the weights at the last sync), with the outer momentum when asked
(``weights_req.outer_state``: a resync), so a joiner starts where every replica agrees.
The exchange is not overlapped with the next inner steps: it is one message of a few KB
(tiny base) to a few hundred KB (a LoRA adapter) every H steps, against seconds of compute
per step, and applying it late would need every replica to replay its inner steps.

Hooks: ``release_through(step)`` frees the training activations of the applied
step; ``after_step(apply_message)`` lets the weight-stream leader stream.

What it does not know: micro-batches, rewards, how links are made.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Awaitable, Callable
from functools import partial
from pathlib import Path
from typing import Any

from engine.net.errors import ProtocolViolation
from engine.net.framing import FrameLimits
from engine.swarm import adamw_transfer, messages, tensor_bundle
from engine.swarm.messages import Apply, Share, Sync, Weights, WeightsReq
from engine.swarm.node_context import NodeContext
from engine.swarm.outer_sync import MOMENTUM_PREFIX, OuterSync, scale_grads, split_momentum
from engine.swarm.replica_sync import ReplicaCompressor, aggregate, dense_nbytes
from engine.swarm.tied_sync import TiedSync
from engine.swarm.weight_votes import weights_digest

log = logging.getLogger(__name__)

#: most steps of gradient shares a replica keeps (a replica ahead of us sends the next one early)
MAX_SHARE_STEPS = 4
#: how long a replica waits for full weights from another
WEIGHTS_TIMEOUT_S = 60.0


def token_shares(msg: Apply) -> dict[str, float] | None:
    """Each replica's fraction of the step's tokens from ``apply`` (None: equal, or not usable)."""
    shares = msg.token_shares
    if len(shares) != len(msg.replicas) or abs(sum(shares) - 1.0) > 1e-3:
        return None
    return dict(zip(msg.replicas, shares))


class ReplicaStep:
    """Gradient shares, the optimiser step, and full weights between the replicas of our stage."""

    def __init__(self, ctx: NodeContext, *, share_timeout_s: float, data_dir: str | None,
                 release_through: Callable[[int], Awaitable[None]],
                 after_step: Callable[[Apply], None], tied_timeout_s: float = 120.0) -> None:
        self.ctx = ctx
        #: the tied embedding's gradient with the other end of the pipeline (first <-> last stage)
        self.tied = TiedSync(ctx, timeout_s=tied_timeout_s)
        self.share_timeout_s = share_timeout_s
        self.data_dir = data_dir
        self._release_through = release_through
        self._after_step = after_step
        self._shares: dict[int, dict[str, tuple[list, bytes]]] = {}
        self._share_event = asyncio.Event()
        self._compressor: ReplicaCompressor | None = None
        #: DiLoCo state (mode "diloco"); None until the first step after a load
        self._outer: OuterSync | None = None

    def new_weights(self, fresh: bool) -> None:
        """A stage was loaded (``fresh``: new weights, so the error-feedback residual starts over)."""
        run_cfg = self.ctx.stage.run_cfg
        if fresh or self._compressor is None:
            self._compressor = ReplicaCompressor(run_cfg.update_encoding, run_cfg.update_topk_fraction)
            self._outer = None  # the loaded weights become the anchor at the next step

    @property
    def _diloco(self) -> bool:
        return self.ctx.stage.run_cfg.replica_sync.mode == "diloco"

    # ------------------------------------------------------------------ inbound (loop, no await)
    def on_apply(self, msg: Apply) -> None:
        self.ctx.tasks.spawn(self._apply(msg), f"polis-apply-{msg.step}")

    def on_sync(self, msg: Sync) -> None:
        self.ctx.tasks.spawn(self._catch_up(msg) if msg.catch_up else self._resync(msg), "polis-resync")

    async def _catch_up(self, sync: Sync) -> None:
        """A ``sync`` with ``catch_up``: our stage stepped while we loaded; take the source's weights, then
        say ready again (also when they did not come: the coordinator then decides, not a hung join)."""
        try:
            await self._resync(sync)
        finally:
            stage = self.ctx.stage
            await self.ctx.coordinator.send(messages.Ready(stage=stage.spec.stage_index, version=int(stage.rt.version)))

    def on_share(self, sender: str, header: Share, payload: bytes) -> None:
        if sender not in self.ctx.stage_members():
            raise ProtocolViolation(f"gradient share from {sender}, who is not a replica of our stage")
        now = int(self.ctx.stage.rt.version)  # the step we apply next (step == version before it)
        if not now <= header.step < now + MAX_SHARE_STEPS:  # far-future slots would jam the exchange
            raise ProtocolViolation(f"gradient share for step {header.step}, outside [{now}, {now + MAX_SHARE_STEPS})")
        if len(self._shares) >= MAX_SHARE_STEPS and header.step not in self._shares:
            raise ProtocolViolation("too many steps of gradient shares in flight")
        self._shares.setdefault(header.step, {})[sender] = (header.tensors, payload)
        self._share_event.set()

    def on_weights_req(self, sender: str, header: WeightsReq, payload: bytes) -> None:
        self.ctx.tasks.spawn(self._send_weights(sender, header.outer_state, header.optimizer_state),
                             f"polis-weights-{sender[:8]}")

    def wants_moments(self) -> bool:
        """Whether this node asks for AdamW moments with full weights: a trainer syncing every step
        (DiLoCo replicas keep their inner moments local)."""
        return self.ctx.role == "trainer" and not self._diloco

    def forget(self, step: int | None = None) -> None:
        """Drop the shares of ``step`` (aborted), or of every step (jobs abandoned)."""
        if step is None:
            self._shares.clear()
        else:
            self._shares.pop(step, None)
        self.tied.forget(step)

    # ------------------------------------------------------------------ the step
    async def _apply(self, msg: Apply) -> None:
        ctx, rt = self.ctx, self.ctx.stage.rt
        step, version = msg.step, msg.version
        others = sorted(p for p in msg.replicas if p != ctx.peer_id)
        #: each wait on peers in this step (replica shares, DiLoCo's outer sync) ends within this
        wait_s = min(self.share_timeout_s, msg.peer_wait_s or self.share_timeout_s)
        #: the tied gradient's wait ends two peer waits after ``apply``: the other end may first wait
        #: out its own replicas' shares (a tied model never runs DiLoCo: no outer sync after it)
        tied_until = time.monotonic() + 2 * msg.peer_wait_s if msg.peer_wait_s else None
        grads = await ctx.compute.run(rt.grads)
        dense = dense_nbytes(grads)
        update_bytes = 0
        diloco = self._diloco
        shares = token_shares(msg)
        if diloco:
            if self._outer is None:  # the weights before this step are the anchor
                self._outer = OuterSync(ctx.stage.run_cfg.replica_sync, await ctx.compute.run(rt.state_dict))
            own_share = (shares or {}).get(ctx.peer_id)
            agg = await ctx.compute.run(scale_grads, grads, 1 / own_share if own_share else len(msg.replicas))
        elif others:
            encoded, own = await ctx.compute.run(self._compressor.compress, grads)
            # a replica that trained none of the step's tokens is left out of the aggregate: not waited
            # for, and (when it is us) sends nothing, which would only reach replicas that have stepped
            contributors = [p for p in others if shares is None or shares.get(p, 0.0) > 0]
            send_to = others if shares is None or shares.get(ctx.peer_id, 0.0) > 0 else []
            contributions, update_bytes = await self._exchange(step, encoded, own, send_to, "gradient", wait_s,
                                                               wait_for=contributors)
            agg = await ctx.compute.run(partial(aggregate, shares=shares), contributions)
        else:
            agg = grads
        tied = await self.tied.combine(step, agg, until=tied_until)  # None: nothing shared with another stage
        if tied is None:
            norm = await ctx.compute.run(rt.apply, agg, ctx.stage.run_cfg.max_grad_norm, version)
        else:
            norm = await ctx.compute.run(rt.apply, tied.grads, ctx.stage.run_cfg.max_grad_norm, version,
                                         tied.norm)
        if diloco and ctx.stage.run_cfg.replica_sync.synced_at(version):
            update_bytes = await self._outer_sync(version, others, wait_s)
        checksum, digest = await ctx.compute.run(self._fingerprints)
        self._shares = {s: v for s, v in self._shares.items() if s > (version if diloco else step)}
        await self._release_through(step)
        path = None
        if msg.checkpoint:
            path = str(self.stage_checkpoint_path())
            await ctx.compute.run(rt.save_stage, path, version)
        await ctx.coordinator.send(messages.Stepped(step=step, version=version, grad_norm=float(norm),
                                                    checksum=float(checksum), weights_hash=digest,
                                                    update_bytes=int(update_bytes),
                                                    dense_bytes=int(dense), checkpoint_path=path,
                                                    # a runtime that cannot skip (a test's stand-in) says nothing
                                                    skipped=bool(getattr(rt, "last_step_skipped", False))))
        self._after_step(msg)
        ctx.on_status()

    async def _outer_sync(self, version: int, others: list[str], wait_s: float) -> int:
        """DiLoCo's sync after the inner step to ``version``; returns the bytes of our share."""
        ctx, rt, outer = self.ctx, self.ctx.stage.rt, self._outer
        weights = await ctx.compute.run(rt.state_dict)
        if not others:  # alone: nothing to average with; our weights are the synced ones
            self._outer = OuterSync(ctx.stage.run_cfg.replica_sync, weights, outer.momentum_state())
            return 0
        encoded, own = await ctx.compute.run(outer.compress, weights)
        # keyed by the synced version
        contributions, nbytes = await self._exchange(version, encoded, own, others, "pseudo-gradient", wait_s)
        agg = await ctx.compute.run(aggregate, contributions)
        synced = await ctx.compute.run(outer.outer_step, agg, len(contributions))
        await ctx.compute.run(rt.set_weights, synced, version)
        return nbytes

    async def _exchange(self, key: int, encoded: dict, own: dict[str, Any], others: list[str], what: str,
                        wait_s: float, wait_for: list[str] | None = None) -> tuple[dict[str, dict[str, Any]], int]:
        """Send our encoded share (``share`` keyed by ``key``) to ``others`` (in the background: a
        replica that stopped draining cannot hold the step), wait for the shares of ``wait_for``
        (default: ``others``) up to ``wait_s`` and decode them: every usable contribution,
        ours included, and our bytes."""
        ctx = self.ctx
        entries, payload = tensor_bundle.pack(encoded)
        share = Share(step=key, tensors=tensor_bundle.wire_entries(entries))
        ctx.send_to_each(others, share, payload, what=what, name=f"polis-share-{key}")
        received = await self._await_shares(key, others if wait_for is None else wait_for, wait_s)
        shapes = {name: a.shape for name, a in own.items()}
        contributions = {ctx.peer_id: own}
        for peer, (peer_entries, peer_payload) in received.items():
            try:
                contributions[peer] = tensor_bundle.unpack(peer_entries, peer_payload, shapes, require_all=True)
            except ProtocolViolation as exc:
                log.warning("replica %s sent an unusable %s (%s); going on without it", peer, what, exc)
        return contributions, len(payload)

    def _fingerprints(self) -> tuple[float, str]:
        """Compute thread: the cheap checksum and the full digest, from one read of the weights."""
        weights = self.ctx.stage.rt.state_dict()
        return tensor_bundle.checksum(weights), weights_digest(weights)

    async def _await_shares(self, step: int, others: list[str], wait_s: float) -> dict[str, tuple[list, bytes]]:
        deadline = time.monotonic() + wait_s
        while True:
            got = self._shares.get(step, {})
            missing = [p for p in others if p not in got]
            alive = [p for p in missing if p in self.ctx.stage_members()]
            if not alive or time.monotonic() >= deadline:
                if missing:
                    log.warning("step %d: no gradient from %s; stepping without them", step, missing)
                return {p: got[p] for p in others if p in got}
            self._share_event.clear()
            try:
                await asyncio.wait_for(self._share_event.wait(), max(0.0, deadline - time.monotonic()))
            except asyncio.TimeoutError:
                pass

    def stage_checkpoint_path(self) -> Path:
        if self.data_dir:
            root = Path(self.data_dir)
        else:
            from engine.paths import user_data_dir

            root = user_data_dir()
        stage = self.ctx.stage
        return root / "stages" / (stage.run_id or "run") / f"stage{stage.spec.stage_index}.safetensors"

    # ------------------------------------------------------------------ full weights between replicas
    async def _send_weights(self, peer: str, outer_state: bool = False, optimizer_state: bool = False) -> None:
        ctx, rt = self.ctx, self.ctx.stage.rt
        if optimizer_state and self.wants_moments():  # a sibling trainer: the moments read with the weights
            state, version, moments = await ctx.compute.run(rt.snapshot_with_moments)
            state, attached = adamw_transfer.attach(state, moments, FrameLimits().max_payload_bytes)
            if not attached:
                log.info("AdamW moments of stage %d too large to go with its weights to %s; they start over there",
                         ctx.stage.spec.stage_index, peer)
        else:
            state, version = await ctx.compute.run(rt.snapshot)
        if self._diloco and self._outer is not None:  # the weights every replica agreed on last
            state = self._outer.weights()
            if outer_state:
                state.update({MOMENTUM_PREFIX + n: m for n, m in self._outer.momentum_state().items()})
        entries, payload = await ctx.compute.run(tensor_bundle.pack_arrays, state)
        await ctx.peers.send(peer, Weights(stage=ctx.stage.spec.stage_index, version=int(version),
                                           config=rt.model_config.to_hf_dict(),
                                           tensors=tensor_bundle.wire_entries(entries)), payload)

    async def _resync(self, sync: Sync) -> None:
        ctx, rt, source = self.ctx, self.ctx.stage.rt, sync.source_peer
        waiter = ctx.weights.expect(source)
        diloco, moments_wanted = self._diloco, self.wants_moments()
        await ctx.peers.send(source, WeightsReq(stage=ctx.stage.spec.stage_index, outer_state=diloco,
                                                optimizer_state=moments_wanted))
        header, payload = await asyncio.wait_for(waiter, WEIGHTS_TIMEOUT_S)
        shapes = await ctx.compute.run(rt.shapes)
        expected = dict(shapes)
        if diloco:  # the outer momentum may come along (none before the first outer step)
            expected.update({MOMENTUM_PREFIX + n: s for n, s in shapes.items()})
        if moments_wanted:  # and the AdamW moments with a sibling trainer's weights
            expected.update(adamw_transfer.expected_shapes(shapes))
        received = tensor_bundle.unpack(header.tensors, payload, expected)
        received, moments = adamw_transfer.split(received, shapes, source)
        weights, momentum = split_momentum(received)
        if len(weights) != len(shapes):
            raise ProtocolViolation(f"weights from {source} lack {len(shapes) - len(weights)} tensors")
        if sync.weights_hash is not None:
            if sync.version is not None and header.version != sync.version:
                log.info("resync source %s sent version %d, not %d; the next vote retries", source,
                         header.version, sync.version)
                return
            digest = await ctx.compute.run(weights_digest, weights)
            if digest != sync.weights_hash:
                reason = f"weights of version {header.version} hash to {digest}, not the majority's {sync.weights_hash}"
                log.warning("refused weights from %s: %s", source, reason)
                ctx.peers.strike(source, reason)
                await ctx.coordinator.send(messages.WeightsRefused(source=source, version=int(header.version),
                                                                   reason=reason))
                return
        await ctx.compute.run(rt.set_weights, weights, header.version)
        if moments is not None:
            await ctx.compute.run(rt.load_optimizer_state, moments)
        elif moments_wanted:
            log.info("resync source %s sent no AdamW moments; ours stay as they were", source)
        self._compressor.reset()
        if diloco:
            self._outer = OuterSync(ctx.stage.run_cfg.replica_sync, weights, momentum)
        log.info("resynchronised stage %d from %s at version %d", ctx.stage.spec.stage_index, source,
                 header.version)
