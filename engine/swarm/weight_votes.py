"""Weight authority: full-weight hashes from every replica, majority decides, the coordinator names leaders.

Every trainer reports, with each ``stepped``, :func:`weights_digest` of its FULL trainable
weights (blake2b over every tensor's name, dtype, shape and bytes, names sorted). The
coordinator's :class:`WeightAuthority` then, per stage:

* takes the digest that a strict majority of the reporting replicas hold as the stage's weights;
  with no strict majority, the digest the members of the last majority still agree on when
  only replicas that joined since disagree (a trainer that loaded while training began is
  behind; it is resynced, it never takes the stage over); else nothing is decided, nobody is
  resynced, and the vote counts as a ``split`` (two incumbents cannot tell which is right);
* tells every replica outside the majority to resync from a majority member (``sync`` names the
  source and the digest its weights must have, so the follower checks what it is sent);
* evicts a replica that stays outside the majority for ``evict_after`` votes in a row (it ignored
  its resyncs); a replica a follower says served weights other than the majority digest loses the
  lead at once and is evicted when two followers say so (:meth:`WeightAuthority.refused`);
* names each stage's leader (it checkpoints the stage and streams weights to inference replicas):
  the best-ranked ready trainer of the last majority that no follower refused (the coordinator
  ranks by how many identities share its address, then admission order). Never "the smallest peer id", which anyone can
  win by generating keys.

What it cannot do: out-vote a colluding majority of one stage (out of scope), or catch a replica
that reports the majority's digest and never serves weights. What it does not know: sockets,
messages, tensors' meaning.
"""

from __future__ import annotations

import hashlib
import logging
from collections import Counter
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np

log = logging.getLogger(__name__)

#: hex characters of a weights digest (blake2b, 16 bytes)
DIGEST_CHARS = 32
#: most replicas remembered as distrusted (then the memory starts over)
MAX_DISTRUSTED = 4096
#: decided digests remembered per stage (an inference replica's full load may lag a few versions)
KEEP_VERSIONS = 8


