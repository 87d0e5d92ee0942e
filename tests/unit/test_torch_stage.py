"""TorchStage specifics beyond the shared contract: device choice, threads, weights vs pending keys."""

from __future__ import annotations

import numpy as np
import pytest

torch = pytest.importorskip("torch")

from backends import registry  # noqa: E402
from backends.base import BackendError, BackendUnavailable, StageBackend  # noqa: E402
from backends.torch_stage import TorchStage, pick_device  # noqa: E402
from engine.model.checkpoint import Checkpoint  # noqa: E402
from engine.model.loader import load_stage  # noqa: E402
from engine.model.random_checkpoint import small_config, write_random_checkpoint  # noqa: E402
from engine.model.shard_plan import plan_stages  # noqa: E402


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    config = small_config(vocab_size=30, hidden_size=32, num_layers=2, num_heads=4, num_kv_heads=2)
    return Checkpoint(write_random_checkpoint(tmp_path_factory.mktemp("torch") / "m", config, seed=5))


def test_registry_creates_a_torch_stage_that_satisfies_the_protocol():
    stage = registry.create("torch", device="cpu")
    assert isinstance(stage, TorchStage) and isinstance(stage, StageBackend)
    assert stage.name == "torch" and stage.device == "cpu"


def test_default_device_prefers_cuda_then_mps_then_cpu():
    expected = "cuda" if torch.cuda.is_available() else "mps" if torch.backends.mps.is_available() else "cpu"
    assert pick_device(None).type == expected


def test_unavailable_or_unknown_devices_are_refused_clearly():
    with pytest.raises(BackendUnavailable):
        pick_device("not-a-device")
    if not torch.cuda.is_available():
        with pytest.raises(BackendUnavailable, match="CUDA"):
            TorchStage(device="cuda")
    if not torch.backends.mps.is_available():
        with pytest.raises(BackendUnavailable, match="MPS"):
            TorchStage(device="mps")


def test_num_threads_caps_torch_intra_op_threads(monkeypatch):
    before = torch.get_num_threads()
    try:
        TorchStage(device="cpu", num_threads=1)
        assert torch.get_num_threads() == 1
        monkeypatch.setenv("POLIS_TORCH_THREADS", "2")
        TorchStage(device="cpu")
        assert torch.get_num_threads() == 2
    finally:
        torch.set_num_threads(before)
    with pytest.raises(BackendError):
        TorchStage(device="cpu", num_threads=0)


def test_changing_weights_before_a_pending_backward_is_a_clear_error(checkpoint):
    stage = load_stage(checkpoint, plan_stages(2, 2)[1], "torch", device="cpu")
    hidden = np.random.default_rng(0).standard_normal((1, 4, 32)).astype(np.float32)
    out = stage.forward(hidden, key="k")
    stage.apply_delta({"model.norm.weight": np.ones(32, np.float32)})
    with pytest.raises(BackendError, match="weights changed"):
        stage.backward("k", np.ones_like(out))


def test_load_copies_weights_so_later_changes_to_the_arrays_do_not_leak_in(checkpoint):
    spec = plan_stages(2, 1)[0]
    weights = checkpoint.read_stage(spec)
    stage = TorchStage(device="cpu")
    stage.load(spec, weights, checkpoint.config)
    tokens = np.array([[1, 2, 3]])
    before = stage.forward(tokens)
    for array in weights.values():
        array[...] = 0.0
    np.testing.assert_array_equal(stage.forward(tokens), before)


def test_bf16_hidden_states_are_accepted_and_widened(checkpoint):
    ml_dtypes = pytest.importorskip("ml_dtypes")
    stage = load_stage(checkpoint, plan_stages(2, 2)[1], "torch", device="cpu")
    hidden = np.random.default_rng(1).standard_normal((1, 3, 32)).astype(ml_dtypes.bfloat16)
    np.testing.assert_allclose(stage.forward(hidden), stage.forward(hidden.astype(np.float32)), atol=1e-6)
