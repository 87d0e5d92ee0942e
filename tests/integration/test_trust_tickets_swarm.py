"""Issue 14, finding 5, over real processes and WebRTC: forged ``grad`` and ``drop`` are refused.

A real 2x2-ish swarm: three honest torch nodes, then a hostile real node
(``tests.support.hostile_node``, ``forges_routes``) that lands on stage 1. For the first
activations it receives it sends every member off that route forged ``drop``s (generation) and
``grad``s (training) for that job and the ids next to it, on routes it wrote itself (naming
itself the receiver's upstream) and with no coordinator ticket. Honest nodes refuse each one
(a strike on the link, "without a ticket" in their logs), nobody honest is evicted, and training
keeps advancing. The honest generators' behaviour log-probs stay far below the log-prob audit's
limit (the honest spread across two stages with int8 activations, printed).
Bit-identity of the honest job's tokens and gradients is in ``tests/unit/test_trust_tickets.py``.
"""

from __future__ import annotations

import pytest

from engine.swarm.logprob_audit import GROSS_MISMATCH_NATS
from tests.integration.swarm_harness import Swarm

pytestmark = [pytest.mark.network, pytest.mark.slow]

RUN = ["prompts_per_step=4", "eval_every_versions=0", "generations_in_flight=2", "micro_batch_rows=16"]


def _refusals(swarm: Swarm, names) -> int:
    return sum((swarm.tmp / f"{n}.log").read_text(errors="replace").count("without a ticket") for n in names)


def test_forged_grad_and_drop_from_a_member_are_refused_and_the_run_advances(tmp_path):
    swarm = Swarm(tmp_path, settings=RUN, coordinator_args=["--step-timeout-s", "60"])
    honest = ["n0", "n1", "n2"]
    try:
        swarm.start_coordinator()
        ids = {swarm.peer_id(n) for n in honest}
        for name in honest:
            swarm.start_node(name)
        swarm.wait(lambda s: {n["peer_id"] for n in s["nodes"] if n["ready"]} >= ids, timeout_s=150,
                   what="three honest nodes to be ready")
        evil = swarm.peer_id("evil")
        swarm.start_node("evil", misbehaviour="forges_routes")
        stats = swarm.wait(lambda s: any(n["peer_id"] == evil and n["ready"] for n in s["nodes"]), timeout_s=120,
                           what="the forger to be ready")
        assert {n["peer_id"]: n["stage"] for n in stats["nodes"]}[evil] == 1  # where fewest serve: it sees acts
        start = stats["version"]
        stats = swarm.wait(lambda s: s["version"] >= start + 8 and _refusals(swarm, honest) >= 3, timeout_s=180,
                           what="eight more versions and the forgeries refused")
        forged = (tmp_path / "evil.log").read_text(errors="replace").count("hostile node sent a forged")
        assert forged >= 3, forged
        ready = {n["peer_id"] for n in stats["nodes"] if n["ready"]}
        assert ids <= ready, (ready, stats["counters"])  # nobody honest paid for it
        audit = stats["logprob_audit"]
        honest_spread = {p[:8]: a["max_mismatch_nats"] for p, a in audit.items() if p in ids}
        assert all(audit[p]["gross"] == 0 for p in ids if p in audit), audit
        assert all(v < GROSS_MISMATCH_NATS / 4 for v in honest_spread.values()), honest_spread
        print(f"forged {forged}, refused {_refusals(swarm, honest)}; v{start} -> v{stats['version']}; "
              f"honest max mean |b - p| per pass (nats/token): {honest_spread}; audit {audit}")
    finally:
        swarm.stop()
