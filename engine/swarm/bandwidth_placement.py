"""Where nodes on slow uplinks serve: measured uplinks against each stage's bytes per version.

Every node reports its measured uplink (``uplink_mbps``: the fastest one of its links sent while
kept busy and the path, not the node, set the pace: the link congestion controller's
``path_rate``; ``uplink_floor_mbps``: the fastest any link sent, a lower bound) and may claim one in
its hello (its user's upload cap).
:class:`UplinkBook` keeps them; a measurement replaces a claim.

A trainer of stage s, one of k, uploads ``StageTraffic.upload_bytes(s, k)`` per version
(``engine.swarm.stage_traffic``), so its uploads take ``upload_s = bytes / uplink`` seconds of
each version. Its uplink *binds* when that exceeds ``NETWORK_SHARE`` of the swarm's measured
seconds per version (``DEFAULT_VERSION_S`` before any): boundary traffic is on the pipeline's
critical path (the next stage waits for the activations), so such a node holds its stage back.
The policy (pure functions over those figures):

* a joining trainer whose uplink is known and would bind where the compute rules put it goes
  where its upload time is least among the stages that keep every stage served (the last stage
  sends gradients and tokens, not activations; a stage with more trainers splits its boundary
  traffic over more of them: an extra replica rather than the only holder of a heavy stage);
* :meth:`BandwidthPlacement.propose_move` (checked while the run goes): a ready trainer whose
  measured uplink binds (the slowest first) moves to another stage -- swapping with a trainer
  there whose uplink is at least ``PARTNER_FASTER`` times its own, or alone if its stage keeps a
  trainer -- when that cuts the larger upload time of the nodes involved to ``MOVE_GAIN`` of what
  it was (a partner's uplink counts at its lower bound), at most once per ``MOVE_INTERVAL_S`` and
  per node once per ``NODE_MOVE_COOLDOWN_S``; a node the coordinator measured keeps its uplink in
  the book when it leaves, so a rejoin is placed by it;
* routes (``Membership``) pair nodes whose uplinks bind with each other, so one slow route takes
  fewer jobs (``route_weights``) instead of every route running at a slow node's pace
  (:meth:`BandwidthPlacement.route_key`).

What it does not know: sockets, messages, the compute rules of ``engine.swarm.assignment``.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Any, Iterable

from engine.swarm.stage_traffic import StageTraffic

#: share of a version's seconds a node's uploads may take before its uplink binds
NETWORK_SHARE = 0.25
#: seconds per version assumed before the run has measured any
DEFAULT_VERSION_S = 1.0
#: a move must cut the larger upload time of the nodes it moves to this share
MOVE_GAIN = 0.7
#: a swap partner's uplink must be at least this many times the mover's (at its lower bound)
PARTNER_FASTER = 2.0
#: least seconds between two moves of the swarm, and before the first (every node measured)
MOVE_INTERVAL_S = 30.0
#: least seconds before the same node moves again
NODE_MOVE_COOLDOWN_S = 600.0
#: least seconds between two looks for a move
CHECK_INTERVAL_S = 5.0
#: most nodes remembered
MAX_PEERS = 4096


@dataclass
class Uplink:
    """What the coordinator knows of one node's uplink, bytes per second."""

    rate_bytes_s: float | None = None  #: measured with the path setting the pace, or claimed (None: unknown)
    floor_bytes_s: float = 0.0  #: the most it has been seen sending
    measured: bool = False  #: ``rate_bytes_s`` comes from a measurement, not a claim


