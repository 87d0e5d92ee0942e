"""``RecordingLinks``: the swarm as the coordinator's scheduling parts see it (``NodeLinks``), for tests.

One route of one node per stage (``RecordingLinks(route)``) or several replicas per stage
(``RecordingLinks.grid(stages)``: routes as ``engine.swarm.membership`` builds them). Every send
is recorded in ``sent`` and handed to ``on_send`` (a test may answer there as a node would);
``evict`` takes the peer out of every stage and records it in ``evicted``; ``check_weights`` is
recorded too and decided by a real ``WeightAuthority`` vote. It does no networking.
"""

from __future__ import annotations

from typing import Any, Callable

from engine.swarm.weight_votes import WeightAuthority


class RecordingLinks:
    def __init__(self, route: list[str]) -> None:
        self.stages: list[list[str]] = [[peer] for peer in route]
        self.sent: list[tuple[str, Any]] = []
        self.evicted: list[tuple[str, str]] = []
        self.on_send: Callable[[str, Any], None] = lambda peer, message: None
        self.authority = WeightAuthority()

    @classmethod
    def grid(cls, stages: list[list[str]]) -> "RecordingLinks":
        links = cls([])
        links.stages = [sorted(ids) for ids in stages]
        return links

    @property
    def route(self) -> list[str]:
        return [ids[0] for ids in self.stages]

    async def send(self, peer: str, message: Any) -> bool:
        self.sent.append((peer, message))
        self.on_send(peer, message)
        return True

    def routes(self) -> list[list[str]]:
        if not self.stages or not all(self.stages):
            return []
        width = max(len(ids) for ids in self.stages)
        return [[ids[r % len(ids)] for ids in self.stages] for r in range(width)]

    gen_routes = routes

    def stage_replicas(self) -> list[list[str]]:
        return [list(ids) for ids in self.stages]

    def inference_replicas(self) -> list[list[str]]:
        return [[] for _ in self.stages]

    def catching_up(self) -> bool:
        return False

    def evict(self, peer_id: str, why: str) -> None:
        self.evicted.append((peer_id, why))
        self.stages = [[p for p in ids if p != peer_id] for ids in self.stages]

    def leader(self, stage: int) -> str | None:
        return self.stages[stage][0] if self.stages[stage] else None

    async def check_weights(self, stage: int, digests: dict, version: int) -> str | None:
        self.sent.append(("check_weights", (stage, dict(digests), version)))
        return self.authority.vote(stage, digests, version).majority
