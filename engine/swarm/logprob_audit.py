"""Audit of generators' behaviour log-probs against the proximal pass (a cheap TOPLOC-like check).

With several updates per batch the coordinator runs a forward-only *proximal* pass over every
row of the batch (``engine.swarm.step_runner``). Those log-probs ``p`` come from the trainers'
current weights; the behaviour log-probs ``b`` were reported by the node that sampled the row
(its generation route's last stage). An honest sampler's ``b`` differs from ``p`` only by the
policy's drift over the rollout's staleness and by activation encodings (bf16, int8), a few
hundredths to tenths of a nat per token on average; a forged ``b`` (e.g. ``-40`` on every token, to blow
up ``exp(p - b)``) differs by nats. So, per generator and pass:

* the proximal rows of a generator run on a route whose last stage is *another* node
  (:func:`route_avoiding`; with one replica per last stage no such route exists: the rows are
  counted as unchecked and logged, never failed);
* its mismatch is the mean ``|b - p|`` over its rows' unmasked tokens (:func:`mismatch_by_generator`);
* a pass with mismatch above ``GROSS_MISMATCH_NATS`` is *gross*: its rows are not trained on, and
  its score ``s <- SCORE_DECAY * s + 1`` (``s <- SCORE_DECAY * s`` on an honest pass);
* a score of ``EVICT_SCORE`` (two gross passes in a row, or with one honest pass between) evicts
  the generator through the routes' eviction path (``RouteHealth.evict``).

The check assumes the replicas it compares hold the majority's weights (the weight votes of
``engine.swarm.weight_votes`` resync any that drift within a step): a generator whose route
used a replica that diverged is blamed for that replica's weights until it is resynced.

What it does not know: how routes are formed, websockets, the RL objective.
"""

from __future__ import annotations

import logging
from collections import Counter
from dataclasses import dataclass
from typing import Callable, Sequence

import numpy as np

from engine.rl.batch import RowSource, TrainBatch

log = logging.getLogger(__name__)

#: mean |b - p| (nats per token) above which a generator's rows of one pass are a gross mismatch.
#: Honest spread measured on the tiny model over real processes: at most 0.17 (one stage, three
#: replicas, tests/integration/test_trust_weights_swarm.py, 10 passes) and 0.09 (two stages, int8
#: activations, tests/integration/test_trust_tickets_swarm.py); those tests fail above a quarter of
#: this. Forged b = -40 misses by ~39. A forgery under the limit moves exp(p - b) by at most e^2,
#: which the objective's truncated importance weight bounds anyway.
GROSS_MISMATCH_NATS = 2.0
#: a generator's score decays by this factor every pass that checks it
SCORE_DECAY = 0.5
#: score at which a generator is evicted: two gross passes in a row (1 * 0.5 + 1 = 1.5), or two
#: with one honest pass between them (1 * 0.25 + 1); an isolated one decays away
EVICT_SCORE = 1.25
#: generators remembered at most (the oldest-checked are forgotten first)
MAX_GENERATORS = 4096


def row_generators(minibatches: Sequence[TrainBatch], minibatch_groups: Sequence[Sequence[int]],
                   generators: Sequence[Sequence[str | None]]) -> list[list[str | None]]:
    """Per mini-batch, the generator of each of its rows (``generators[g][s]``: of sample s of group g),
    from the rows' sources (``TrainBatch.sources``: the group of the mini-batch's and its samples).
    A packed row whose samples came from different generators, or a row of unknown source, is
    attributed to nobody (None) rather than to the wrong node."""
    out = []
    for batch, members in zip(minibatches, minibatch_groups):
        sources: Sequence[RowSource | None] = batch.sources or [None] * batch.num_rows
        gens: list[str | None] = []
        for source in sources:
            names = set() if source is None else {generators[members[source[0]]][s] for s in source[1]}
            gens.append(names.pop() if len(names) == 1 else None)
        out.append(gens)
    return out


