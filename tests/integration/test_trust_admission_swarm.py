"""Issue 14, finding 7, over real processes: the coordinator's key pins it, identities are capped per address.

Real coordinators (``polis coordinator``) and real torch nodes (``polis node``) on loopback. A node
given a swarm URL whose ``#key=`` names the real coordinator's key, but the rogue coordinator's
address, refuses the rogue (it never gets welcomed there, and says so in its log). Twenty
identities from one other address (127.0.0.2, which the coordinator sees as another machine)
asking for stage 1 are capped at the coordinator's limit (16), and say they are ready before the
honest nodes do; the two honest real nodes, joining with the pinned URL, are placed where fewest
serve and lead the stages they serve.
"""

from __future__ import annotations

import asyncio
import time

import pytest

from engine.net.identity import pin_url, split_pinned_url
from tests.integration.swarm_harness import Swarm
from tests.support.hostile_node import join

pytestmark = [pytest.mark.network, pytest.mark.slow]

SYBIL_HOST = "127.0.0.2"
SYBILS = 20
CAP = 16  #: CoordinatorConfig.max_nodes_per_address's default


def test_a_pinned_node_refuses_a_rogue_coordinator_and_twenty_identities_from_one_address_are_capped(tmp_path):
    (tmp_path / "real").mkdir()
    (tmp_path / "rogue").mkdir()
    real = Swarm(tmp_path / "real", settings=["eval_every_versions=0"])
    rogue = Swarm(tmp_path / "rogue")
    loop = asyncio.new_event_loop()
    sybils: list = []
    try:
        real.start_coordinator()
        rogue.start_coordinator()
        pinned = real.pinned_url()
        assert split_pinned_url(pinned)[0].rstrip("/") == real.url
        fooled = pin_url(rogue.url, split_pinned_url(pinned)[1])  # the rogue's address, the real key
        rogue.start_node("fooled", coordinator=fooled)
        deadline = time.monotonic() + 90
        while not rogue.log_has("fooled", "refusing the coordinator") and time.monotonic() < deadline:
            time.sleep(0.5)
        assert rogue.log_has("fooled", "another key"), rogue.log_tails()
        assert not [n for n in rogue.stats()["nodes"] if n["ready"]]  # nothing was loaded from the rogue

        run_id = real.stats()["run_id"]
        for _ in range(SYBILS):
            sybils.append(loop.run_until_complete(
                join(real.url, stage=1, num_stages=2, run_id=run_id, local_host=SYBIL_HOST)))
        welcomed = [s for s in sybils if s.reply["type"] == "welcome"]
        assert len(welcomed) == CAP, [s.reply["type"] for s in sybils]
        for link in welcomed:  # all ready before any honest node
            loop.run_until_complete(link.send({"type": "ready", "stage": link.reply["stage"], "version": 0}))
        stats = real.stats()
        assert stats["counters"]["refused_address_cap"] == SYBILS - CAP
        spread = [sum(1 for s in welcomed if s.reply["stage"] == k) for k in (0, 1)]
        # all asked for stage 1; each is granted only within one of the least covered stage
        assert spread[0] >= CAP // 2 - 1, spread

        for name in ("n0", "n1"):
            real.start_node(name, coordinator=pinned)
        honest = {real.peer_id("n0"), real.peer_id("n1")}
        stats = real.wait(lambda s: {n["peer_id"] for n in s["nodes"] if n["ready"]} >= honest,
                          timeout_s=180, what="the two honest nodes to be ready")
        placed = {n["peer_id"]: n["stage"] for n in stats["nodes"] if n["peer_id"] in honest}
        leaders = [st["leader"] for st in stats["stages"]]
        for stage in placed.values():  # where it has a choice, the address of twenty identities leads nothing
            assert leaders[stage] in honest, (leaders, placed)
    finally:
        for link in sybils:
            loop.run_until_complete(link.close())
        loop.close()
        rogue.stop()
        real.stop()