class UplinkBook:
    """Uplinks of the swarm's nodes (bounded)."""

    def __init__(self) -> None:
        self._uplinks: dict[str, Uplink] = {}

    def _entry(self, peer: str) -> Uplink:
        entry = self._uplinks.pop(peer, None) or Uplink()
        self._uplinks[peer] = entry
        while len(self._uplinks) > MAX_PEERS:
            del self._uplinks[next(iter(self._uplinks))]
        return entry

    def claim(self, peer: str, mbps: float | None) -> None:
        """``peer``'s hello said its uplink is ``mbps`` (its upload cap); a measurement overrides it."""
        entry = self._entry(peer)
        if mbps and not entry.measured:
            entry.rate_bytes_s = mbps * 1e6 / 8

    def observe(self, peer: str, uplink_mbps: float, uplink_floor_mbps: float) -> None:
        """One report's figures (0 = none)."""
        entry = self._entry(peer)
        if uplink_mbps > 0:
            entry.rate_bytes_s, entry.measured = uplink_mbps * 1e6 / 8, True
        entry.floor_bytes_s = max(entry.floor_bytes_s, uplink_floor_mbps * 1e6 / 8)

    def get(self, peer: str) -> Uplink:
        return self._uplinks.get(peer) or Uplink()

    def forget(self, peer: str) -> None:
        self._uplinks.pop(peer, None)

    def snapshot(self, peers: Iterable[str]) -> dict[str, dict[str, Any]]:
        out = {}
        for peer in peers:
            u = self.get(peer)
            out[peer[:8]] = {"uplink_mbps": None if u.rate_bytes_s is None else round(u.rate_bytes_s * 8 / 1e6, 2),
                             "measured": u.measured, "floor_mbps": round(u.floor_bytes_s * 8 / 1e6, 2)}
        return out


@dataclass(frozen=True)
class Move:
    """Move ``peer`` from ``source`` to ``target``; with ``partner``, that one the other way (a swap)."""

    peer: str
    source: int
    target: int
    partner: str | None = None


def seconds_per_version(versions: list[dict[str, Any]], last: int = 10) -> float | None:
    """The run's recent seconds per version, from the store's versions (``created_at``); None with fewer than 2."""
    recent = versions[-last:]
    if len(recent) < 2:
        return None
    span = recent[-1]["created_at"] - recent[0]["created_at"]
    return span / (len(recent) - 1) if span > 0 else None


