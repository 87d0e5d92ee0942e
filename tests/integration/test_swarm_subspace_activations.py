"""A real 2-node swarm (processes, WebRTC) whose activations and gradients cross as ``subspace``: it
generates, trains and evaluates through it, and its stage link carries far fewer bytes than with fp32."""

from __future__ import annotations

import pytest

from tests.integration.swarm_harness import Swarm

pytestmark = [pytest.mark.network, pytest.mark.slow]

VERSIONS = 4
RUN = ["prompts_per_step=4", "eval_every_versions=0", "generations_in_flight=2", f"max_versions={VERSIONS}"]


def _run(tmp_path, encoding: str) -> dict:
    swarm = Swarm(tmp_path / encoding, settings=[*RUN, f"activation_encoding={encoding}"])
    (tmp_path / encoding).mkdir()
    try:
        swarm.start_coordinator()
        for i in range(2):
            swarm.start_node(f"n{i}")
        return swarm.wait(lambda s: s["finished"] and any(e["version"] == s["version"] for e in s["evals"]),
                          timeout_s=600, what=f"the {encoding} run to pass version {VERSIONS} and evaluate")
    finally:
        swarm.stop()


def test_a_swarm_trains_and_evaluates_through_subspace_activations_with_fewer_bytes(tmp_path):
    sub, fp32 = _run(tmp_path, "subspace_r8"), _run(tmp_path, "fp32")
    assert sub["version"] >= VERSIONS and fp32["version"] >= VERSIONS
    per_version = {name: s["bytes_on_wire"] / s["version"] for name, s in (("sub", sub), ("fp32", fp32))}
    assert per_version["sub"] < 0.5 * per_version["fp32"], per_version
