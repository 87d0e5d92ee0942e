"""Issue 14, finding 4, over real processes and WebRTC: forged rollouts are refused or never trained on.

One stage of real torch nodes (``polis node``; every node is a whole route). Two honest trainers
generate and train from the first update together (``tests.support.gated_coordinator``), each
one's rows checked on the other's route, and set the clean window's gradient norms (the step log).
Then a hostile real node (``tests.support.hostile_node``, ``forges_rollouts``) joins as an
inference replica of the stage (it serves generation as a route's last stage, and never trains,
so only its results are in question) and forges every result it sends, one forgery per result in
turn: ids beyond the vocabulary after a stop id and version 2^40 are refused at ingestion (its
prompts queued again, the node counted in ``refused_results``); behaviour log-probs of -40 on
every token pass every ingestion rule, but with two updates per batch the proximal pass
recomputes its rows on an honest trainer's route, and the log-prob audit finds them ~39 nats off,
keeps them out of that very step's update and, the second time, evicts the generator. Meanwhile
training advances, the honest gradient norms stay within 2x of the clean window's (the median step's:
the attacked window runs until the eviction, hundreds of versions against the clean window's few
dozen, so its largest norm is drawn from many more steps later in training; a forged b = -40 that
reached an update would give norms ~1e17, far past the bound on the largest, 10x the clean
window's), and no honest node is flagged.

What it leaves to ``tests/unit/test_trust_rollouts.py`` and ``tests/unit/test_trust_logprob_audit.py``:
quarantine of a batch that nodes refuse, the audit's arithmetic; to ``polis bench trust``: accuracy.
"""

from __future__ import annotations

import logging
import statistics

import pytest

from engine.swarm.logprob_audit import GROSS_MISMATCH_NATS
from tests.integration.swarm_harness import Swarm
from tests.support.gated_coordinator import gate
from tests.support.swarm_evidence import grad_norms, ready_peers, stage_steps

pytestmark = [pytest.mark.network, pytest.mark.slow]

log = logging.getLogger(__name__)

RUN = ["prompts_per_step=4", "updates_per_batch=2", "group_size=8", "prompts_per_job=4", "micro_batch_rows=16",
       "eval_every_versions=0", "generations_in_flight=2"]
COORDINATOR = ["--step-timeout-s", "60"]
#: versions the honest two train before the forger starts (the clean window runs on until it is ready)
CLEAN_VERSIONS = 6
#: versions the run must still make once the forger is gone
AFTER_VERSIONS = 4


def test_a_last_stage_forging_ids_versions_and_logprobs_is_refused_audited_and_evicted_while_training_goes_on(
        tmp_path):
    swarm = Swarm(tmp_path, stages=1, settings=RUN, coordinator_args=COORDINATOR, coordinator_command=gate(2))
    try:
        swarm.start_coordinator()
        honest = {swarm.peer_id("h0"), swarm.peer_id("h1")}
        for name in ("h0", "h1"):
            swarm.start_node(name)
        swarm.wait(lambda s: ready_peers(s) >= honest and s["version"] >= CLEAN_VERSIONS, timeout_s=240,
                   what=f"the honest two to train {CLEAN_VERSIONS} versions")
        forger = swarm.peer_id("forger")
        swarm.start_node("forger", "--inference-only", misbehaviour="forges_rollouts")
        seen: dict = {"refused": 0}  # while it is connected: the node list drops it once evicted

        def evicted(s: dict) -> bool:
            node = next((n for n in s["nodes"] if n["peer_id"] == forger), None)
            if node is not None:
                if node["ready"] and "ready_at" not in seen:  # the clean window ends: the steps so far
                    seen["ready_at"], seen["clean"] = s["version"], grad_norms(stage_steps(s))
                seen["refused"] = max(seen["refused"], node["refused_results"])
            return "ready_at" in seen and s["counters"].get("evicted_generators", 0) >= 1 and node is None
        stats = swarm.wait(evicted, timeout_s=300, what="the forger to be refused, audited and evicted")
        gone_at = stats["version"]
        stats = swarm.wait(lambda s: s["version"] >= gone_at + AFTER_VERSIONS and ready_peers(s) >= honest,
                           timeout_s=150, what="training to go on with the honest two")
        counters, audit = stats["counters"], stats["logprob_audit"]
        clean, attacked = seen["clean"], grad_norms(stage_steps(stats, after=seen["ready_at"]))
        log.info("clean v1-v%d grad norms %s; v%d-v%d (forger ready, evicted at v%d) %s; forger refused %d; "
                 "audit %s; counters %s", seen["ready_at"], clean, seen["ready_at"] + 1, stats["version"], gone_at,
                 attacked, seen["refused"], audit, counters)
        coordinator = (tmp_path / "coordinator.log").read_text(errors="replace")
        refusals = [line for line in coordinator.splitlines() if "refused job" in line and forger in line]
        # ingestion: both forgeries it can see were refused, and the node flagged for them
        assert any("outside the vocabulary" in line for line in refusals), refusals
        assert any("newer than the run's" in line for line in refusals), refusals
        assert seen["refused"] >= 1 and counters.get("refused_results", 0) >= 2, (seen, counters)
        # the audit: every pass that checked its rows caught them (kept out of that step), and it was evicted
        assert audit[forger]["gross"] == audit[forger]["checks"] >= 2, audit[forger]
        assert audit[forger]["max_mismatch_nats"] > GROSS_MISMATCH_NATS, audit[forger]
        assert counters.get("audit_dropped_rows", 0) >= 1, counters
        # nobody honest was flagged, and the honest gradients kept their size
        nodes = {n["peer_id"]: n for n in stats["nodes"]}
        assert all(nodes[p]["refused_results"] == 0 for p in honest), nodes
        assert all(audit[p]["gross"] == 0 for p in honest if p in audit), audit
        assert clean and attacked, (clean, attacked)
        assert statistics.median(attacked) <= 2 * statistics.median(clean), (clean, attacked)
        assert max(attacked) <= 10 * max(clean), (clean, attacked)
    finally:
        swarm.stop()
