"""Micro-batches of one training pass sent through the swarm's training routes.

A pass (a mini-batch's forward+backward, or the forward-only pass that records the proximal
log-probs) is cut into micro-batches spread over the routes (data parallel across the
trainers' pipelines): token ids go to each route's first stage (``train_in``), targets, mask,
advantages and behaviour log-probs to its last stage (``train_out``). Every micro-batch has its
own deadline: ``mb_timeout_s`` for each micro-batch of the pass queued on its route before it and
itself (a route's trainers work through them in turn); the whole pass has one too (``timeout_s``). A micro-batch whose
route breaks — a node leaves, reports ``mb_failed``, cannot be reached, or misses the
micro-batch deadline — is retried on another route (``engine.swarm.route_health`` picks it, and
counts misses: a trainer that stays silent is evicted after a few, so it costs the run a
micro-batch deadline or two, not every step), up to ``MAX_MB_ATTEMPTS`` tries. When one misses
its deadline, those queued behind it on that route are retried at once, without a miss of their
own (they wait on the same silent hop: one silent trainer costs a pass one deadline, and its
honest partner one miss, not one per micro-batch queued there). Each route's
share of a pass's rows follows its measured rows per second (``engine.swarm.route_weights``), so a
slow trainer gets fewer rows instead of holding the pass; the tokens each trainer trained are
counted (``take_trained_tokens``) for the step's ``apply``, whose aggregation weighs replicas by them, and
every completed micro-batch is credited to its route's trainers (``engine.swarm.credit``). ``last_refused``
says whether a failed pass failed because nodes refused a micro-batch (its rows are bad) rather
than because a node left or was late.

A micro-batch answered late on its first route after it was re-dispatched is not undone on that
route: that route's trainers keep its gradient, so it counts twice in that step (bounded: once
per re-dispatch; a silent trainer, the case deadlines are for, never answers).

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
from typing import Sequence

import numpy as np

from engine.rl.batch import TrainBatch
from engine.swarm import messages
from engine.swarm.credit import Credit
from engine.swarm.logprob_audit import route_avoiding
from engine.swarm.rollout_checks import LOGPROB_ROUNDING
from engine.swarm.route_health import RouteHealth
from engine.swarm.route_weights import RouteWeights
from engine.swarm.run_book import NodeLinks

log = logging.getLogger(__name__)

#: tries of one micro-batch (on different routes where there are several) before the pass fails
MAX_MB_ATTEMPTS = 3


def _cuts(rows: int, per_mb: int, avoid: Sequence[object] | None) -> list[tuple[int, int]]:
    """Row ranges of the micro-batches: ``per_mb`` rows at most, and (with ``avoid``: per row a
    node to avoid, or a route to pin) never two different values of it in one."""
    cuts, start = [], 0
    while start < rows:
        stop = min(rows, start + per_mb)
        if avoid is not None:
            stop = next((r for r in range(start + 1, stop) if avoid[r] != avoid[start]), stop)
        cuts.append((start, stop))
        start = stop
    return cuts


@dataclass
class _InFlight:
    route: tuple[str, ...]
    future: asyncio.Future  #: resolves to ("done", detail), ("failed" | "refused" | "late", reason)
    due: float  #: monotonic time of its deadline
    loss_reported: bool = False  #: the route's last stage reported this micro-batch's loss


class MicrobatchDispatcher:
    """Runs passes of micro-batches over ``links.routes()`` and takes the nodes' reports on them."""

    def __init__(self, links: NodeLinks, counters: Counter[str], *, micro_batch_rows: int,
                 timeout_s: float, mb_timeout_s: float | None = None, credit: Credit | None = None) -> None:
        self.links, self.counters = links, counters
        #: verified credit: every trainer of a route that completed a micro-batch (``RunBook.credit``)
        self.credit = Credit() if credit is None else credit
        self.micro_batch_rows, self.timeout_s = micro_batch_rows, timeout_s
        self.mb_timeout_s = timeout_s if mb_timeout_s is None else min(mb_timeout_s, timeout_s)
        self.health = RouteHealth(links, counters)
        #: training routes' measured rows per second: each route's share of a pass's rows
        self.weights = RouteWeights()
        #: trainer -> tokens of the micro-batches it trained since the last ``take_trained_tokens``
        self.trained_tokens: Counter[str] = Counter()
        self._in_flight: dict[tuple[int, int, bool], _InFlight] = {}  #: (step, mb, forward only) -> its wait
        #: the last failed pass failed because nodes refused a micro-batch (not lost, not late)
        self.last_refused = False

    async def run(self, step: int, batch: TrainBatch, proximal: np.ndarray | None, *,
                  forward_only: bool = False, avoid: Sequence[str | None] | None = None,
                  pinned: Sequence[tuple[str, ...]] | None = None,
                  ) -> list[tuple[int, np.ndarray, tuple[str, ...]]] | None:
        """Send every micro-batch of ``batch`` and wait for all of them.

        ``avoid``: per row, a node that should not be the last stage of its route (the log-prob
        audit keeps a row's generator off the route that checks it; rows with the same one
        should be contiguous, micro-batches are cut where it changes; see :func:`_cuts`).
        ``pinned``: per row, the route that should train it (DiLoCo: the route whose weights
        gave the row's proximal log-probs, as routes differ between syncs; rows with the same
        route contiguous); a row whose route is gone goes to another, as a retry does.

        Returns ``[(first_row, log-probs, route that answered)]`` for a forward-only pass (``[]``
        for a training pass) on success, None if the pass failed or ran past its deadline.
        """
        routes = self.health.routes()
        if not routes:
            return None
        rows = batch.num_rows
        per_mb = batch.rows_for_samples(self.micro_batch_rows)  # a packed row holds a group's samples
        pending: dict[int, tuple[TrainBatch, int, int]] = {}  #: mb -> (micro-batch, attempts, first row)
        first_route: dict[int, list[str]] = {}
        if pinned is not None:  # each micro-batch on its rows' route while that route is healthy
            healthy = {tuple(r) for r in routes}
            for mb, (start, stop) in enumerate(_cuts(rows, per_mb, pinned)):
                pending[mb] = (batch.rows(start, stop), 0, start)
                first_route[mb] = (list(pinned[start]) if tuple(pinned[start]) in healthy
                                   else route_avoiding(routes, None, mb)[0])
        elif avoid is None:  # each route's share of the rows follows its measured rows/s (engine.swarm.route_weights)
            for mb, (start, stop, route) in enumerate(self.weights.split_rows(routes, rows, per_mb)):
                pending[mb] = (batch.rows(start, stop), 0, start)
                first_route[mb] = route
        else:  # the audit's pass: each micro-batch on a route that does not end at its rows' generator
            for mb, (start, stop) in enumerate(_cuts(rows, max(1, min(per_mb, math.ceil(rows / len(routes)))),
                                                     avoid)):
                pending[mb] = (batch.rows(start, stop), 0, start)
                first_route[mb] = route_avoiding(routes, avoid[start], mb)[0]
        route_rows: Counter[tuple[str, ...]] = Counter()  #: rows each route finished in this pass
        route_span: dict[tuple[str, ...], list[float]] = {}  #: its first dispatch, its last one done
        normaliser = float(max(batch.num_tokens, 1))
        deadline = time.monotonic() + self.timeout_s
        results: list[tuple[int, np.ndarray, tuple[str, ...]]] = []
        self.last_refused = False

        async def dispatch(mb: int, micro: TrainBatch, start: int, route: list[str]) -> None:
            # a route's trainers run its micro-batches one after another: the k-th queued there gets k+1 deadlines
            queued = sum(1 for key, w in self._in_flight.items() if key[0] == step and key[2] == forward_only
                         and w.route == tuple(route) and not w.future.done())
            waiting = _InFlight(tuple(route), asyncio.get_running_loop().create_future(),
                                due=time.monotonic() + self.mb_timeout_s * (1 + queued))
            self._in_flight[(step, mb, forward_only)] = waiting
            route_span.setdefault(tuple(route), [time.monotonic()] * 2)
            rows = None
            if proximal is not None:
                rows = np.round(proximal[start:start + micro.num_rows, :micro.inputs.shape[1]], 6).tolist()
            per_token = micro.advantages.ndim == 2
            out = messages.TrainOut(step=step, mb=mb, route=route, targets=micro.targets.tolist(),
                                    mask=micro.mask.tolist(), behaviour=np.round(micro.behaviour, 6).tolist(),
                                    advantages=[] if per_token else micro.advantages.tolist(),
                                    token_advantages=micro.advantages.tolist() if per_token else None,
                                    normaliser=normaliser, prox=forward_only, proximal=rows)
            sent = await self.links.send(route[0], messages.TrainIn(step=step, mb=mb, route=route,
                                                                    inputs=micro.inputs.tolist(), prox=forward_only,
                                                                    segments=micro.segment_list()))
            sent = sent and await self.links.send(route[-1], out)
            if not sent and not waiting.future.done():
                waiting.future.set_result(("failed", "route unreachable"))

        def waiting_for(mb: int) -> _InFlight:
            return self._in_flight[(step, mb, forward_only)]

        for mb in sorted(pending):
            micro, _, start = pending[mb]
            await dispatch(mb, micro, start, first_route[mb])
        try:
            while pending:
                now = time.monotonic()
                if now >= deadline:
                    log.warning("step %d: the pass ran past its %.0f s deadline", step, self.timeout_s)
                    return None
                due = min(waiting_for(mb).due for mb in pending)
                futures = [waiting_for(mb).future for mb in pending]
                await asyncio.wait(futures, timeout=max(0.0, min(deadline, due) - now),
                                   return_when=asyncio.FIRST_COMPLETED)
                now = time.monotonic()
                broken = set()  #: routes with a micro-batch that just missed its deadline
                for mb in pending:
                    late = waiting_for(mb)
                    if not late.future.done() and now >= late.due:
                        late.future.set_result(("late", f"no answer within {self.mb_timeout_s:g} s"))
                        broken.add(late.route)
                for mb in pending:  # those queued behind it there wait on the same silent hop: retried now,
                    behind = waiting_for(mb)  # not counted as misses of their own
                    if not behind.future.done() and behind.route in broken:
                        behind.future.set_result(("failed", "queued behind a micro-batch that missed its deadline"))
                retries = []  # every outcome is recorded first, so a retry avoids every trainer that just missed
                for mb in [m for m in pending if waiting_for(m).future.done()]:
                    finished = waiting_for(mb)
                    status, detail = finished.future.result()
                    micro, attempts, start = pending.pop(mb)
                    if status == "done":
                        self.health.answered(finished.route)
                        self.credit.add(finished.route, **{"microbatches_forward" if forward_only
                                                           else "microbatches_trained": 1})
                        route_rows[finished.route] += micro.num_rows
                        route_span[finished.route][1] = time.monotonic()
                        if not forward_only:
                            for peer in finished.route:
                                self.trained_tokens[peer] += micro.num_tokens
                        if forward_only:
                            results.append((start, detail, finished.route))
                        continue
                    if status == "late":
                        cleared = finished.route[-1:] if finished.loss_reported else ()
                        self.health.missed(finished.route, f"step {step} micro-batch {mb}", cleared=cleared)
                    retries.append((mb, micro, attempts, start, finished.route, status, detail))
                for mb, micro, attempts, start, missed, status, detail in retries:
                    self.counters["retried_microbatches"] += 1
                    retry = self.health.retry_route(missed, mb + attempts + 1)
                    if attempts + 1 >= MAX_MB_ATTEMPTS or retry is None:
                        self.last_refused = status == "refused"
                        log.warning("micro-batch %d of step %d failed for good: %s", mb, step, detail)
                        return None
                    log.info("micro-batch %d of step %d failed on %s (%s); retrying on %s", mb, step,
                             list(missed), detail, retry)
                    pending[mb] = (micro, attempts + 1, start)
                    await dispatch(mb, micro, start, retry)
            for trained, done_rows in route_rows.items():
                self.weights.train_done(trained, done_rows, route_span[trained][1] - route_span[trained][0])
            return results
        finally:
            for key in [k for k in self._in_flight if k[0] == step and k[2] == forward_only]:
                del self._in_flight[key]

    def take_trained_tokens(self) -> Counter[str]:
        """Tokens each trainer trained in the passes since the last call (the step's shares)."""
        taken, self.trained_tokens = self.trained_tokens, Counter()
        return taken

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

    def on_mb_loss(self, sender: str, m: messages.MbLoss) -> None:
        """The last stage computed a training micro-batch's loss: it did its part."""
        waiting = self._waiting(m.step, m.mb, False)
        if waiting is not None and sender == waiting.route[-1]:
            waiting.loss_reported = True

    def on_mb_failed(self, sender: str, m: messages.MbFailed) -> None:
        for forward_only in (False, True):
            waiting = self._waiting(m.step, m.mb, forward_only)
            if waiting is not None and sender in waiting.route:
                waiting.future.set_result(("refused", m.reason))

    def on_node_lost(self, peer_id: str) -> None:
        for waiting in list(self._in_flight.values()):
            if not waiting.future.done() and peer_id in waiting.route:
                waiting.future.set_result(("failed", f"node {peer_id} left"))
