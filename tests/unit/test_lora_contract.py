"""LoRA on every backend: frozen base, adapters only in the state APIs, PEFT's numbers, torch == MLX.

Each test runs once per backend variant (``tests.support.stage_variants``) on the tiny
tied Llama of ``tests.support.tiny_tied_llama`` (and a tied Qwen2 with q/k/v biases for
the gradients). The reference is PEFT's LoRA on the unsplit ``transformers`` model with
the same adapter values.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")
peft = pytest.importorskip("peft")

from backends.base import BackendError, LoraConfig, OptimizerConfig  # noqa: E402
from backends.lora import LORA_A, LORA_B  # noqa: E402
from engine.model.checkpoint import Checkpoint  # noqa: E402
from engine.model.random_checkpoint import small_config, write_random_checkpoint  # noqa: E402
from engine.model.sharded_decode import pipeline_forward  # noqa: E402
from engine.rl.pipeline import LocalPipeline  # noqa: E402
from tests.support.stage_variants import BACKENDS, assert_grads_close, load_pipeline, skip_reason  # noqa: E402
from tests.support.tiny_tied_llama import write_tiny_tied_llama  # noqa: E402

LORA = LoraConfig(enabled=True, rank=4, alpha=8.0)  # every target module
SOME = LoraConfig(enabled=True, rank=3, alpha=5.0, target_modules=("q_proj", "v_proj", "down_proj"), init_seed=7)


@pytest.fixture(params=BACKENDS)
def variant(request) -> str:
    reason = skip_reason(request.param)
    if reason:
        pytest.skip(reason)
    return request.param


@pytest.fixture(scope="session")
def checkpoints(tmp_path_factory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("lora")
    qwen2 = small_config(53, model_type="qwen2", hidden_size=48, num_layers=3, num_heads=4, num_kv_heads=2,
                         tie_word_embeddings=True)
    return {"llama": write_tiny_tied_llama(root / "llama", init_std=0.05, max_shard_bytes=60_000),
            "qwen2": write_random_checkpoint(root / "qwen2", qwen2, seed=3, init_std=0.05)}


def _hf(path: Path):
    return transformers.AutoModelForCausalLM.from_pretrained(str(path), local_files_only=True,
                                                             dtype=torch.float32).eval()


def _peft(path: Path, lora: LoraConfig, adapters: dict[str, np.ndarray]):
    """The unsplit transformers model with PEFT's LoRA layers holding ``adapters``."""
    model = _hf(path)
    config = peft.LoraConfig(r=lora.rank, lora_alpha=lora.alpha, target_modules=list(lora.target_modules),
                             lora_dropout=0.0)
    peft.inject_adapter_in_model(config, model)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if ".lora_" in name:
                p.copy_(torch.from_numpy(adapters[name.replace(".default.weight", ".weight")]))
    return model


def _batch(vocab: int, seed: int):
    rng = np.random.default_rng(seed)
    tokens, targets = rng.integers(0, vocab, (3, 8)), rng.integers(0, vocab, (3, 8))
    return tokens.astype(np.int64), targets.astype(np.int64), rng.standard_normal((3, 8)).astype(np.float32)


def _random_adapters(pipe: LocalPipeline, seed: int) -> None:
    """Give every ``B`` random values (at zero, ``A`` gets no gradient and ``B A`` computes nothing)."""
    rng = np.random.default_rng(seed)
    pipe.set_weights([{n: (rng.standard_normal(a.shape) * 0.2).astype(np.float32) if n.endswith(LORA_B) else a
                       for n, a in sd.items()} for sd in pipe.state_dicts()])


def _vocab(path: Path) -> int:
    return Checkpoint(path).config.vocab_size


def test_lora_config_refuses_what_no_backend_can_build():
    for bad in (dict(rank=0), dict(rank=2.5), dict(alpha=0.0), dict(alpha=float("nan")),
                dict(target_modules=("q_proj", "lm_head")), dict(target_modules=()),
                dict(target_modules=("q_proj", "q_proj"))):
        with pytest.raises(ValueError):
            LoraConfig(enabled=True, **bad)
    with pytest.raises(ValueError):
        LoraConfig(target_modules="q_proj")  # a string is not a tuple of names
    assert LoraConfig(enabled=True, rank=4, alpha=8).scaling == 2.0
    assert not OptimizerConfig().lora.enabled  # full fine-tuning unless asked


