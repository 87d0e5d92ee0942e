"""Which trainers answer their micro-batches: misses in a row, routes that isolate suspects, eviction.

A micro-batch that runs past its deadline is a *miss* for every trainer on its route: the
coordinator cannot see which hop stayed silent. A trainer is cleared (its misses reset) by any
micro-batch it completes, and the last stage of a route is cleared for a late micro-batch whose
loss it did report. A trainer with ``max_misses`` misses in a row is evicted
(``NodeLinks.evict``, through :meth:`RouteHealth.evict`, which the log-prob audit uses too) by a
miss that can only be its own: every other trainer blamed for it *vouched* for itself (it has
completed a micro-batch and had no miss since) and then completes one after that miss (one that
had worked may fall silent at that very micro-batch: without that, a hostile node that worked and
then went dark got an honest trainer with one earlier miss evicted in its place); meanwhile the
accused serves no route while its stage has other trainers. So an honest trainer paired in turn
with two silent ones that never worked (hostile nodes joining together) keeps its place, and the silent
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
        #: trainer at ``max_misses`` -> (the trainers that vouched beside it at its last miss and have
        #: not answered since, that miss); convicted when the set empties (bounded by the trainers)
        self._pending: dict[str, tuple[set[str], str]] = {}

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
        for gone in [p for p, (partners, _) in self._pending.items() if p not in live or partners - live]:
            del self._pending[gone]  # it left, or one that must answer for it did
        # a trainer awaiting conviction serves no route while its stage has others: its two misses
        # in a row make it the likely silent one, and its partners' next answers decide it
        replicas = [[p for p in ids if p not in self._pending] or ids for ids in replicas]
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
                ids[j] in failed, ids[j] in self._pending, self.misses[ids[j]], ids[j] not in self.proven,
                (j - turn) % len(ids)))
            route.append(ids[ranked[0]])
        return route

    def answered(self, peers: Iterable[str]) -> None:
        """These trainers completed a micro-batch: their misses start over, they are known to work,
        and a trainer whose last miss they vouched for is now convicted of it (evicted)."""
        peers = list(peers)
        for peer in peers:
            self.misses.pop(peer, None)
            self.proven.add(peer)
            self._pending.pop(peer, None)
        convicted = []
        for peer, (partners, why) in self._pending.items():
            partners.difference_update(peers)
            if not partners:
                convicted.append((peer, why))
        for peer, why in convicted:
            del self._pending[peer]
            self._evict_for_misses(peer, why)

    def missed(self, route: Sequence[str], why: str, *, cleared: Iterable[str] = ()) -> list[str]:
        """A micro-batch on ``route`` got no answer in time, or (a route of one) a trainer did not
        answer ``apply`` (``cleared``: trainers of it that did their part). Every other trainer is
        blamed. One reaching ``max_misses`` alone on the route is evicted now; beside others, only if
        each of them vouched for itself (it completed a micro-batch and had no miss since), and then
        once each has completed a micro-batch after this miss (:meth:`answered`): a trainer that had
        worked can fall silent at this very micro-batch, and only its answering again shows that the
        miss was not its own. Returns the trainers evicted now."""
        self.counters["missed_deadlines"] += 1
        self.answered(cleared)
        cleared = set(cleared)
        blamed = [peer for peer in dict.fromkeys(route) if peer not in cleared]
        vouched = {peer: peer in self.proven and not self.misses[peer] for peer in blamed}
        evicted = []
        for peer in blamed:
            self.misses[peer] += 1
        for peer in blamed:
            partners = {q for q in blamed if q != peer}
            if self.misses[peer] < self.max_misses or not all(vouched[q] for q in partners):
                continue
            if partners:
                self._pending[peer] = (partners, why)  # the latest miss that can convict it
            else:
                evicted.append(peer)
        for peer in evicted:
            self._evict_for_misses(peer, why)
        return evicted

    def _evict_for_misses(self, peer: str, why: str) -> None:
        self.counters["evicted_trainers"] += 1
        self.evict(peer, f"missed {self.max_misses} deadlines in a row (last: {why})")

    def evict(self, peer: str, why: str) -> None:
        """The one way a node leaves the routes for misbehaving: missed deadlines here, or gross
        log-prob mismatch (``engine.swarm.logprob_audit``)."""
        self.misses.pop(peer, None)
        self.proven.discard(peer)
        self._pending.pop(peer, None)
        # a miss beside it may have been its own: it convicts no one now (they stay suspects)
        for other in [p for p, (partners, _) in self._pending.items() if peer in partners]:
            del self._pending[other]
        log.warning("evicting %s: %s", peer, why)
        self.links.evict(peer, why)
