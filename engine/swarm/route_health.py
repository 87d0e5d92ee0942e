"""Which trainers answer their micro-batches: misses in a row, routes that isolate suspects, eviction.

A micro-batch that runs past its deadline is a *miss* for every trainer on its route: the
coordinator cannot see which hop stayed silent. A trainer is cleared (its misses reset) by any
micro-batch it completes, and the last stage of a route is cleared for a late micro-batch whose
loss it did report. A trainer with ``max_misses`` misses in a row is evicted
(``NodeLinks.evict``, through :meth:`RouteHealth.evict`, which the log-prob audit uses too). An
honest trainer that shared a route with a silent one is cleared on its next route, because
:meth:`RouteHealth.routes` pairs each suspect (a trainer with misses) with clean trainers of the
other stages: with no suspects the routes are exactly ``NodeLinks.routes()`` (route r takes
replica r of every stage), and each suspect shifts the suspects of the later stages onto other
routes. A retried micro-batch goes to the route that shares the fewest trainers with the one
that missed.

What it does not know: micro-batches' contents, steps, websockets, why a trainer is silent.
"""

from __future__ import annotations

import logging
from collections import Counter
from collections.abc import Iterable, Sequence

from engine.swarm.run_book import NodeLinks

log = logging.getLogger(__name__)

#: micro-batch misses in a row (no completed micro-batch in between) that evict a trainer
MAX_MISSES = 2


class RouteHealth:
    """Miss counts of the trainers of one run, and the training routes they imply."""

    def __init__(self, links: NodeLinks, counters: Counter[str], *, max_misses: int = MAX_MISSES) -> None:
        if max_misses < 1:
            raise ValueError("max_misses must be >= 1")
        self.links, self.counters, self.max_misses = links, counters, max_misses
        #: trainer -> micro-batch misses since its last completed one
        self.misses: Counter[str] = Counter()

    def routes(self) -> list[list[str]]:
        """One route per replica of the widest stage; suspects spread over different routes."""
        replicas = self.links.stage_replicas()
        if not replicas or not all(replicas):
            return []
        live = {p for ids in replicas for p in ids}
        for gone in [p for p in self.misses if p not in live]:
            del self.misses[gone]  # bounded by the trainers present
        width = max(len(ids) for ids in replicas)
        columns: list[tuple[list[str], int]] = []
        shift = 0
        for ids in replicas:
            suspects = sorted((p for p in ids if self.misses[p]), key=lambda p: (-self.misses[p], p))
            ordered = suspects + [p for p in ids if not self.misses[p]]
            columns.append((ordered, shift))
            shift += len(suspects)
        return [[ordered[(r - s) % len(ordered)] for ordered, s in columns] for r in range(width)]

    def retry_route(self, missed: Sequence[str], turn: int) -> list[str] | None:
        """The route for a micro-batch that failed on ``missed``: fewest shared trainers, then
        fewest misses; ``turn`` breaks ties (so successive retries rotate)."""
        routes = self.routes()
        if not routes:
            return None
        failed = set(missed)
        ranked = sorted(range(len(routes)), key=lambda i: (
            len(failed & set(routes[i])), sum(self.misses[p] for p in routes[i]), (i - turn) % len(routes)))
        return routes[ranked[0]]

    def answered(self, peers: Iterable[str]) -> None:
        """These trainers completed a micro-batch: their misses start over."""
        for peer in peers:
            self.misses.pop(peer, None)

    def missed(self, route: Sequence[str], why: str, *, cleared: Iterable[str] = ()) -> list[str]:
        """A micro-batch on ``route`` got no answer in time, or (a route of one) a trainer did not
        answer ``apply`` (``cleared``: trainers of it that did their part). Returns the trainers
        evicted for it."""
        self.counters["missed_deadlines"] += 1
        self.answered(cleared)
        cleared = set(cleared)
        evicted = []
        for peer in dict.fromkeys(route):
            if peer in cleared:
                continue
            self.misses[peer] += 1
            if self.misses[peer] >= self.max_misses:
                evicted.append(peer)
        for peer in evicted:
            self.counters["evicted_trainers"] += 1
            self.evict(peer, f"missed {self.max_misses} deadlines in a row (last: {why})")
        return evicted

    def evict(self, peer: str, why: str) -> None:
        """The one way a node leaves the routes for misbehaving: missed deadlines here, or gross
        log-prob mismatch (``engine.swarm.logprob_audit``)."""
        self.misses.pop(peer, None)
        log.warning("evicting %s: %s", peer, why)
        self.links.evict(peer, why)
