"""A real 2-node swarm run (processes, WebRTC) exported with `polis export`: transformers loads the folder
with the logits of the stages the nodes checkpointed, and `polis eval` agrees with the swarm's own last eval."""

from __future__ import annotations

import json

import numpy as np
import pytest

from engine.cli import main
from tests.integration.swarm_harness import Swarm
from tests.support.export_logits import model_logits, pipeline_logits

pytestmark = [pytest.mark.network, pytest.mark.slow]

#: the run stops training once past this version (a batch makes up to updates_per_batch versions), then
#: evaluates its last one; every version is checkpointed, so the last one can be exported
VERSIONS = 4
RUN = ["prompts_per_step=4", "eval_every_versions=0", "generations_in_flight=2", f"max_versions={VERSIONS}",
       "checkpoint_every_versions=1"]


def test_an_export_of_a_swarm_run_is_the_model_its_stages_served(tmp_path, capsys):
    pytest.importorskip("torch")
    pytest.importorskip("transformers")

    swarm = Swarm(tmp_path, settings=RUN)
    try:
        swarm.start_coordinator()
        for i in range(2):
            swarm.start_node(f"n{i}")
        stats = swarm.wait(lambda s: s["finished"] and any(e["version"] == s["version"] for e in s["evals"]),
                           timeout_s=600, what=f"the run to pass version {VERSIONS} and evaluate its last one")
    finally:
        swarm.stop()
    last = stats["version"]
    swarm_eval = next(e for e in stats["evals"] if e["version"] == last)

    out = tmp_path / "export"
    assert main(["export", "--run-dir", str(tmp_path / "c.db"), "--out", str(out), "--json",
                 "--backend", "torch"]) == 0
    summary = json.loads(capsys.readouterr().out)
    assert summary["version"] == last >= VERSIONS and len(summary["shards"]) == 2

    # the pipeline at that version: the nodes' own stage checkpoints, restored as a node restores them
    x = pipeline_logits(swarm.checkpoint, summary["stage_files"], last)
    exported = model_logits(out)
    assert np.max(np.abs(exported - x)) <= 1e-5
    assert np.max(np.abs(model_logits(swarm.checkpoint) - x)) > 1e-4  # the run trained it

    # `polis eval` of the export (full held-out split) within a point of the swarm's eval of that version
    # (the swarm sends int8 activations between its stages; the export runs in one fp32 process)
    after = summary["evals_after"][0]
    assert after["items"] == swarm_eval["n"]
    assert abs(after["strict"] - swarm_eval["accuracy"]) <= 0.01, (after, swarm_eval)
