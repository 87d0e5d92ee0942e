"""``RecordingLinks``: the swarm as the coordinator's scheduling parts see it (``NodeLinks``), for tests.

One two-stage route of one node per stage; every send is recorded in ``sent`` and handed to
``on_send`` (a test may answer there as a node would). It does no networking.
"""

from __future__ import annotations

from typing import Any, Callable


class RecordingLinks:
    def __init__(self, route: list[str]) -> None:
        self.route = list(route)
        self.sent: list[tuple[str, Any]] = []
        self.on_send: Callable[[str, Any], None] = lambda peer, message: None

    async def send(self, peer: str, message: Any) -> bool:
        self.sent.append((peer, message))
        self.on_send(peer, message)
        return True

    def routes(self) -> list[list[str]]:
        return [self.route]

    gen_routes = routes

    def stage_replicas(self) -> list[list[str]]:
        return [[peer] for peer in self.route]

    def inference_replicas(self) -> list[list[str]]:
        return [[] for _ in self.route]

    def leader(self, stage: int) -> str | None:
        return self.route[stage]

    async def check_weights(self, stage: int, digests: dict, version: int) -> None:
        self.sent.append(("check_weights", (stage, dict(digests), version)))
