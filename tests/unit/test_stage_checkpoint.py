"""A node's stage checkpoint carries its weights, version and AdamW moments."""

import numpy as np
import pytest

from backends.base import BackendError, OptimizerConfig
from engine.model.shard_plan import plan_stages
from engine.paths import base_checkpoint_dir
from engine.swarm.stage_runtime import StageRuntime, optimizer_path


def _trained_runtime():
    rt = StageRuntime("torch", "cpu")
    spec = plan_stages(2, 2)[0]
    rt.load_checkpoint(base_checkpoint_dir(), spec, OptimizerConfig(lr=1e-3))
    ids = np.random.default_rng(0).integers(3, 12, size=(4, 6))
    for step in range(2):
        out = rt.train_forward(f"k{step}", ids)
        rt.backend.backward(f"k{step}", np.ones_like(out) * 1e-2)
        rt.backend.step()
    return rt, spec


def test_a_restored_stage_continues_with_its_weights_and_optimizer_moments(tmp_path):
    rt, spec = _trained_runtime()
    path = tmp_path / "stage0.safetensors"
    rt.save_stage(path, version=7)
    assert optimizer_path(path).exists()
    again = StageRuntime("torch", "cpu")
    again.load_checkpoint(base_checkpoint_dir(), spec, OptimizerConfig(lr=1e-3))
    assert again.load_stage_file(path) == 7
    for name, value in rt.state_dict().items():
        np.testing.assert_array_equal(again.state_dict()[name], value)
    saved, loaded = rt.backend.optimizer_state(), again.backend.optimizer_state()
    assert saved.keys() == loaded.keys()
    for key in saved:
        np.testing.assert_array_equal(loaded[key], saved[key])
    rt.close(), again.close()


def test_a_corrupt_or_foreign_optimizer_file_costs_the_moments_not_the_weights(tmp_path):
    rt, spec = _trained_runtime()
    path = tmp_path / "stage0.safetensors"
    rt.save_stage(path, version=3)
    optimizer_path(path).write_bytes(b"not safetensors")
    again = StageRuntime("torch", "cpu")
    again.load_checkpoint(base_checkpoint_dir(), spec, OptimizerConfig(lr=1e-3))
    assert again.load_stage_file(path) == 3
    for name, value in rt.state_dict().items():
        np.testing.assert_array_equal(again.state_dict()[name], value)
    assert all(float(v.max(initial=0.0)) == 0.0 for k, v in again.backend.optimizer_state().items()
               if k.endswith(".exp_avg_sq"))
    rt.close(), again.close()


def test_a_non_finite_aggregated_gradient_is_skipped_and_the_weights_kept():
    rt, _ = _trained_runtime()
    before = {k: v.copy() for k, v in rt.state_dict().items()}
    poisoned = {name: np.full(value.shape, 3e38, dtype=np.float32) for name, value in before.items()}
    poisoned[next(iter(poisoned))][0] = np.nan
    assert rt.apply(poisoned, max_grad_norm=1.0, version=9) == 0.0
    assert rt.version == 9 and rt.last_step_skipped  # what its `stepped` tells the coordinator
    for name, value in rt.state_dict().items():
        np.testing.assert_array_equal(value, before[name])
    finite = {name: np.full(value.shape, 1e-3, dtype=np.float32) for name, value in before.items()}
    assert rt.apply(finite, max_grad_norm=1.0, version=10) > 0 and not rt.last_step_skipped
    assert any(not np.array_equal(rt.state_dict()[n], before[n]) for n in before)
    rt.close()


def test_an_inference_replica_told_to_train_keeps_its_weights_and_version_and_gains_an_optimiser():
    rt, spec = _trained_runtime()
    weights = rt.state_dict()
    follower = StageRuntime("torch", "cpu")  # an inference replica: the stage's weights, no optimiser
    follower.load_weights(spec, rt.model_config.to_hf_dict(), weights, OptimizerConfig(trainable=False), version=5)
    with pytest.raises(BackendError, match="inference only"):
        follower.backend.optimizer_state()
    follower.reload(OptimizerConfig(lr=1e-3))
    assert follower.version == 5 and follower.backend.optimizer_state()
    for name, value in weights.items():
        np.testing.assert_array_equal(follower.state_dict()[name], value)
    ids = np.random.default_rng(1).integers(3, 12, size=(4, 6))
    out = follower.train_forward("k", ids)
    follower.backend.backward("k", np.ones_like(out) * 1e-2)
    follower.backend.step()
    assert any(not np.array_equal(follower.state_dict()[n], v) for n, v in weights.items())  # it trains now
    rt.close(), follower.close()