class BandwidthPlacement:
    """The bandwidth side of stage placement (see the module docstring)."""

    def __init__(self, traffic: StageTraffic, *, clock=time.monotonic) -> None:
        self.traffic = traffic
        self.uplinks = UplinkBook()
        self._clock = clock
        self._started = clock()
        self._last_move = self._last_check = -float("inf")
        self._moved_at: dict[str, float] = {}
        self.moves = 0

    # ------------------------------------------------------------------ figures
    def upload_s(self, peer: str, stage: int, trainers: int, *, pessimistic: bool = False) -> float | None:
        """Seconds per version ``peer``'s uploads take as one of ``trainers`` on ``stage``. Unknown uplink:
        None; with ``pessimistic``, its lower bound instead (0 s when nothing at all is known)."""
        u = self.uplinks.get(peer)
        rate = u.rate_bytes_s
        if rate is None:
            if not pessimistic:
                return None
            if u.floor_bytes_s <= 0:
                return 0.0
            rate = u.floor_bytes_s
        return self.traffic.upload_bytes(stage, trainers) / max(rate, 1.0)

    @staticmethod
    def budget_s(version_s: float | None) -> float:
        """Upload seconds per version past which an uplink binds."""
        return NETWORK_SHARE * (version_s if version_s and version_s > 0 else DEFAULT_VERSION_S)

    def binds(self, peer: str, stage: int, trainers: int, version_s: float | None) -> bool:
        """Whether ``peer``'s known uplink sets its stage's pace there."""
        seconds = self.upload_s(peer, stage, trainers)
        return seconds is not None and seconds > self.budget_s(version_s)

    def route_key(self, peer: str, stage: int, trainers: int, version_s: float | None) -> bool:
        """Sort key of a stage's replicas when routes are formed (a stable sort): binding uplinks last."""
        return self.binds(peer, stage, trainers, version_s)

    # ------------------------------------------------------------------ joins
    def join_stage(self, peer: str, choice: int, candidates: list[int], trainers: list[int],
                   version_s: float | None) -> int:
        """The stage for a joining trainer the compute rules put on ``choice`` (``trainers``: per stage,
        before it joins; ``candidates``: the stages it can hold)."""
        seconds = self.upload_s(peer, choice, trainers[choice] + 1)
        if seconds is None or seconds <= self.budget_s(version_s):
            return choice
        least = min(trainers[s] for s in candidates)
        allowed = [s for s in candidates if trainers[s] == least] if least == 0 else candidates
        return min(allowed, key=lambda s: (self.upload_s(peer, s, trainers[s] + 1) or 0.0, s != choice, s))

    # ------------------------------------------------------------------ moves
    def move_due(self) -> bool:
        """Whether it is time to look for a move (``MOVE_INTERVAL_S`` after the start and the last move,
        ``CHECK_INTERVAL_S`` after the last look)."""
        now = self._clock()
        return now - max(self._last_move, self._started) >= MOVE_INTERVAL_S and \
            now - self._last_check >= CHECK_INTERVAL_S

    def propose_move(self, stages: list[list[str]], fits, version_s: float | None) -> Move | None:
        """A move for the trainer whose measured uplink binds most, that cuts its upload time most
        (see the module), or None.

        ``stages``: the ready trainers of each stage; ``fits(peer, stage)``: whether it can hold it."""
        now = self._clock()
        if not self.move_due():
            return None
        self._last_check = now
        budget = self.budget_s(version_s)
        counts = [len(ids) for ids in stages]
        free = [[p for p in ids if now - self._moved_at.get(p, -float("inf")) >= NODE_MOVE_COOLDOWN_S]
                for ids in stages]
        binding = []
        for source, ids in enumerate(free):
            for peer in ids:
                before = self.upload_s(peer, source, counts[source])
                if self.uplinks.get(peer).measured and before is not None and before > budget:
                    binding.append((before, peer, source))
        for before, peer, source in sorted(binding, reverse=True):  # the slowest first
            move = self._best_move(peer, source, before, stages, free, counts, fits)
            if move is not None:
                return move
        return None

    def _best_move(self, peer: str, source: int, before: float, stages: list[list[str]], free: list[list[str]],
                   counts: list[int], fits) -> Move | None:
        rate = self.uplinks.get(peer).rate_bytes_s or 0.0
        best: tuple[float, Move] | None = None
        for target in range(len(stages)):
            if target == source or not fits(peer, target):
                continue
            if counts[source] > 1:  # alone: it joins the target as one more replica (fetching from one)
                after = self.upload_s(peer, target, counts[target] + 1) or 0.0
                if after < MOVE_GAIN * before and (best is None or after < best[0]):
                    best = (after, Move(peer, source, target))
            if counts[source] < 2 or counts[target] < 2:
                continue  # a swap's movers fetch their new stage's weights from a trainer that stays
            for partner in free[target]:
                known = self.uplinks.get(partner)
                if not fits(partner, source) or max(known.rate_bytes_s or 0.0, known.floor_bytes_s) < \
                        PARTNER_FASTER * rate:
                    continue
                other_before = self.upload_s(partner, target, counts[target], pessimistic=True) or 0.0
                other_after = self.upload_s(partner, source, counts[source], pessimistic=True) or 0.0
                after = max(self.upload_s(peer, target, counts[target]) or 0.0, other_after)
                if after < MOVE_GAIN * max(before, other_before) and (best is None or after < best[0]):
                    best = (after, Move(peer, source, target, partner))
        return None if best is None else best[1]

    def moved(self, move: Move) -> None:
        """``move`` was made: start the cooldowns."""
        now = self._clock()
        self._last_move = now
        self.moves += 1
        for peer in (move.peer, move.partner):
            if peer is not None:
                self._moved_at[peer] = now
        while len(self._moved_at) > MAX_PEERS:
            del self._moved_at[next(iter(self._moved_at))]

    def snapshot(self, stages: list[list[str]], version_s: float | None) -> dict[str, Any]:
        """For the stats API: the bytes model, each node's uplink and upload time, the moves made."""
        counts = [len(ids) for ids in stages]
        nodes = self.uplinks.snapshot(p for ids in stages for p in ids)
        for stage, ids in enumerate(stages):
            for peer in ids:
                seconds = self.upload_s(peer, stage, counts[stage])
                nodes[peer[:8]].update(stage=stage, upload_s=None if seconds is None else round(seconds, 3),
                                       binds=self.binds(peer, stage, counts[stage], version_s))
        return {"bytes_per_version": self.traffic.snapshot(), "budget_s": round(self.budget_s(version_s), 3),
                "nodes": nodes, "moves": self.moves}
