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


def _coordinator(tmp_path, num_stages: int = 1) -> Coordinator:
    return Coordinator(CoordinatorConfig(db_path=str(tmp_path / "c.db"), base_checkpoint=str(base_checkpoint_dir()),
                                         num_stages=num_stages, port=0))


def test_a_coordinator_killed_after_trainers_stepped_rolls_forward_to_the_version_they_hold(tmp_path):
    """Killed between 'apply' and 'stepped', the coordinator restarts one version behind its trainers;
    the first trainer back at exactly the version it began settles it (a CI run paused here for good)."""
    async def main():
        first = _coordinator(tmp_path)
        await first.start()
        first.book.advance(4)
        first.book.begin_apply(5)  # trainers were told to step to 5; the coordinator dies before 'stepped'
        run_id = first.run_id
        await first.stop()
        c = _coordinator(tmp_path)
        url = await c.start()
        try:
            assert c.book.version == 4 and c.book.unconfirmed == 5
            ahead = {"stage": 0, "num_stages": 1, "run_id": run_id}
            liar = await join(url, **ahead, version=6)  # two ahead: never adopted
            assert liar.reply["type"] == "shutdown" and c.book.version == 4
            await liar.close()
            back = await join(url, **ahead, version=5)
            assert back.reply["type"] == "welcome" and back.reply["source"] == "keep"
            assert back.reply["version"] == 5 and c.book.version == 5 and c.book.unconfirmed is None
            assert c.stats()["counters"]["versions_recovered"] == 1
            await back.close()
        finally:
            await c.stop()
        again = _coordinator(tmp_path)  # durable: the adopted version survives the next restart
        await again.start()
        try:
            assert again.book.version == 5 and again.book.unconfirmed is None
        finally:
            await again.stop()
    asyncio.run(asyncio.wait_for(main(), 60))


def test_a_trainer_back_at_the_recorded_version_settles_that_the_step_in_doubt_never_happened(tmp_path):
    async def main():
        first = _coordinator(tmp_path)
        await first.start()
        first.book.advance(4)
        first.book.begin_apply(5)
        run_id = first.run_id
        await first.stop()
        c = _coordinator(tmp_path)
        url = await c.start()
        try:
            back = await join(url, stage=0, num_stages=1, run_id=run_id, version=4)
            assert back.reply["type"] == "welcome" and back.reply["source"] == "keep"
            assert c.book.version == 4 and c.book.unconfirmed is None
            await back.close()
            late = await join(url, stage=0, num_stages=1, run_id=run_id, version=5)  # too late to move the run
            assert c.book.version == 4
            await late.close()
        finally:
            await c.stop()
    asyncio.run(asyncio.wait_for(main(), 60))
