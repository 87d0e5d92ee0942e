"""DiLoCo through a real 2 stages x 2 replicas swarm (processes, WebRTC): replicas take inner
steps alone, exchange 2-bit pseudo-gradients every H versions, and agree bit for bit after
each sync (the coordinator's digest vote at synced versions finds no split), for a small
fraction of the bytes the gradients of every step would take."""

from __future__ import annotations

import pytest

from tests.integration.swarm_harness import Swarm

pytestmark = [pytest.mark.network, pytest.mark.slow]

H, VERSIONS = 2, 8
RUN = ["prompts_per_step=8", "eval_every_versions=0", "generations_in_flight=4", f"max_versions={VERSIONS}",
       "replica_sync.mode=diloco", f"replica_sync.inner_steps={H}", "replica_sync.encoding=topk",
       "replica_sync.topk_fraction=1.0", "replica_sync.value_bits=2"]


def test_diloco_replicas_sync_every_h_versions_agree_bit_for_bit_and_send_a_fraction_of_the_bytes(tmp_path):
    swarm = Swarm(tmp_path, settings=RUN)
    try:
        swarm.start_coordinator()
        for i in range(4):
            swarm.start_node(f"n{i}")
        stats = swarm.wait(lambda s: s["finished"], timeout_s=600, what=f"the DiLoCo run to pass version {VERSIONS}")
    finally:
        swarm.stop()
    assert stats["version"] >= VERSIONS
    assert all(len(s["replicas"]) == 2 for s in stats["stages"])
    votes = stats["weight_votes"]
    assert votes.get("votes", 0) >= 2 * (VERSIONS // H) - 2  # both stages voted at (nearly) every sync
    assert votes.get("splits", 0) == 0 and votes.get("resyncs", 0) == 0 and votes.get("evicted", 0) == 0
    # pseudo-gradients at 2 bits every H versions against fp32 gradients every version: ~1/(16 H) of them
    assert 0 < stats["update_bytes"] < stats["dense_update_bytes"] / (8 * H)
