"""Finding 8 of issue 14: a stage whose replicas all left is never refilled with base weights
labelled as the run's version; its next node gets a hash-checked checkpoint of exactly that
version, or is told that training is paused and why.

Real coordinator on loopback with real websockets (``tests.support.hostile_node.join``) and
real stage runtimes (torch) writing and reading real stage checkpoints.
"""

from __future__ import annotations

import asyncio

import numpy as np
import pytest

from backends.base import OptimizerConfig
from engine.model.safetensors_reader import SafetensorsFile
from engine.model.shard_plan import plan_stages
from engine.paths import base_checkpoint_dir
from engine.swarm.coordinator import Coordinator, CoordinatorConfig
from engine.swarm.stage_runtime import StageRuntime
from tests.support.hostile_node import join


def test_with_every_replica_gone_a_trainer_gets_the_current_versions_checkpoint_or_hears_training_is_paused(
        tmp_path):
    async def main():
        c = Coordinator(CoordinatorConfig(db_path=str(tmp_path / "c.db"), base_checkpoint=str(base_checkpoint_dir()),
                                          num_stages=1, port=0))
        url = await c.start()
        try:
            c.book.advance(7)
            c.steps.checkpoints[0], c.steps.checkpoint_versions[0] = "/elsewhere/stage0.safetensors", 5
            refused = await join(url)
            assert refused.reply["type"] == "shutdown" and "training is paused" in refused.reply["reason"]
            assert "version 7" in refused.reply["reason"] and "of version 5" in refused.reply["reason"]
            assert c.stats()["paused"] and c.sessions == {}
            await refused.close()
            c.steps.checkpoints[0], c.steps.checkpoint_versions[0] = "/elsewhere/stage0.safetensors", 7
            welcomed = await join(url)
            assert welcomed.reply["type"] == "welcome" and welcomed.reply["source"] == "checkpoint"
            assert welcomed.reply["stage_checkpoint"] == "/elsewhere/stage0.safetensors"
            assert welcomed.reply["version"] == 7 and c.stats()["paused"] == []
            await welcomed.close()
        finally:
            await c.stop()
    asyncio.run(asyncio.wait_for(main(), 60))


def test_a_node_refuses_to_serve_base_or_another_versions_or_corrupt_weights_as_the_runs_version(tmp_path):
    spec = plan_stages(2, 2)[0]
    trained = StageRuntime("torch", "cpu")
    trained.load_checkpoint(base_checkpoint_dir(), spec, OptimizerConfig(lr=1e-3))
    path = tmp_path / "stage0.safetensors"
    trained.save_stage(path, version=5)
    trained.close()
    rt = StageRuntime("torch", "cpu")
    try:
        with pytest.raises(ValueError, match="no checkpoint of it"):
            rt.load_checkpoint(base_checkpoint_dir(), spec, OptimizerConfig(), tmp_path / "missing.safetensors", 7)
        with pytest.raises(ValueError, match="holds version 5"):
            rt.load_checkpoint(base_checkpoint_dir(), spec, OptimizerConfig(), path, 7)
        rt.load_checkpoint(base_checkpoint_dir(), spec, OptimizerConfig(), path, 5)
        assert rt.version == 5
        from safetensors.numpy import save

        f = SafetensorsFile(path)
        weights = f.read_many(f.names)
        name = sorted(weights)[0]
        weights[name] = weights[name] + np.float32(1.0)  # same file, same recorded hash, other weights
        path.write_bytes(save(weights, metadata=dict(f.metadata)))
        with pytest.raises(ValueError, match="content hash"):
            rt.load_checkpoint(base_checkpoint_dir(), spec, OptimizerConfig(), path, 5)
    finally:
        rt.close()