@pytest.mark.parametrize("num_stages", [1, 2])
def test_lora_at_init_is_the_base_model_and_exposes_only_adapters(variant, checkpoints, num_stages):
    path = checkpoints["llama"]
    stages = load_pipeline(path, variant, num_stages, OptimizerConfig(lora=LORA))
    tokens = _batch(_vocab(path), 1)[0]
    with torch.no_grad():
        want = _hf(path)(torch.from_numpy(tokens)).logits.numpy()
    np.testing.assert_allclose(pipeline_forward(stages, tokens), want, rtol=0, atol=1e-5)
    checkpoint = Checkpoint(path)
    for stage in stages:
        base_names = checkpoint.stage_tensor_names(stage.spec)
        layers = range(stage.spec.layer_start, stage.spec.layer_end)
        state = stage.state_dict()
        assert len(state) == 2 * 7 * len(layers)  # A and B for all seven linears of each layer
        assert all(n.endswith((LORA_A, LORA_B)) and n[: n.index(".lora_")] + ".weight" in base_names for n in state)
        assert all(not a.any() for n, a in state.items() if n.endswith(LORA_B))  # B starts at zero
        assert all(a.any() for n, a in state.items() if n.endswith(LORA_A))
        assert set(stage.grads()) == set(state) and stage.tied_names == ()  # the embedding is frozen
        assert set(stage.optimizer_state()) == {f"{n}.{s}" for n in state for s in ("exp_avg", "exp_avg_sq", "step")}
        merged = stage.merged_state_dict()
        base = checkpoint.read(base_names)
        assert set(merged) == set(base_names)
        for name in base:
            np.testing.assert_array_equal(merged[name], base[name])


@pytest.mark.parametrize("arch,lora", [("llama", LORA), ("qwen2", SOME)])
@pytest.mark.parametrize("num_stages", [1, 3])
def test_lora_pipeline_gradients_equal_peft_on_the_unsplit_transformers_model(variant, checkpoints, arch, lora,
                                                                               num_stages):
    path = checkpoints[arch]
    pipe = LocalPipeline(load_pipeline(path, variant, num_stages, OptimizerConfig(lora=lora)))
    _random_adapters(pipe, seed=2)
    adapters = {n: a for sd in pipe.state_dicts() for n, a in sd.items()}
    reference = _peft(path, lora, adapters)
    tokens, targets, weights = _batch(_vocab(path), 3)
    logits = reference(torch.from_numpy(tokens)).logits
    want_logp = torch.log_softmax(logits, -1).gather(-1, torch.from_numpy(targets)[..., None])[..., 0]
    (want_logp * torch.from_numpy(weights)).sum().backward()
    want = {n.replace(".default.weight", ".weight"): p.grad.numpy() for n, p in reference.named_parameters()
            if p.grad is not None}
    assert set(want) == set(adapters)  # PEFT froze the base too
    np.testing.assert_allclose(pipeline_forward(pipe.backends, tokens), logits.detach().numpy(), rtol=0, atol=1e-5)
    np.testing.assert_allclose(pipe.token_logprobs(tokens, targets, key="k"), want_logp.detach().numpy(),
                               rtol=0, atol=1e-5)
    pipe.backward("k", weights)
    got = {n: g for stage_grads in pipe.grads() for n, g in stage_grads.items()}
    assert_grads_close(got, want)
    want_sq = sum(float(np.square(g, dtype=np.float64).sum()) for g in want.values())
    assert sum(pipe.grad_sq_norms()) == pytest.approx(want_sq, rel=1e-5)


def test_a_lora_step_changes_only_the_adapters_and_base_tensors_are_refused(variant, checkpoints):
    path = checkpoints["llama"]
    pipe = LocalPipeline(load_pipeline(path, variant, 2, OptimizerConfig(lr=1e-2, lora=SOME)))
    _random_adapters(pipe, seed=4)
    before = pipe.state_dicts()
    tokens, targets, weights = _batch(_vocab(path), 5)
    pipe.token_logprobs(tokens, targets, key="k")
    pipe.backward("k", weights)
    pipe.step()
    checkpoint = Checkpoint(path)
    for stage, old in zip(pipe.backends, before):
        new = stage.state_dict()
        assert set(new) == set(old) and all(np.abs(new[n] - old[n]).max() > 1e-4 for n in new)
        base = checkpoint.read(checkpoint.stage_tensor_names(stage.spec))
        merged = stage.merged_state_dict()
        for name, weight in base.items():
            module = name[: -len(".weight")]
            if module + LORA_A in new:
                update = SOME.scaling * new[module + LORA_B] @ new[module + LORA_A]
                np.testing.assert_allclose(merged[name], weight + update, rtol=0, atol=1e-6, err_msg=name)
            else:
                np.testing.assert_array_equal(merged[name], weight)  # frozen: not even rounding
        a_base_weight = next(n for n in base if n.endswith("q_proj.weight"))
        for call in (stage.set_weights, stage.apply_delta, stage.set_grads):
            with pytest.raises(BackendError):
                call({a_base_weight: base[a_base_weight]})
        with pytest.raises(BackendError):
            stage.grads([a_base_weight])