def weights_digest(arrays: Mapping[str, np.ndarray]) -> str:
    """blake2b-128 of every named tensor as fp32 (name, shape, C-order bytes), names sorted.

    Equal iff the weights are bit-identical (up to a hash collision); costs one pass over the
    bytes (about 1 GB/s per core), so a stage of 100 M fp32 parameters takes ~0.4 s per step.
    """
    h = hashlib.blake2b(digest_size=DIGEST_CHARS // 2)
    for name in sorted(arrays):
        a = np.ascontiguousarray(arrays[name], dtype=np.float32)
        h.update(f"{name}\0{list(a.shape)}\0".encode())
        h.update(a.data.cast("B"))  # the array's own buffer: no copy
    return h.hexdigest()


@dataclass(frozen=True)
class Vote:
    """What one stage's vote decided.

    majority: the digest a strict majority holds (None: no strict majority).
    resync: ``(peer, source)`` for each replica outside the majority and the member it fetches from.
    evict: replicas to evict now (outside the majority ``evict_after`` votes in a row).
    """

    majority: str | None
    resync: list[tuple[str, str]] = field(default_factory=list)
    evict: list[str] = field(default_factory=list)


class WeightAuthority:
    """The coordinator's per-stage leaders and digest votes (pure bookkeeping, no I/O)."""

    def __init__(self, evict_after: int = 3) -> None:
        self.evict_after = evict_after
        self._leaders: dict[int, str] = {}
        #: the members of each stage's last strict majority
        self._majority: dict[int, set[str]] = {}
        #: consecutive votes each replica was outside its stage's majority
        self._outvoted: Counter[str] = Counter()
        #: replicas a follower refused weights from (they lead only when no one else can)
        self.distrusted: set[str] = set()
        #: stage -> {version: the majority's digest} of the last ``KEEP_VERSIONS`` decided votes
        self._decided: dict[int, dict[int, str]] = {}
        #: follower -> the source its last ``sync`` named
        self._asked: dict[str, str] = {}
        #: source -> the followers that refused weights it served
        self._refusers: dict[str, set[str]] = {}
        #: what the stats API shows: votes, splits, resyncs, evictions, refused transfers
        self.counters: Counter[str] = Counter()

    def leader(self, stage: int, trainers: Sequence[tuple[Any, str]]) -> str | None:
        """The leader of ``stage`` among its ready ``trainers`` given as ``(rank, peer_id)`` (lowest
        rank first: the coordinator ranks by identities at the same address, then admission time).

        The best-ranked of the last majority that no follower refused; else of the last majority;
        else of all. Ranks only change when nodes come and go, so the lead does not flap.
        """
        majority = self._majority.get(stage)
        in_majority = [(t, p) for t, p in trainers if not majority or p in majority]
        pool = [(t, p) for t, p in in_majority if p not in self.distrusted] or in_majority or list(trainers)
        current = self._leaders.get(stage)
        if not pool:
            self._leaders.pop(stage, None)
            return None
        chosen = min(pool)[1]
        if chosen != current:
            log.info("stage %d is led by %s now (was %s)", stage, chosen, current)
        self._leaders[stage] = chosen
        return chosen

    def leaders(self) -> dict[int, str]:
        """The leader last named for each stage."""
        return dict(self._leaders)

    def vote(self, stage: int, digests: Mapping[str, str | None], version: int = 0) -> Vote:
        """Tally one step's ``{peer: digest}`` of ``stage`` at ``version`` (None: a replica that sent no digest)."""
        reported = {p: d for p, d in digests.items() if d}
        if len(reported) < 2:  # a lone replica's digest is the stage's (nobody to disagree with)
            only = next(iter(reported.values()), None)
            if only is not None:
                self._majority[stage] = set(reported)
                self._decide(stage, version, only)
            return Vote(majority=only)
        self.counters["votes"] += 1
        (top, count), = Counter(reported.values()).most_common(1)
        if 2 * count <= len(reported):
            incumbent = self._incumbents_digest(stage, reported)
            if incumbent is None:
                self.counters["splits"] += 1
                log.warning("stage %d: no majority among %d replicas' weights; nothing resynced", stage,
                            len(reported))
                return Vote(majority=None)
            self.counters["incumbent_decisions"] += 1
            top = incumbent
        members = sorted(p for p, d in reported.items() if d == top)
        self._majority[stage] = set(members)
        self._decide(stage, version, top)
        leader = self._leaders.get(stage)
        trusted = [p for p in members if p not in self.distrusted]
        resync, evict = [], []
        for peer in sorted(reported):
            if reported[peer] == top:
                self._outvoted.pop(peer, None)
                continue
            self._outvoted[peer] += 1
            if self._outvoted[peer] >= self.evict_after:
                evict.append(peer)
                self.counters["evicted"] += 1
                log.warning("stage %d: %s stayed outside the majority for %d votes; evicting", stage, peer,
                            self._outvoted[peer])
            else:
                sources = [p for p in trusted if peer not in self._refusers.get(p, ())]
                if sources:
                    source = leader if leader in sources else sources[0]
                    resync.append((peer, source))
                    self._asked[peer] = source
                    self.counters["resyncs"] += 1
        return Vote(majority=top, resync=resync, evict=evict)

    def _incumbents_digest(self, stage: int, reported: Mapping[str, str]) -> str | None:
        """With no strict majority: the digest every reporting member of the stage's last
        majority agrees on, where replicas that joined since (never in a majority) hold
        another. A trainer that finished loading after training began holds weights some
        versions old; with two replicas it would split every vote for good. The newcomers are
        resynced from the incumbents, never the other way round, so a joining node cannot
        take a stage over; incumbents that disagree among themselves decide nothing. Before
        the stage's first majority the named leader is the incumbent (two replicas that split
        at their very first vote, one of them a step behind, would otherwise never agree)."""
        # before any majority: the named leader (the earliest admitted trainer) is the incumbent
        last = self._majority.get(stage) or ({self._leaders[stage]} if stage in self._leaders else set())
        incumbents = {reported[p] for p in reported if p in last}
        newcomers = [p for p in reported if p not in last]
        if len(incumbents) != 1 or not newcomers:
            return None
        return next(iter(incumbents))

    def _decide(self, stage: int, version: int, digest: str) -> None:
        self._decided.setdefault(stage, {})[version] = digest
        while len(self._decided[stage]) > KEEP_VERSIONS:
            del self._decided[stage][min(self._decided[stage])]

    def decided(self, stage: int, version: int) -> str | None:
        """The digest the swarm agreed ``stage`` has at ``version`` (the lone replica's, or a strict
        majority's), if that is among the last ``KEEP_VERSIONS`` decided; None otherwise."""
        return self._decided.get(stage, {}).get(version)

    def refused(self, source: str, follower: str) -> bool:
        """``follower``, told to resync from ``source``, says what it got did not hash to the majority.

        A follower's word is not proof (it may lie to unseat an honest replica), so one refusal only
        costs ``source`` the lead (it is not chosen again while another majority member is) and its
        place as that follower's resync source; refusals from two different followers evict it
        (True). A refusal of a source the follower was not sent to is ignored.
        """
        if self._asked.get(follower) != source:
            self.counters["refusals_ignored"] += 1
            return False
        del self._asked[follower]
        self.counters["refused_transfers"] += 1
        if len(self.distrusted) >= MAX_DISTRUSTED:  # bounded: identities are cheap
            self.distrusted.clear()
            self._refusers.clear()
        self._refusers.setdefault(source, set()).add(follower)
        self.distrusted.add(source)
        for stage, leader in list(self._leaders.items()):
            if leader == source:
                del self._leaders[stage]
        if len(self._refusers[source]) >= 2:
            self.counters["evicted"] += 1
            return True
        return False

    def served(self, stage: int, version: int, digest: str, source: str) -> bool:
        """An inference replica loaded full weights of ``version`` from ``source`` that hash to
        ``digest``; False (and ``source`` loses the lead) when the majority decided otherwise. Like a
        refusal, a replica's report is not proof, so it costs ``source`` only the lead."""
        decided = self._decided.get(stage, {}).get(version)
        if decided is None or decided == digest:
            return True
        self.counters["served_mismatch"] += 1
        self.distrusted.add(source)
        if self._leaders.get(stage) == source:
            del self._leaders[stage]
        return False

    def forget(self, peer: str) -> None:
        """``peer`` left: it leads nothing and its strikes go (``distrusted`` stays: a rejoin is not trust)."""
        self._outvoted.pop(peer, None)
        self._asked.pop(peer, None)
        for stage in [s for s, p in self._leaders.items() if p == peer]:
            del self._leaders[stage]
        for members in self._majority.values():
            members.discard(peer)
