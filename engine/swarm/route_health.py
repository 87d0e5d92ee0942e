"""Which trainers answer their micro-batches: misses in a row, routes that isolate suspects, eviction.

A micro-batch that runs past its deadline is a *miss* for every trainer on its route: the
coordinator cannot see which hop stayed silent. A trainer is cleared (its misses reset) by any
micro-batch it completes, and the last stage of a route is cleared for a late micro-batch whose
loss it did report. A trainer with ``max_misses`` misses in a row is evicted
(``NodeLinks.evict``, through :meth:`RouteHealth.evict`, which the log-prob audit uses too) by a
miss that can only be its own: every other trainer blamed for it *vouched* for itself (it has
completed a micro-batch and had no miss since). So an honest trainer paired in turn with two
silent ones that never worked (hostile nodes joining together) keeps its place, and the silent
ones are evicted on the routes that pair them with trainers known to work. While no such trainer
exists (every route of a fresh swarm holds a silent one), nobody is evicted for deadlines. A
trainer that leaves and joins again keeps its misses (bounded, :data:`MAX_DEPARTED_REMEMBERED`)
and must prove itself anew.
:meth:`RouteHealth.routes` isolates suspects (trainers with misses): each gets a route of its
own whose other stages are clean trainers, where the stages hold enough of them; with no
suspects the routes are exactly ``NodeLinks.routes()`` (route r takes replica r of every stage).
A retried micro-batch goes, stage by stage, to a trainer off the route that missed, with the
fewest misses, known to work where one is.

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
#: departed trainers whose misses are kept, so that a silent one which drops its connection and
#: joins again resumes its count (a deaf node did, every ~20 s, and was never evicted); oldest go first
MAX_DEPARTED_REMEMBERED = 256


class RouteHealth:
    """Miss counts of the trainers of one run, and the training routes they imply."""

    def __init__(self, links: NodeLinks, counters: Counter[str], *, max_misses: int = MAX_MISSES) -> None:
        if max_misses < 1:
            raise ValueError("max_misses must be >= 1")
        self.links, self.counters, self.max_misses = links, counters, max_misses
        #: trainer -> micro-batch misses since its last completed one
        self.misses: Counter[str] = Counter()
        #: trainers that completed a micro-batch since they joined (bounded by the trainers present)
        self.proven: set[str] = set()

    def routes(self) -> list[list[str]]:
        """One route per replica of the widest stage; each suspect on a route of its own where the
        other stages have clean trainers to fill it (then every replica still serves on some route)."""
        replicas = self.links.stage_replicas()
        if not replicas or not all(replicas):
            return []
        live = {p for ids in replicas for p in ids}
        departed = [p for p in self.misses if p not in live]
        for gone in departed[:max(0, len(departed) - MAX_DEPARTED_REMEMBERED)]:
            del self.misses[gone]  # bounded; a rejoining trainer resumes its misses (but proves itself anew)
        self.proven &= live
        width = max(len(ids) for ids in replicas)
        routes: list[list[str]] = [[] for _ in range(width)]
        suspects_on = [0] * width  #: suspects placed on each route so far
        for ids in replicas:
            suspects = sorted((p for p in ids if self.misses[p]), key=lambda p: (-self.misses[p], p))
            clean = [p for p in ids if not self.misses[p]]
            if clean:
                slots: dict[int, str] = {}
                for p in suspects:  # each on the route holding the fewest suspects so far
                    slots[min((r for r in range(width) if r not in slots), key=lambda r: (suspects_on[r], r))] = p
                free = [r for r in range(width) if r not in slots]
                for j, r in enumerate(free):  # width - suspects >= clean replicas: each of them serves
                    slots[r] = clean[j % len(clean)]
                column = [slots[r] for r in range(width)]
            else:  # every replica of this stage is a suspect: they cannot be kept apart
                column = [suspects[r % len(suspects)] for r in range(width)]
            for r, p in enumerate(column):
                routes[r].append(p)
                suspects_on[r] += bool(self.misses[p])
        return routes

    def retry_route(self, missed: Sequence[str], turn: int) -> list[str] | None:
        """The route for a micro-batch that failed on ``missed``: per stage, a trainer not on it,
        then with the fewest misses, then one known to work (newcomers are tried on first attempts,
        not on retries); ``turn`` breaks ties (so successive retries rotate)."""
        replicas = self.links.stage_replicas()
        if not replicas or not all(replicas):
            return None
        failed = set(missed)
        route = []
        for ids in replicas:
            ranked = sorted(range(len(ids)), key=lambda j: (
                ids[j] in failed, self.misses[ids[j]], ids[j] not in self.proven, (j - turn) % len(ids)))
            route.append(ids[ranked[0]])
        return route

    def answered(self, peers: Iterable[str]) -> None:
        """These trainers completed a micro-batch: their misses start over, and they are known to work."""
        for peer in peers:
            self.misses.pop(peer, None)
            self.proven.add(peer)

    def missed(self, route: Sequence[str], why: str, *, cleared: Iterable[str] = ()) -> list[str]:
        """A micro-batch on ``route`` got no answer in time, or (a route of one) a trainer did not
        answer ``apply`` (``cleared``: trainers of it that did their part). Every other trainer is
        blamed; one reaching ``max_misses`` is evicted if each trainer blamed beside it vouched for
        itself (it completed a micro-batch and had no miss since). Returns the trainers evicted."""
        self.counters["missed_deadlines"] += 1
        self.answered(cleared)
        cleared = set(cleared)
        blamed = [peer for peer in dict.fromkeys(route) if peer not in cleared]
        vouched = {peer: peer in self.proven and not self.misses[peer] for peer in blamed}
        evicted = []
        for peer in blamed:
            self.misses[peer] += 1
            if self.misses[peer] >= self.max_misses and all(vouched[q] for q in blamed if q != peer):
                evicted.append(peer)
        for peer in evicted:
            self.counters["evicted_trainers"] += 1
            self.evict(peer, f"missed {self.max_misses} deadlines in a row (last: {why})")
        return evicted

    def evict(self, peer: str, why: str) -> None:
        """The one way a node leaves the routes for misbehaving: missed deadlines here, or gross
        log-prob mismatch (``engine.swarm.logprob_audit``)."""
        self.misses.pop(peer, None)
        self.proven.discard(peer)
        log.warning("evicting %s: %s", peer, why)
        self.links.evict(peer, why)
