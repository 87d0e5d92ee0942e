"""Training micro-batches through the pipeline: forward, loss on the last stage, backward.

One micro-batch of step ``s`` (``train_in`` with token ids to stage 0,
``train_out`` with targets, mask, behaviour log-probs and advantages to the
last stage) runs forward along its route keeping activations for backward
(key ``"s:mb"``); the last stage waits for both its activations and its targets
(a slot), computes the loss, reports ``mb_loss`` and sends the gradient of its
input back; each stage backpropagates and accumulates its parameter gradients;
stage 0 reports ``mb_done``. A *proximal* pass (``prox``: forward only, key
``"ps:mb"``) returns the log-probs of the targets (``prox_done``) and keeps nothing.

Gradients stay accumulated on the backend until the step is applied
(``engine.swarm.replica_step``) or aborted. A failing micro-batch is reported
(``mb_failed``) and its activations freed. A micro-batch the coordinator re-dispatched to us
on another route while we still hold its first try (its downstream went silent) replaces
that try: its activations are freed, not the new try refused.

What it does not know: rewards or advantages (they arrive computed), the
optimiser step, replicas, links.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Coroutine
from dataclasses import dataclass, field

import numpy as np
from msgspec.structs import replace

from engine.net.errors import ProtocolViolation
from engine.swarm import messages
from engine.swarm.generation import JOB_ERRORS
from engine.swarm.messages import Act, Grad, TrainIn, TrainOut
from engine.swarm.node_context import NodeContext
from engine.swarm.pipeline_hops import rect
from engine.swarm.stage_runtime import Segments

log = logging.getLogger(__name__)

#: most micro-batches the last stage lets wait for their activations or targets
MAX_SLOTS = 4096


def train_key(msg: TrainIn | TrainOut | Act) -> str:
    """Key of a training micro-batch; proximal (forward-only) passes get their own."""
    prox = msg.kind == "prox" if isinstance(msg, Act) else msg.prox
    return f"{'p' if prox else ''}{msg.step}:{msg.mb}"


@dataclass
class _TrainSlot:
    """Last stage: a micro-batch waits for its activations and its targets."""

    act: tuple[list[str], np.ndarray, Segments] | None = None  # (route, activations or input ids, packed rows)
    out: TrainOut | None = None
    created: float = field(default_factory=time.monotonic)


class Training:
    """The training micro-batches this stage takes part in."""

    def __init__(self, ctx: NodeContext) -> None:
        self.ctx = ctx
        self._slots: dict[str, _TrainSlot] = {}
        self._keys: set[str] = set()  # micro-batches whose activations the backend keeps for backward
        #: the route each of those came along: a gradient must come back on the same one (the ticket's)
        self._routes: dict[str, list[str]] = {}

    # ------------------------------------------------------------------ inbound (loop, no await)
    def on_train_in(self, msg: TrainIn) -> None:
        self._spawn(self._first(msg), msg.step, msg.mb, f"polis-train-{msg.step}-{msg.mb}")

    def on_train_out(self, msg: TrainOut) -> None:
        key = train_key(msg)
        self._slot(key).out = msg
        self._spawn(self._last_if_ready(key), msg.step, msg.mb, f"polis-last-{key}")

    def on_act(self, sender: str, header: Act, x: np.ndarray) -> None:
        key = train_key(header)
        if self.ctx.stage.spec.is_last:
            self._slot(key).act = (header.route, x, header.segments)
            self._spawn(self._last_if_ready(key), header.step, header.mb, f"polis-last-{key}")
        else:
            self._spawn(self._mid(header, x), header.step, header.mb, f"polis-mid-{key}")

    def on_grad(self, sender: str, header: Grad, g: np.ndarray) -> None:
        """Checked here, before any task: a gradient for a micro-batch we did not forward, or along
        another route than its activations took, is the sender's fault (a strike), not the job's."""
        key = f"{header.step}:{header.mb}"
        if key not in self._keys:
            raise ProtocolViolation(f"gradient for unknown micro-batch {key}")
        if self._routes.get(key) != list(header.route):
            raise ProtocolViolation(f"gradient for micro-batch {key} along another route than its activations")
        self._keys.discard(key)  # claimed now: a second gradient for it is refused the same way
        self._routes.pop(key, None)
        self._spawn(self._back(header, g, key), header.step, header.mb, f"polis-back-{header.job}")

    def _spawn(self, coro: Coroutine, step: int, mb: int, name: str) -> None:
        self.ctx.tasks.spawn(self._guard(coro, step, mb), name)

    async def _guard(self, coro: Coroutine, step: int, mb: int) -> None:
        ctx = self.ctx
        try:
            await coro
        except asyncio.CancelledError:
            raise
        except JOB_ERRORS as exc:
            key = f"{step}:{mb}"
            log.warning("job %s failed: %s", key, exc)
            self._slots.pop(key, None)
            if key in self._keys:
                self._keys.discard(key)
                await ctx.compute.run(ctx.stage.rt.release, key)
            await ctx.coordinator.send(messages.MbFailed(step=step, mb=mb, reason=str(exc)[:500]))

    def _slot(self, key: str) -> _TrainSlot:
        slot = self._slots.get(key)
        if slot is None:
            if len(self._slots) > MAX_SLOTS:
                raise ProtocolViolation("too many training micro-batches waiting")
            slot = self._slots[key] = _TrainSlot()
        return slot

    # ------------------------------------------------------------------ passes
    def _forward(self, prox: bool, key: str, route: list[str], segments: Segments):
        """The forward for a pass: keep activations for backward, or not (proximal)."""
        rt = self.ctx.stage.rt
        if prox:
            return lambda _key, x: rt.forward_only(x, segments)
        again = key in self._keys  # the coordinator re-dispatched it here, its first try still held
        self._keys.add(key)
        self._routes = {k: r for k, r in self._routes.items() if k in self._keys}
        self._routes[key] = list(route)

        def forward(k: str, x):
            if again:
                rt.release(k)  # that try's gradient will not come (or comes along its old route: refused)
            return rt.train_forward(k, x, segments)
        return forward

    async def _first(self, msg: TrainIn) -> None:
        ctx, spec, rt = self.ctx, self.ctx.stage.spec, self.ctx.stage.rt
        route, key = msg.route, train_key(msg)
        if not spec.is_first or len(route) != spec.num_stages or route[0] != ctx.peer_id:
            raise ProtocolViolation("training input sent to a node that is not its first stage")
        inputs = rect(msg.inputs, np.int64, "inputs")
        if inputs.max() >= rt.vocab_size:
            raise ProtocolViolation("input token id outside the vocabulary")
        prox = msg.prox
        if spec.is_last:
            self._slot(key).act = (route, inputs, msg.segments)
            await self._last_if_ready(key)
            return
        tensor, payload = await ctx.compute.run(ctx.boundary.forward_encoded,
                                                self._forward(prox, key, route, msg.segments), key,
                                                inputs, ctx.stage.run_cfg.activation_encoding, route[1],
                                                spec.stage_index)
        await ctx.peers.send(route[1], Act(kind="prox" if prox else "train", job=key, route=route, hop=1,
                                           versions=[int(rt.version)], tensor=tensor, step=msg.step, mb=msg.mb,
                                           ticket=msg.ticket, segments=msg.segments), payload)
        ctx.boundary.sent(route[1], tensor)

    async def _mid(self, header: Act, x: np.ndarray) -> None:
        ctx, rt = self.ctx, self.ctx.stage.rt
        key = train_key(header)
        forward = self._forward(header.kind == "prox", key, header.route, header.segments)
        hop = header.hop + 1
        tensor, payload = await ctx.compute.run(ctx.boundary.forward_encoded, forward, key, x,
                                                ctx.stage.run_cfg.activation_encoding, header.route[hop],
                                                header.hop)
        await ctx.peers.send(header.route[hop], replace(header, hop=hop, tensor=tensor,
                                                        versions=[*header.versions, int(rt.version)]), payload)
        ctx.boundary.sent(header.route[hop], tensor)

    async def _last_if_ready(self, key: str) -> None:
        ctx, rt, run_cfg = self.ctx, self.ctx.stage.rt, self.ctx.stage.run_cfg
        slot = self._slots.get(key)
        if slot is None or slot.act is None or slot.out is None:
            return
        del self._slots[key]
        (route, x, segments), out = slot.act, slot.out
        if route != out.route:
            raise ProtocolViolation("activations and targets of a micro-batch name different routes")
        targets = rect(out.targets, np.int64, "targets")
        mask = rect(out.mask, bool, "mask")
        behaviour = rect(out.behaviour, np.float32, "behaviour")
        advantages = np.asarray(out.advantages, dtype=np.float32) if out.token_advantages is None else \
            rect(out.token_advantages, np.float32, "token_advantages")
        rows, width = x.shape[0], x.shape[1]
        if targets.shape != (rows, width) or mask.shape != targets.shape or behaviour.shape != targets.shape \
                or advantages.shape not in ((rows,), (rows, width)):
            raise ProtocolViolation("targets, mask, behaviour or advantages do not fit the activations")
        if targets.max() >= rt.vocab_size:
            raise ProtocolViolation("target token id outside the vocabulary")
        temperature = run_cfg.sampling.temperature
        if out.prox:
            logp = await ctx.compute.run(rt.prox_logprobs, x, targets, temperature, segments)
            await ctx.coordinator.send(messages.ProxDone(step=out.step, mb=out.mb,
                                                         logprobs=np.round(logp, 6).astype(float).tolist()))
            return
        proximal = None
        if out.proximal is not None:
            proximal = rect(out.proximal, np.float32, "proximal")
            if proximal.shape != targets.shape:
                raise ProtocolViolation("proximal log-probs do not fit the targets")
        self._keys.add(key)
        grad_in, stats = await ctx.compute.run(
            rt.train_last, key, x, targets, mask, behaviour, advantages, out.normaliser,
            run_cfg.objective, temperature, proximal, segments)
        self._keys.discard(key)
        ctx.counters["microbatches_trained"] += 1
        step, mb = out.step, out.mb
        await ctx.coordinator.send(messages.MbLoss(
            step=step, mb=mb, loss=float(stats["loss"]), tokens=int(stats["tokens"]),
            masked_fraction=float(stats["masked_fraction"]), ess=float(stats["ess"]),
            clipped_fraction=float(stats["clipped_fraction"])))
        if len(route) == 1:
            await ctx.coordinator.send(messages.MbDone(step=step, mb=mb))
            return
        hop = len(route) - 2
        tensor, payload = await ctx.compute.run(ctx.boundary.encode, "grad", grad_in, run_cfg.activation_encoding,
                                                route[hop], len(route) - 1)
        await ctx.peers.send(route[hop], Grad(job=key, route=route, hop=hop, tensor=tensor, step=step, mb=mb,
                                              ticket=out.ticket), payload)
        ctx.boundary.sent(route[hop], tensor)

    async def _back(self, header: Grad, g: np.ndarray, key: str) -> None:
        ctx, rt = self.ctx, self.ctx.stage.rt
        grad_in = await ctx.compute.run(rt.train_backward, key, g)
        ctx.counters["microbatches_trained"] += 1
        if ctx.stage.spec.is_first:
            await ctx.coordinator.send(messages.MbDone(step=header.step, mb=header.mb))
            return
        hop = header.hop - 1
        tensor, payload = await ctx.compute.run(ctx.boundary.encode, "grad", grad_in,
                                                ctx.stage.run_cfg.activation_encoding, header.route[hop], header.hop)
        await ctx.peers.send(header.route[hop], replace(header, hop=hop, tensor=tensor), payload)
        ctx.boundary.sent(header.route[hop], tensor)

    # ------------------------------------------------------------------ step boundaries
    async def abort(self, step: int) -> None:
        """Drop every micro-batch of ``step`` and the gradients accumulated so far."""
        ctx = self.ctx
        prefix = f"{step}:"
        for key in [k for k in self._keys if k.startswith(prefix)]:
            self._keys.discard(key)
            await ctx.compute.run(ctx.stage.rt.release, key)
        for key in [k for k in self._slots if k.startswith(prefix)]:
            del self._slots[key]
        await ctx.compute.run(ctx.stage.rt.zero_grad)

    async def release_through(self, step: int) -> None:
        """After a step was applied: free activations kept for micro-batches of it or older."""
        for key in [k for k in self._keys if int(k.split(":")[0]) <= step]:
            self._keys.discard(key)
            await self.ctx.compute.run(self.ctx.stage.rt.release, key)

    def abandon(self) -> None:
        """Forget every micro-batch (coordinator lost, or reassigned) and free its memory."""
        keys = set(self._keys)
        self._keys.clear()
        self._slots.clear()
        rt = self.ctx.stage.rt
        for key in keys:
            self.ctx.compute.submit(rt.release, key)
        if keys:
            self.ctx.compute.submit(rt.zero_grad)

    def expire(self, cutoff: float) -> None:
        """Forget slots waiting since before ``cutoff`` (monotonic seconds)."""
        for key in [k for k, s in self._slots.items() if s.created < cutoff]:
            del self._slots[key]
