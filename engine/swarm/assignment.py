"""Stage assignment: which pipeline stage each node serves.

Pure bookkeeping, no I/O: the coordinator calls :func:`assign_new_node` when a
node joins and :func:`rebalance` whenever membership changes. A node is a
*trainer* (generates and trains its stage) or an *inference* replica (holds a
stage without optimiser state, only generates, and follows a trainer's weight
stream). Rules:

* a joining trainer takes the stage with the fewest trainers (ties: the lowest
  stage index, so a pipeline is completed front to back);
* capacity (``speeds``: each serving node's measured decoding steps per second of its stage):
  once every stage the node can hold has a replica of its kind, and every one of them has a
  measured speed, it takes the stage of least capacity (the sum of its replicas' speeds) instead:
  a pipeline runs at its slowest stage's pace, so that is where one more node adds most
  throughput (a stage of one node at 1/4 speed gets the next node before a stage of two fast
  ones). The newcomer's own speed is unknown until it reports, so this never leaves a stage
  without a replica and falls back to the counts while any speed is missing;
* a joining inference replica takes the stage with the fewest generation-capable
  replicas (trainers and inference replicas together; same tie rule);
* coverage counts trainers only: a stage served only by inference replicas cannot
  train, so when a stage has no trainer left and another stage has two or more,
  one trainer moves from the most-covered stage to the empty one (the moved node
  reloads its weights from the stage checkpoint or a replica of its new stage);
  inference replicas are never moved;
* a rejoining node's wish for its old stage is advice (:func:`resume_stage`): granted only
  for a real stage within one of the least-covered, so hellos cannot pile onto one stage;
* nodes that cannot hold a stage (``max_layers`` smaller than the stage) are
  never assigned to it;
* a trainer's stage may get a second opinion (``prefer``): the coordinator's bandwidth
  placement (``engine.swarm.bandwidth_placement``) sends a node whose uplink would set its
  stage's pace to the stage where it uploads least.

It knows nothing about networks, weights or time (speeds and preferences come from the caller).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Callable, Mapping

#: a second opinion on a trainer's stage: (the compute rules' choice, candidate stages, trainers per stage) -> stage
Preference = Callable[[int, list[int], list[int]], int]


@dataclass
class NodeSlot:
    """What the assigner needs to know about one node."""

    peer_id: str
    stage: int | None = None
    #: most decoder layers this node can hold (memory limit); None = no limit
    max_layers: int | None = None
    #: "trainer" (generates and trains) or "inference" (generates only; never counts as coverage)
    role: str = "trainer"

    @property
    def is_trainer(self) -> bool:
        return self.role == "trainer"


@dataclass
class Assignment:
    """Current stage of every node of a swarm with ``num_stages`` stages."""

    stage_layers: list[int]  #: decoder layers in each stage
    nodes: dict[str, NodeSlot] = field(default_factory=dict)

    @property
    def num_stages(self) -> int:
        return len(self.stage_layers)

    def replicas(self, role: str | None = "trainer") -> list[list[str]]:
        """Peer ids serving each stage with ``role`` (None: any role), sorted for determinism."""
        out: list[list[str]] = [[] for _ in range(self.num_stages)]
        for slot in self.nodes.values():
            if slot.stage is not None and (role is None or slot.role == role):
                out[slot.stage].append(slot.peer_id)
        return [sorted(ids) for ids in out]

    def coverage(self) -> list[int]:
        """Trainers per stage (inference replicas never count)."""
        return [len(ids) for ids in self.replicas()]

    def generation_coverage(self) -> list[int]:
        """Generation-capable replicas (trainers and inference replicas) per stage."""
        return [len(ids) for ids in self.replicas(None)]

    def complete(self) -> bool:
        """True when every stage has at least one trainer (a training pipeline can run)."""
        return all(self.coverage())

    def _fits(self, slot: NodeSlot, stage: int) -> bool:
        return slot.max_layers is None or slot.max_layers >= self.stage_layers[stage]

    def fits(self, peer_id: str, stage: int) -> bool:
        """Whether node ``peer_id`` (known here) can hold ``stage``."""
        slot = self.nodes.get(peer_id)
        return slot is not None and self._fits(slot, stage)


def assign_new_node(assignment: Assignment, slot: NodeSlot,
                    speeds: Mapping[str, float] | None = None, prefer: Preference | None = None) -> int | None:
    """Add ``slot`` and give it the least-covered stage it can hold; ``None`` if none fits.

    Trainers go where trainers are fewest, inference replicas where generation-capable
    replicas are fewest; with every candidate stage served and measured (``speeds``: peer ->
    decoding steps per second), where their capacity is least (see the module); then a
    trainer's ``prefer`` may pick another of the candidates.
    """
    assignment.nodes[slot.peer_id] = slot
    slot.stage = None
    replicas = assignment.replicas("trainer" if slot.is_trainer else None)
    coverage = [len(ids) for ids in replicas]
    candidates = [s for s in range(assignment.num_stages) if assignment._fits(slot, s)]
    if not candidates:
        slot.stage = None
        return None
    known = speeds or {}
    measured = speeds is not None and all(coverage[s] > 0 for s in candidates) and \
        all(known.get(p, 0.0) > 0 for s in candidates for p in replicas[s])
    if measured:
        capacity = {s: sum(known[p] for p in replicas[s]) for s in candidates}
        slot.stage = min(candidates, key=lambda s: (capacity[s], coverage[s], s))
    else:
        slot.stage = min(candidates, key=lambda s: (coverage[s], s))
    if prefer is not None and slot.is_trainer:
        preferred = prefer(slot.stage, candidates, coverage)
        if preferred in candidates and (min(coverage[s] for s in candidates) > 0 or coverage[preferred] == 0):
            slot.stage = preferred  # never at the cost of a stage without a trainer
    return slot.stage


def resume_stage(assignment: Assignment, slot: NodeSlot, preferred: int | None) -> int | None:
    """The stage a rejoining node asked for, if the coordinator grants it; None = assign afresh.

    A node's wish is advice: granted only for a real stage it can hold whose coverage
    (trainers, or all generation replicas for an inference node) is at most one above the
    least-covered stage it fits, so no run of hellos can pile identities onto one stage.
    """
    if preferred is None or not 0 <= preferred < assignment.num_stages or not assignment._fits(slot, preferred):
        return None
    others = [s for s in assignment.nodes.values() if s.peer_id != slot.peer_id]
    coverage = [0] * assignment.num_stages
    for other in others:
        if other.stage is not None and (other.role == "trainer" or not slot.is_trainer):
            coverage[other.stage] += 1
    least = min(coverage[s] for s in range(assignment.num_stages) if assignment._fits(slot, s))
    return preferred if coverage[preferred] <= least + 1 else None


def remove_node(assignment: Assignment, peer_id: str) -> None:
    assignment.nodes.pop(peer_id, None)


def rebalance(assignment: Assignment) -> list[tuple[str, int, int]]:
    """Move trainers into stages without one; returns ``(peer_id, old_stage, new_stage)`` moves."""
    moves: list[tuple[str, int, int]] = []
    while True:
        replicas = assignment.replicas()
        empty = [s for s, ids in enumerate(replicas) if not ids]
        if not empty:
            return moves
        target = empty[0]
        donors = sorted((s for s, ids in enumerate(replicas) if len(ids) >= 2),
                        key=lambda s: (-len(replicas[s]), s))
        moved = False
        for donor in donors:
            # move the most recently sorted-last peer: deterministic and keeps the lowest ids stable
            for peer_id in reversed(replicas[donor]):
                slot = assignment.nodes[peer_id]
                if assignment._fits(slot, target):
                    slot.stage = target
                    moves.append((peer_id, donor, target))
                    moved = True
                    break
            if moved:
                break
        if not moved:
            return moves
