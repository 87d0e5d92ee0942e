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
* nodes already serving are not moved: a trainer that joins a stage while it steps faster than a
  weight transfer does not catch up (resynced on every vote, measured on ``home``: a dozen
  resyncs in 11 s); the coordinator keeps measured uplinks when nodes leave, and a node
  remembers its own (``engine.swarm.node_status``) and claims it in its next hello, so the
  next join is placed by the measurement -- a rejoin's wish for its old stage included;
* routes (``Membership``) pair nodes whose uplinks bind with each other, so one slow route takes
  fewer jobs (``route_weights``) instead of every route running at a slow node's pace
  (:meth:`BandwidthPlacement.route_key`).

What it does not know: sockets, messages, the compute rules of ``engine.swarm.assignment``.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Iterable

from engine.swarm.stage_traffic import StageTraffic

#: share of a version's seconds a node's uploads may take before its uplink binds
NETWORK_SHARE = 0.25
#: seconds per version assumed before the run has measured any
DEFAULT_VERSION_S = 1.0
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


def seconds_per_version(versions: list[dict[str, Any]], last: int = 10) -> float | None:
    """The run's recent seconds per version, from the store's versions (``created_at``); None with fewer than 2."""
    recent = versions[-last:]
    if len(recent) < 2:
        return None
    span = recent[-1]["created_at"] - recent[0]["created_at"]
    return span / (len(recent) - 1) if span > 0 else None


class BandwidthPlacement:
    """The bandwidth side of stage placement (see the module docstring)."""

    def __init__(self, traffic: StageTraffic) -> None:
        self.traffic = traffic
        self.uplinks = UplinkBook()
        self.placed = 0  #: joins sent elsewhere than the compute rules (or a rejoin's wish) said, for their uplink

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

    def snapshot(self, stages: list[list[str]], version_s: float | None,
                 inference: list[list[str]] | None = None) -> dict[str, Any]:
        """For the stats API: the bytes model, each node's uplink and upload time (trainers of ``stages``;
        the inference replicas of ``inference`` upload no training traffic), joins placed by uplink."""
        counts = [len(ids) for ids in stages]
        nodes = self.uplinks.snapshot(p for ids in stages for p in ids)
        for stage, ids in enumerate(stages):
            for peer in ids:
                seconds = self.upload_s(peer, stage, counts[stage])
                nodes[peer[:8]].update(stage=stage, upload_s=None if seconds is None else round(seconds, 3),
                                       binds=self.binds(peer, stage, counts[stage], version_s))
        for stage, ids in enumerate(inference or []):
            for peer, entry in self.uplinks.snapshot(ids).items():
                nodes[peer] = {**entry, "stage": stage, "role": "inference"}
        return {"bytes_per_version": self.traffic.snapshot(), "budget_s": round(self.budget_s(version_s), 3),
                "nodes": nodes, "placed_by_uplink": self.placed}
