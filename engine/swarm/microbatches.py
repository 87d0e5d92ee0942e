"""Micro-batches of one training pass sent through the swarm's training routes.

A pass (a mini-batch's forward+backward, or the forward-only pass that records the proximal
log-probs) is cut into micro-batches spread over the routes (data parallel across the
trainers' pipelines): token ids go to each route's first stage (``train_in``), targets, mask,
advantages and behaviour log-probs to its last stage (``train_out``). A micro-batch whose route
breaks — a node leaves, reports ``mb_failed`` or cannot be reached — is retried on another
route, up to ``MAX_MB_ATTEMPTS`` times; the whole pass has one deadline. ``last_refused`` says
whether a failed pass failed because nodes refused a micro-batch (its rows are bad) rather than
because a node left or was late.

What it does not know: the RL rules (``engine.rl.update`` made the batch), optimiser steps,
what a node does with a micro-batch.
"""

from __future__ import annotations

import asyncio
import logging
import math
import time
from collections import Counter
from dataclasses import dataclass

import numpy as np

from engine.rl.batch import TrainBatch
from engine.swarm import messages
from engine.swarm.rollout_checks import LOGPROB_ROUNDING
from engine.swarm.run_book import NodeLinks

log = logging.getLogger(__name__)

#: tries of one micro-batch (on different routes where there are several) before the pass fails
MAX_MB_ATTEMPTS = 3


@dataclass
class _InFlight:
    route: tuple[str, ...]
    future: asyncio.Future  #: resolves to ("done", detail), ("failed", reason) or ("refused", reason)


class MicrobatchDispatcher:
    """Runs passes of micro-batches over ``links.routes()`` and takes the nodes' reports on them."""

    def __init__(self, links: NodeLinks, counters: Counter[str], *, micro_batch_rows: int,
                 timeout_s: float) -> None:
        self.links, self.counters = links, counters
        self.micro_batch_rows, self.timeout_s = micro_batch_rows, timeout_s
        self._in_flight: dict[tuple[int, int, bool], _InFlight] = {}  #: (step, mb, forward only) -> its wait
        #: the last failed pass failed because nodes refused a micro-batch (not lost, not late)
        self.last_refused = False

    async def run(self, step: int, batch: TrainBatch, proximal: np.ndarray | None, *,
                  forward_only: bool = False) -> list[tuple[int, np.ndarray]] | None:
        """Send every micro-batch of ``batch`` and wait for all of them.

        Returns ``[(first_row, log-probs)]`` for a forward-only pass (``[]`` for a training
        pass) on success, None if the pass failed or ran past its deadline.
        """
        routes = self.links.routes()
        if not routes:
            return None
        rows = batch.num_rows
        per_mb = max(1, min(self.micro_batch_rows, math.ceil(rows / len(routes))))
        pending: dict[int, tuple[TrainBatch, int, int]] = {}  #: mb -> (micro-batch, attempts, first row)
        for mb, start in enumerate(range(0, rows, per_mb)):
            pending[mb] = (batch.rows(start, min(rows, start + per_mb)), 0, start)
        normaliser = float(max(batch.num_tokens, 1))
        deadline = time.monotonic() + self.timeout_s
        results: list[tuple[int, np.ndarray]] = []
        self.last_refused = False

        async def dispatch(mb: int, micro: TrainBatch, start: int, route: list[str]) -> None:
            waiting = _InFlight(tuple(route), asyncio.get_running_loop().create_future())
            self._in_flight[(step, mb, forward_only)] = waiting
            rows = None
            if proximal is not None:
                rows = np.round(proximal[start:start + micro.num_rows, :micro.inputs.shape[1]], 6).tolist()
            out = messages.TrainOut(step=step, mb=mb, route=route, targets=micro.targets.tolist(),
                                    mask=micro.mask.tolist(), behaviour=np.round(micro.behaviour, 6).tolist(),
                                    advantages=micro.advantages.tolist(), normaliser=normaliser, prox=forward_only,
                                    proximal=rows)
            sent = await self.links.send(route[0], messages.TrainIn(step=step, mb=mb, route=route,
                                                                    inputs=micro.inputs.tolist(), prox=forward_only))
            sent = sent and await self.links.send(route[-1], out)
            if not sent and not waiting.future.done():
                waiting.future.set_result(("failed", "route unreachable"))

        for i, mb in enumerate(sorted(pending)):
            micro, _, start = pending[mb]
            await dispatch(mb, micro, start, routes[i % len(routes)])
        try:
            while pending:
                remaining = deadline - time.monotonic()
                if remaining <= 0:
                    return None
                futures = [self._in_flight[(step, mb, forward_only)].future for mb in pending]
                done, _ = await asyncio.wait(futures, timeout=remaining, return_when=asyncio.FIRST_COMPLETED)
                if not done:
                    return None
                for mb in [m for m in pending if self._in_flight[(step, m, forward_only)].future.done()]:
                    status, detail = self._in_flight[(step, mb, forward_only)].future.result()
                    micro, attempts, start = pending.pop(mb)
                    if status == "done":
                        if forward_only:
                            results.append((start, detail))
                        continue
                    self.counters["retried_microbatches"] += 1
                    routes = self.links.routes()
                    if attempts + 1 >= MAX_MB_ATTEMPTS or not routes:
                        self.last_refused = status == "refused"
                        log.warning("micro-batch %d of step %d failed for good: %s", mb, step, detail)
                        return None
                    log.info("micro-batch %d of step %d failed (%s); retrying on another route", mb, step, detail)
                    pending[mb] = (micro, attempts + 1, start)
                    await dispatch(mb, micro, start, routes[(mb + attempts + 1) % len(routes)])
            return results
        finally:
            for key in [k for k in self._in_flight if k[0] == step and k[2] == forward_only]:
                del self._in_flight[key]

    # ------------------------------------------------------------------ node reports
    def _waiting(self, step: int, mb: int, forward_only: bool) -> _InFlight | None:
        waiting = self._in_flight.get((step, mb, forward_only))
        return None if waiting is None or waiting.future.done() else waiting

    def on_mb_done(self, sender: str, m: messages.MbDone) -> None:
        """The first stage finished the backward of a micro-batch."""
        waiting = self._waiting(m.step, m.mb, False)
        if waiting is not None and sender == waiting.route[0]:
            waiting.future.set_result(("done", ""))

    def on_prox_done(self, sender: str, m: messages.ProxDone) -> None:
        """The last stage returns a forward-only micro-batch's log-probs."""
        waiting = self._waiting(m.step, m.mb, True)
        if waiting is None or sender != waiting.route[-1]:
            return
        rows = m.logprobs
        if any(len(r) != len(rows[0]) for r in rows):
            waiting.future.set_result(("failed", "ragged proximal log-probs"))
            return
        if any(v > LOGPROB_ROUNDING for r in rows for v in r):
            waiting.future.set_result(("failed", "a positive proximal log-probability"))
            return
        waiting.future.set_result(("done", np.asarray(rows, dtype=np.float32)))

    def on_mb_failed(self, sender: str, m: messages.MbFailed) -> None:
        for forward_only in (False, True):
            waiting = self._waiting(m.step, m.mb, forward_only)
            if waiting is not None and sender in waiting.route:
                waiting.future.set_result(("refused", m.reason))

    def on_node_lost(self, peer_id: str) -> None:
        for waiting in list(self._in_flight.values()):
            if not waiting.future.done() and peer_id in waiting.route:
                waiting.future.set_result(("failed", f"node {peer_id} left"))
