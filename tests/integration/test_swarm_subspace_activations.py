"""A real 2-node swarm (processes, WebRTC) whose activations and gradients cross as ``subspace``:
it generates, trains and evaluates through the encoding (bytes and accuracy: ``polis bench act``)."""

from __future__ import annotations

import pytest

from tests.integration.swarm_harness import Swarm

pytestmark = [pytest.mark.network, pytest.mark.slow]

VERSIONS = 4
RUN = ["prompts_per_step=4", "eval_every_versions=0", "generations_in_flight=2", f"max_versions={VERSIONS}",
       "activation_encoding=subspace_r8"]


def test_a_swarm_generates_trains_and_evaluates_through_subspace_activations(tmp_path):
    swarm = Swarm(tmp_path, settings=RUN)
    try:
        swarm.start_coordinator()
        for i in range(2):
            swarm.start_node(f"n{i}")
        stats = swarm.wait(lambda s: s["finished"] and any(e["version"] == s["version"] for e in s["evals"]),
                           timeout_s=600, what=f"the run to pass version {VERSIONS} and evaluate its last one")
    finally:
        swarm.stop()
    assert stats["version"] >= VERSIONS
    last = next(e for e in stats["evals"] if e["version"] == stats["version"])
    assert 0.0 <= last["accuracy"] <= 1.0 and last["n"] > 0