def route_avoiding(routes: Sequence[Sequence[str]], generator: str | None, turn: int) -> tuple[list[str], bool]:
    """A route whose last stage is not ``generator`` (``turn`` rotates among them), and whether
    there was one (False: every route ends at ``generator``, the check cannot be independent)."""
    others = [list(r) for r in routes if generator is None or r[-1] != generator]
    if others:
        return others[turn % len(others)], True
    return list(routes[turn % len(routes)]), False


def mismatch_by_generator(behaviour: np.ndarray, proximal: np.ndarray, mask: np.ndarray,
                          generators: Sequence[str | None], checked: np.ndarray) -> dict[str, tuple[float, int]]:
    """Per generator: (sum of |b - p| over its checked rows' unmasked tokens, those tokens)."""
    diff = np.where(mask, np.abs(behaviour.astype(np.float64) - proximal.astype(np.float64)), 0.0)
    out: dict[str, tuple[float, int]] = {}
    for r, gen in enumerate(generators):
        if gen is None or not checked[r]:
            continue
        total, tokens = out.get(gen, (0.0, 0))
        out[gen] = (total + float(diff[r].sum()), tokens + int(mask[r].sum()))
    return out


@dataclass
class GeneratorScore:
    """What the audit knows about one generator."""

    score: float = 0.0  #: decayed count of gross passes
    last_mismatch_nats: float = 0.0  #: mean |b - p| of its last checked pass
    max_mismatch_nats: float = 0.0  #: the largest of those
    checks: int = 0  #: passes that checked it
    gross: int = 0  #: of those, gross ones


class LogprobAudit:
    """Mismatch scores of every generator of one run; evicts on repeated gross mismatch."""

    def __init__(self, evict: Callable[[str, str], object], counters: Counter[str], *,
                 gross_nats: float = GROSS_MISMATCH_NATS, decay: float = SCORE_DECAY,
                 evict_score: float = EVICT_SCORE) -> None:
        if gross_nats <= 0 or not 0 <= decay < 1 or evict_score <= 1:
            raise ValueError("need gross_nats > 0, 0 <= decay < 1, evict_score > 1")
        self.evict, self.counters = evict, counters
        self.gross_nats, self.decay, self.evict_score = gross_nats, decay, evict_score
        self.scores: dict[str, GeneratorScore] = {}

    def record(self, by_generator: dict[str, tuple[float, int]]) -> set[str]:
        """One pass's sums (see :func:`mismatch_by_generator`); returns the generators whose rows
        mismatched grossly (the caller does not train on them)."""
        gross = set()
        for gen, (total, tokens) in sorted(by_generator.items()):
            if tokens == 0:
                continue
            mean = total / tokens
            entry = self.scores.pop(gen, None) or GeneratorScore()
            self.scores[gen] = entry  # re-inserted last: the dict's order is least recently checked first
            entry.checks += 1
            entry.last_mismatch_nats = mean
            entry.max_mismatch_nats = max(entry.max_mismatch_nats, mean)
            entry.score *= self.decay
            self.counters["audited_generator_passes"] += 1
            if mean <= self.gross_nats:
                continue
            gross.add(gen)
            entry.gross += 1
            entry.score += 1.0
            self.counters["logprob_mismatches"] += 1
            log.warning("generator %s: behaviour log-probs differ from the proximal pass by %.3f nats per token "
                        "(limit %.2f); its rows are not trained on", gen, mean, self.gross_nats)
            if entry.score >= self.evict_score:
                self.counters["evicted_generators"] += 1
                entry.score = 0.0
                self.evict(gen, f"its behaviour log-probs missed the proximal pass by {mean:.2f} nats per token "
                                f"{entry.gross} times (limit {self.gross_nats:g})")
        while len(self.scores) > MAX_GENERATORS:
            del self.scores[next(iter(self.scores))]
        return gross

    def snapshot(self) -> dict[str, dict[str, float | int]]:
        """Per generator, for the stats API."""
        return {gen: {"score": round(e.score, 3), "last_mismatch_nats": round(e.last_mismatch_nats, 4),
                      "max_mismatch_nats": round(e.max_mismatch_nats, 4), "checks": e.checks, "gross": e.gross}
                for gen, e in self.scores.items()}