def test_an_inference_only_lora_stage_serves_the_adapters_it_is_given_with_kv_caches(variant, checkpoints):
    path = checkpoints["llama"]
    trainer = LocalPipeline(load_pipeline(path, variant, 2, OptimizerConfig(lora=LORA)))
    _random_adapters(trainer, seed=6)
    server = LocalPipeline(load_pipeline(path, variant, 2, OptimizerConfig(trainable=False, lora=LORA)))
    for stage, before, now in zip(server.backends, server.state_dicts(), trainer.state_dicts()):
        stage.apply_delta({n: now[n] - before[n] for n in now})  # adapter deltas, as a weight stream sends
    tokens = _batch(_vocab(path), 7)[0]
    want = pipeline_forward(trainer.backends, tokens)
    np.testing.assert_allclose(pipeline_forward(server.backends, tokens), want, rtol=0, atol=1e-5)
    cached = [pipeline_forward(server.backends, tokens[:, a:b], cache_id="c") for a, b in ((0, 5), (5, 6), (6, 8))]
    np.testing.assert_allclose(np.concatenate(cached, axis=1), want, rtol=0, atol=1e-5)  # KV-cached decoding
    with pytest.raises(BackendError):
        server.backends[0].optimizer_state()


def test_merged_lora_weights_load_into_transformers_with_the_pipeline_logits(variant, checkpoints):
    path = checkpoints["llama"]
    pipe = LocalPipeline(load_pipeline(path, variant, 3, OptimizerConfig(lora=LORA)))
    _random_adapters(pipe, seed=8)
    merged = {n: w for stage in pipe.backends for n, w in stage.merged_state_dict().items()}
    model = _hf(path)
    missing, unexpected = model.load_state_dict({n: torch.from_numpy(w) for n, w in merged.items()}, strict=False)
    assert not unexpected and set(missing) <= {"lm_head.weight"}  # tied: the head is the embedding
    tokens = _batch(_vocab(path), 9)[0]
    with torch.no_grad():
        want = model(torch.from_numpy(tokens)).logits.numpy()
    np.testing.assert_allclose(pipeline_forward(pipe.backends, tokens), want, rtol=0, atol=1e-5)


@pytest.mark.mlx
@pytest.mark.parametrize("chain", [["torch-cpu", "mlx"], ["mlx", "torch-cpu", "mlx"]])
def test_lora_adapters_mean_the_same_on_torch_and_mlx_and_in_a_mixed_chain(checkpoints, chain):
    reason = skip_reason("mlx")
    if reason:
        pytest.skip(reason)
    path = checkpoints["llama"]
    opt = OptimizerConfig(lr=1e-2, lora=LORA)
    torch_pipe = LocalPipeline(load_pipeline(path, "torch-cpu", len(chain), opt))
    mlx_pipe = LocalPipeline(load_pipeline(path, "mlx", len(chain), opt))
    mixed = LocalPipeline(load_pipeline(path, chain, len(chain), opt))
    for a, b in zip(torch_pipe.state_dicts(), mlx_pipe.state_dicts()):
        assert all(np.array_equal(a[n], b[n]) for n in a)  # the same first adapter everywhere
    vocab = _vocab(path)
    for step in range(2):
        tokens, targets, weights = _batch(vocab, 10 + step)
        for pipe in (torch_pipe, mlx_pipe, mixed):
            pipe.zero_grad()
            pipe.token_logprobs(tokens, targets, key="k")
            pipe.backward("k", weights)
        want = torch_pipe.grads()
        for other in (mlx_pipe, mixed):
            for got_stage, want_stage in zip(other.grads(), want):
                assert_grads_close(got_stage, want_stage)
        for pipe in (torch_pipe, mlx_pipe, mixed):
            pipe.step()
    tokens = _batch(vocab, 20)[0]
    want_logits = pipeline_forward(torch_pipe.backends, tokens)
    for other in (mlx_pipe, mixed):
        np.testing.assert_allclose(pipeline_forward(other.backends, tokens), want_logits, rtol=0, atol=1e-5)
    fresh = LocalPipeline(load_pipeline(path, "mlx", len(chain), opt))  # torch's adapters and moments move over
    fresh.set_weights(torch_pipe.state_dicts())
    for stage, source in zip(fresh.backends, torch_pipe.backends):
        stage.load_optimizer_state(source.optimizer_state())
    np.testing.assert_allclose(pipeline_forward(fresh.backends, tokens), want_logits, rtol=0, atol=1e-5)
