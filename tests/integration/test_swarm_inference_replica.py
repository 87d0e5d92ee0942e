"""An inference-only node in a real swarm: it generates, its rollouts are scored, and it never drifts.

Real processes on 127.0.0.1: a coordinator, two torch trainers (one per stage) and one
``--inference-only`` node that follows its stage leader through int8 weight deltas over WebRTC.
"""

from __future__ import annotations

import logging

import pytest

from tests.integration.swarm_harness import Swarm

pytestmark = [pytest.mark.network, pytest.mark.slow]

log = logging.getLogger(__name__)

#: small and quick: tiny eval, four prompts of four samples per step (one prompt per job, so
#: both generation routes get work before the buffer is full), one update per batch
TINY_RUN = ["task.eval_size=16", "prompts_per_step=4", "group_size=4", "prompts_per_job=1", "updates_per_batch=1",
            "eval_every_versions=0", "generations_in_flight=2", "max_versions=8"]


def _inference_peer(stats: dict) -> str | None:
    return next((n["peer_id"] for n in stats["nodes"] if n["role"] == "inference" and n["ready"]), None)


def _followed(stats: dict) -> bool:
    peer = _inference_peer(stats)
    if peer is None:
        return False
    replica = stats["weight_stream"]["replicas"].get(peer, {})
    node = next(n for n in stats["nodes"] if n["peer_id"] == peer)
    return (stats["version"] >= 3 and replica.get("deltas_applied", 0) >= 1 and replica.get("in_sync") is True
            and stats["ledger"].get(peer, {}).get("tokens_generated", 0) > 0 and node["rollouts_scored"] > 0)


def test_an_inference_only_node_generates_is_scored_and_holds_exactly_its_leaders_shadow(tmp_path):
    swarm = Swarm(tmp_path, settings=TINY_RUN)
    try:
        swarm.start_coordinator()
        swarm.start_node("t0")
        swarm.start_node("t1")
        swarm.start_node("inf", "--inference-only")
        stats = swarm.wait(_followed, timeout_s=110, what="the inference node to generate and follow deltas")
        peer = _inference_peer(stats)
        stream = stats["weight_stream"]
        replica = stream["replicas"][peer]
        stage = next(s for s in stats["stages"] if peer in s["inference"])
        assert peer not in stage["replicas"] and stage["replicas"]  # a trainer leads it; it is not one
        assert replica["source"] == stage["replicas"][0]
        assert replica["served_checksum"] == replica["shadow_checksum"]
        assert stats["ledger"][peer]["role"] == "inference" and stats["ledger"][peer]["microbatches_trained"] == 0
        assert stream["ratio_vs_dense_fp32"] < 0.3
        assert stream["residual_max_abs"] < 3e-4  # under one AdamW step (lr): no drift
        log.info("weight stream: %d deltas, %.0f bytes each (%.3f of dense fp32), residual max %.3g; "
                 "inference node version %s of %d", stream["deltas"], stream["bytes_per_delta"],
                 stream["ratio_vs_dense_fp32"], stream["residual_max_abs"], replica["served_version"],
                 stats["version"])
    finally:
        swarm.stop()
