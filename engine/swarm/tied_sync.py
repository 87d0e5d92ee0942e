"""The tied embedding between the first and the last stage: one gradient, one clip, every step.

A model with tied embeddings (SmolLM2) holds ``model.embed_tokens.weight`` on stage 0 (the
embedding) and on the last stage (the head): both backends list it in ``tied_names``. Each
copy's gradient is only its own use, so, as Megatron does across pipeline stages, every
optimiser step the two stages exchange their (replica-aggregated) gradients of it and both
install the sum; and both clip as one unit (``engine.rl.update``: the norm over both stages'
gradients, the tied tensor counted once), so both copies take the same step and stay
bit-identical. This runs inside the ``apply`` step, after replica aggregation
(``engine.swarm.replica_step``), over the existing stage-0 <-> last-stage peer links (the last
stage already sends sampled tokens to stage 0). Every trainer of one end sends its ``tied_grad``
(fp32: lossless, so the sums agree bit for bit) to every trainer of the other end and takes the
first that arrives (replicas of a stage hold equal aggregates). A middle stage, a one-stage
model, a LoRA run (the embedding is frozen: no tied names) have nothing to do.

If the other end's gradient does not come within the deadline (the node's, or the one the
step gives, when sooner), the stage steps on its own
gradient and norm (the copies then differ by that step) and counts it in ``tied_missing``.
What it does not know: how gradients are computed or aggregated, the optimiser.
"""

from __future__ import annotations

import asyncio
import logging
import math
import time
from collections.abc import Mapping
from dataclasses import dataclass

import numpy as np

from engine.net.errors import ProtocolViolation
from engine.swarm import tensor_bundle
from engine.swarm.messages import TiedGrad
from engine.swarm.node_context import NodeContext

log = logging.getLogger(__name__)

#: most steps of tied gradients kept (the other end may be a step ahead)
MAX_TIED_STEPS = 4


@dataclass(frozen=True)
class TiedStep:
    """What a stage steps with: its gradients (tied tensors summed) and the unit's norm."""

    grads: dict[str, np.ndarray]
    norm: float  #: L2 norm over both stages' gradients, the tied tensors once (the same on both ends)


def sq_norm(arrays: Mapping[str, np.ndarray], skip: tuple[str, ...] = ()) -> float:
    """Squared L2 norm in float64, names in sorted order (both ends compute it the same way)."""
    return float(sum(float(np.square(arrays[n], dtype=np.float64).sum()) for n in sorted(arrays) if n not in skip))


class TiedSync:
    """The tied-gradient exchange of one node's stage."""

    def __init__(self, ctx: NodeContext, *, timeout_s: float) -> None:
        self.ctx = ctx
        self.timeout_s = timeout_s
        self._inbox: dict[int, tuple[TiedGrad, bytes]] = {}
        self._event = asyncio.Event()

    def _other_end(self) -> int | None:
        """The stage holding the other copy, or None when this stage shares nothing."""
        spec, rt = self.ctx.stage.spec, self.ctx.stage.rt
        if spec is None or spec.num_stages < 2 or not rt.tied_names:
            return None
        if spec.stage_index == 0:
            return spec.num_stages - 1
        return 0 if spec.is_last else None

    def _trainers(self, stage: int) -> list[str]:
        members = self.ctx.membership
        return [p for p in members.of_stage(stage) if p not in members.inference]

    def on_tied_grad(self, sender: str, header: TiedGrad, payload: bytes) -> None:
        other = self._other_end()
        if other is None or header.stage != other or sender not in self._trainers(other):
            raise ProtocolViolation(f"tied gradient from {sender}, who does not hold the other copy")
        if len(self._inbox) >= MAX_TIED_STEPS and header.step not in self._inbox:
            raise ProtocolViolation("too many steps of tied gradients in flight")
        self._inbox.setdefault(header.step, (header, bytes(payload)))
        self._event.set()

    def forget(self, step: int | None = None) -> None:
        if step is None:
            self._inbox.clear()
        else:
            self._inbox.pop(step, None)

    async def combine(self, step: int, grads: dict[str, np.ndarray], *,
                      until: float | None = None) -> TiedStep | None:
        """The step's gradients with the tied tensors summed with the other end's, and the unit's
        norm; None when this stage shares nothing (the caller clips it alone). ``until`` (a
        ``time.monotonic()`` instant) ends the wait for the other end's sooner than our own
        ``timeout_s`` would."""
        other = self._other_end()
        if other is None:
            return None
        ctx, names = self.ctx, tuple(self.ctx.stage.rt.tied_names)
        own_rest = sq_norm(grads, skip=names)
        entries, payload = await ctx.compute.run(tensor_bundle.pack_arrays, {n: grads[n] for n in names})
        message = TiedGrad(step=step, stage=ctx.stage.spec.stage_index, rest_sq_norm=own_rest,
                           tensors=tensor_bundle.wire_entries(entries))
        ctx.send_to_each(self._trainers(other), message, payload, what="tied gradient", name=f"polis-tied-{step}")
        deadline = time.monotonic() + self.timeout_s
        received = await self._await(step, deadline if until is None else min(deadline, until))
        self._inbox = {s: v for s, v in self._inbox.items() if s > step}
        if received is None:
            ctx.counters["tied_missing"] = ctx.counters.get("tied_missing", 0) + 1
            log.warning("step %d: no tied gradient from stage %d; stepping on our own (the copies now differ)",
                        step, other)
            return TiedStep(grads, math.sqrt(sq_norm(grads)))
        header, body = received
        theirs = tensor_bundle.unpack(header.tensors, body, {n: grads[n].shape for n in names}, require_all=True)
        summed = {**grads, **{n: grads[n] + theirs[n] for n in names}}  # a + b == b + a: both ends agree
        first_rest, last_rest = (own_rest, header.rest_sq_norm) if other else (header.rest_sq_norm, own_rest)
        tied_sq = sq_norm({n: summed[n] for n in names})
        return TiedStep(summed, math.sqrt(first_rest + last_rest + tied_sq))

    async def _await(self, step: int, deadline: float) -> tuple[TiedGrad, bytes] | None:
        while step not in self._inbox:
            if time.monotonic() >= deadline:
                return None
            self._event.clear()
            try:
                await asyncio.wait_for(self._event.wait(), max(0.0, deadline - time.monotonic()))
            except asyncio.TimeoutError:
                pass
        return self._inbox[step]
