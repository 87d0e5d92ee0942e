"""AdamW state export/load on every backend: exact resumption, torch <-> MLX interchange, refusals.

Each stage is a whole tiny random Qwen2 model (one stage, so ``token_logprobs`` gives a real
loss to train on). Torch on CPU is deterministic, so a resumed stage must match bit for bit;
MLX is compared with a tight tolerance.
"""

from __future__ import annotations

import numpy as np
import pytest

pytest.importorskip("torch")

from backends import registry  # noqa: E402
from backends.base import BackendError, OptimizerConfig, StageBackend  # noqa: E402
from engine.model.checkpoint import Checkpoint  # noqa: E402
from engine.model.loader import load_stage  # noqa: E402
from engine.model.random_checkpoint import small_config, write_random_checkpoint  # noqa: E402
from engine.model.shard_plan import plan_stages  # noqa: E402

VOCAB = 30
OPT = OptimizerConfig(lr=1e-2, beta1=0.8, beta2=0.95, eps=1e-6, weight_decay=0.1)
BACKENDS = [pytest.param("torch"), pytest.param("mlx", marks=pytest.mark.mlx)]


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory) -> Checkpoint:
    config = small_config(VOCAB, model_type="qwen2", hidden_size=32, num_layers=2, num_heads=4, num_kv_heads=2)
    return Checkpoint(write_random_checkpoint(tmp_path_factory.mktemp("opt") / "m", config, seed=3, init_std=0.1))


def _skip_unavailable(name: str) -> None:
    reason = registry.unavailable_reason(name)
    if reason:
        pytest.skip(reason)


@pytest.fixture(params=BACKENDS)
def backend(request) -> str:
    _skip_unavailable(request.param)
    return request.param


def _stage(checkpoint: Checkpoint, name: str, weights: dict[str, np.ndarray] | None = None) -> StageBackend:
    stage = load_stage(checkpoint, plan_stages(checkpoint.config.num_hidden_layers, 1)[0], name, "cpu", OPT)
    if weights is not None:
        stage.set_weights(weights)
    return stage


def _accumulate(stage: StageBackend, seed: int) -> None:
    """Backpropagate a mean log-likelihood loss of a random batch (gradients accumulate)."""
    tokens = np.random.default_rng(seed).integers(0, VOCAB, (3, 9)).astype(np.int64)
    logp = stage.token_logprobs(tokens[:, :-1], tokens[:, 1:], key="k")
    stage.backward("k", np.full_like(logp, -1.0 / logp.size))


def _train(stage: StageBackend, seeds) -> StageBackend:
    for seed in seeds:
        _accumulate(stage, seed)
        stage.step(grad_scale=0.7)
    return stage


def _assert_same(got: dict[str, np.ndarray], want: dict[str, np.ndarray], exact: bool) -> None:
    assert got.keys() == want.keys()
    for k in want:
        if exact:
            assert np.array_equal(got[k], want[k]), k
        else:
            np.testing.assert_allclose(got[k], want[k], rtol=1e-6, atol=1e-7, err_msg=k)


def test_optimizer_state_names_every_parameter_with_moments_and_step(checkpoint, backend):
    stage = _stage(checkpoint, backend)
    fresh = stage.optimizer_state()
    params = stage.state_dict()
    assert set(fresh) == {f"{n}.{s}" for n in params for s in ("exp_avg", "exp_avg_sq", "step")}
    assert all(not a.any() for a in fresh.values())  # never stepped: zeros and step 0
    _train(stage, [1, 2])
    state = stage.optimizer_state()
    for name, p in params.items():
        assert state[f"{name}.exp_avg"].shape == state[f"{name}.exp_avg_sq"].shape == p.shape
        assert state[f"{name}.step"].shape == () and state[f"{name}.step"] == 2
    assert (state["model.norm.weight.exp_avg_sq"] > 0).all()


def test_exported_optimizer_state_resumes_a_fresh_stage_exactly(checkpoint, backend):
    trained = _train(_stage(checkpoint, backend), [1, 2, 3])
    resumed = _stage(checkpoint, backend, trained.state_dict())
    resumed.load_optimizer_state(trained.optimizer_state())
    weights_only = _stage(checkpoint, backend, trained.state_dict())  # moments restart: a different step
    for stage in (trained, resumed, weights_only):
        _train(stage, [4])
    exact = backend == "torch"
    _assert_same(resumed.state_dict(), trained.state_dict(), exact)
    _assert_same(resumed.optimizer_state(), trained.optimizer_state(), exact)
    diff = max(np.abs(weights_only.state_dict()[k] - v).max() for k, v in trained.state_dict().items())
    assert diff > 1e-4


@pytest.mark.mlx
@pytest.mark.parametrize("source, target", [("torch", "mlx"), ("mlx", "torch")])
def test_optimizer_state_moves_between_torch_and_mlx_and_the_next_step_matches(checkpoint, source, target):
    _skip_unavailable("mlx")
    trained = _train(_stage(checkpoint, source), [1, 2, 3])
    other = _stage(checkpoint, target, trained.state_dict())
    other.load_optimizer_state(trained.optimizer_state())
    _accumulate(trained, 4)
    other.set_grads(trained.grads())  # the same gradients: only the optimisers are compared
    trained.step(grad_scale=0.7)
    other.step(grad_scale=0.7)
    for got, want in ((other.state_dict(), trained.state_dict()), (other.optimizer_state(), trained.optimizer_state())):
        assert got.keys() == want.keys()
        for k in want:
            np.testing.assert_allclose(got[k], want[k], rtol=1e-5, atol=1e-6, err_msg=k)


def _corruptions(good: dict[str, np.ndarray]):
    name = "model.norm.weight"
    yield "missing", {k: v for k, v in good.items() if k != f"{name}.exp_avg"}
    yield "unknown", {**good, "no.such.weight.exp_avg": np.zeros(3, np.float32)}
    yield "shape", {**good, f"{name}.exp_avg_sq": np.zeros(3, np.float32)}
    yield "non-finite", {**good, f"{name}.exp_avg": np.full_like(good[f"{name}.exp_avg"], np.nan)}
    yield "negative", {**good, f"{name}.exp_avg_sq": -np.ones_like(good[f"{name}.exp_avg_sq"])}
    yield "step count", {**good, f"{name}.step": np.asarray(1.5, np.float32)}
    yield "step count", {**good, f"{name}.step": np.asarray(-1.0, np.float32)}


def test_corrupt_optimizer_state_is_refused_and_leaves_the_stage_unchanged(checkpoint, backend):
    stage = _train(_stage(checkpoint, backend), [1, 2])
    twin = _train(_stage(checkpoint, backend), [1, 2])
    good = stage.optimizer_state()
    for message, bad in _corruptions(good):
        with pytest.raises(BackendError, match=message):
            stage.load_optimizer_state(bad)
        _assert_same(stage.optimizer_state(), good, exact=True)
    _train(stage, [3])  # still usable, and exactly where it was
    _train(twin, [3])
    _assert_same(stage.state_dict(), twin.state_dict(), exact=backend == "torch")


@pytest.mark.mlx
def test_mlx_refuses_a_state_whose_parameters_have_different_step_counts(checkpoint):
    _skip_unavailable("mlx")
    stage = _train(_stage(checkpoint, "mlx"), [1])
    state = stage.optimizer_state()
    with pytest.raises(BackendError, match="one step count"):
        stage.load_optimizer_state({**state, "model.norm.weight.step": np.asarray(7.0, np.float32)})
    _assert_same(stage.optimizer_state(), state, exact=True)
