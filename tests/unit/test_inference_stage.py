"""A stage loaded for inference only (``OptimizerConfig(trainable=False)``): serves, takes weights, never steps."""

from __future__ import annotations

import numpy as np
import pytest

from backends import registry
from backends.base import BackendError, OptimizerConfig
from engine.model.checkpoint import Checkpoint
from engine.model.random_checkpoint import small_config, write_random_checkpoint
from engine.model.shard_plan import plan_stages


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    config = small_config(vocab_size=30, hidden_size=32, num_layers=2, num_heads=4, num_kv_heads=2)
    return Checkpoint(write_random_checkpoint(tmp_path_factory.mktemp("inf") / "m", config, seed=7))


@pytest.mark.parametrize("name", ["torch", pytest.param("mlx", marks=pytest.mark.mlx)])
def test_an_inference_only_stage_generates_and_follows_weights_but_cannot_step(name, checkpoint):
    reason = registry.unavailable_reason(name)
    if reason:
        pytest.skip(reason)
    spec = plan_stages(2, 2)[0]
    stage = registry.create(name, device="cpu" if name == "torch" else None)
    try:
        stage.load(spec, checkpoint.stage_weights(spec), checkpoint.config, OptimizerConfig(trainable=False))
        ids = np.array([[1, 2, 3]], dtype=np.int64)
        before = stage.forward(ids, cache_id="job")
        weights = stage.state_dict()
        stage.set_weights({n: w + np.float32(0.01) for n, w in weights.items()})
        stage.apply_delta({n: np.full_like(w, -0.01) for n, w in weights.items()})
        assert all(np.allclose(stage.state_dict()[n], w, atol=1e-6) for n, w in weights.items())
        assert np.allclose(stage.forward(ids), before, atol=1e-5)
        with pytest.raises(BackendError, match="inference only"):
            stage.step()
        with pytest.raises(BackendError, match="inference only"):
            stage.optimizer_state()
    finally:
        stage.close()
