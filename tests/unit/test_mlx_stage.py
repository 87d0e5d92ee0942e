"""MLXStage against a tiny random transformers Llama/Qwen2 model: logits, KV cache, grads, AdamW, weights."""

from __future__ import annotations

import threading
from dataclasses import dataclass

import numpy as np
import pytest

pytest.importorskip("mlx.core")
torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

from backends import registry  # noqa: E402
from backends.base import BackendError, OptimizerConfig, StageBackend, StageSpec  # noqa: E402

pytestmark = pytest.mark.mlx

VOCAB = 40
SCALE = 0.1  #: std of the random weights (0.2 already puts fp32 noise of the reference itself near 1e-5)


@dataclass(frozen=True)
class _Config:
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    rms_norm_eps: float
    rope_theta: float
    attention_bias: bool
    tie_word_embeddings: bool


def _hf_model(arch: str, *, layers: int = 4, hidden: int = 64, tied: bool = False, seed: int = 0,
              head_dim: int | None = None):
    head_dim = head_dim or hidden // 4
    common = dict(vocab_size=VOCAB, hidden_size=hidden, intermediate_size=96, num_hidden_layers=layers,
                  num_attention_heads=4, num_key_value_heads=2, rms_norm_eps=1e-5, rope_theta=500.0,
                  tie_word_embeddings=tied)
    if arch == "llama":
        hf_config = transformers.LlamaConfig(head_dim=head_dim, **common)
        model_cls = transformers.LlamaForCausalLM
    else:
        hf_config = transformers.Qwen2Config(**common)
        model_cls = transformers.Qwen2ForCausalLM
    hf_config._attn_implementation = "eager"
    torch.manual_seed(seed)
    model = model_cls(hf_config).float().eval()
    with torch.no_grad():  # HF zero-initialises biases and ones norms: randomise so every term matters
        for name, p in model.named_parameters():
            p.copy_(torch.randn_like(p) * SCALE + (1.0 if "norm" in name else 0.0))
    config = _Config(vocab_size=VOCAB, hidden_size=hidden, intermediate_size=96, num_hidden_layers=layers,
                     num_attention_heads=4, num_key_value_heads=2, head_dim=head_dim, rms_norm_eps=1e-5,
                     rope_theta=500.0, attention_bias=arch == "qwen2", tie_word_embeddings=tied)
    return model, config


def _weights(model) -> dict[str, np.ndarray]:
    return {n: p.detach().numpy().copy() for n, p in model.named_parameters()}


def _slice(weights: dict[str, np.ndarray], spec: StageSpec) -> dict[str, np.ndarray]:
    out = {}
    for name, value in weights.items():
        if name.startswith("model.layers."):
            keep = spec.layer_start <= int(name.split(".")[2]) < spec.layer_end
        elif name == "model.embed_tokens.weight":
            keep = spec.is_first
        else:  # model.norm.weight, lm_head.weight
            keep = spec.is_last
        if keep:
            out[name] = value
    return out


def _specs(num_layers: int, num_stages: int) -> list[StageSpec]:
    bounds = np.linspace(0, num_layers, num_stages + 1).astype(int)
    return [StageSpec(i, num_stages, int(bounds[i]), int(bounds[i + 1])) for i in range(num_stages)]


def _pipeline(model, config, num_stages: int, optimizer: OptimizerConfig | None = None):
    stages = []
    for spec in _specs(config.num_hidden_layers, num_stages):
        stage = registry.create("mlx", device="cpu")
        stage.load(spec, _slice(_weights(model), spec), config, optimizer)
        stages.append(stage)
    return stages


def _run(stages, tokens, **kwargs):
    x = tokens
    for stage in stages:
        x = stage.forward(x, **kwargs)
    return x


def _tokens(batch: int, length: int, seed: int = 1) -> np.ndarray:
    return np.random.default_rng(seed).integers(0, VOCAB, size=(batch, length), dtype=np.int64)


@pytest.mark.parametrize("arch", ["llama", "qwen2"])
@pytest.mark.parametrize("num_stages", [1, 2])
def test_pipeline_logits_match_transformers(arch, num_stages):
    model, config = _hf_model(arch)
    stages = _pipeline(model, config, num_stages)
    tokens = _tokens(3, 11)
    logits = _run(stages, tokens)
    with torch.no_grad():
        expected = model(torch.from_numpy(tokens)).logits.numpy()
    assert logits.dtype == np.float32 and logits.flags.c_contiguous
    np.testing.assert_allclose(logits, expected, atol=1e-5, rtol=0)
    assert isinstance(stages[0], StageBackend)


def test_head_dim_independent_of_hidden_size_matches_transformers():
    model, config = _hf_model("llama", layers=2, head_dim=24)  # 4 heads x 24 != hidden 64
    stages = _pipeline(model, config, 2)
    tokens = _tokens(2, 9)
    with torch.no_grad():
        expected = model(torch.from_numpy(tokens)).logits.numpy()
    np.testing.assert_allclose(_run(stages, tokens), expected, atol=1e-5, rtol=0)


def test_tied_single_stage_matches_transformers_and_sums_both_embedding_gradients():
    model, config = _hf_model("llama", layers=2, tied=True)
    stages = _pipeline(model, config, 1)
    assert set(stages[0].state_dict()) == set(_weights(model))  # lm_head shares embed_tokens
    tokens = _tokens(2, 7)
    logits = stages[0].forward(tokens, key="k")
    torch_logits = model(torch.from_numpy(tokens)).logits
    np.testing.assert_allclose(logits, torch_logits.detach().numpy(), atol=1e-5, rtol=0)
    g = np.random.default_rng(3).standard_normal(logits.shape).astype(np.float32)
    assert stages[0].backward("k", g) is None
    (torch_logits * torch.from_numpy(g)).sum().backward()
    expected = model.model.embed_tokens.weight.grad.numpy()
    np.testing.assert_allclose(stages[0].grads()["model.embed_tokens.weight"], expected,
                               atol=1e-5 * np.abs(expected).max(), rtol=0)


def test_kv_cached_decode_equals_full_forward():
    model, config = _hf_model("qwen2")
    stages = _pipeline(model, config, 2)
    tokens = _tokens(2, 10)
    full = _run(stages, tokens)
    pieces = [_run(stages, tokens[:, :5], cache_id="c")]  # prefill
    pieces.append(_run(stages, tokens[:, 5:8], cache_id="c"))  # a chunk after a prefix
    pieces += [_run(stages, tokens[:, t:t + 1], cache_id="c") for t in range(8, 10)]  # decode
    np.testing.assert_allclose(np.concatenate(pieces, axis=1), full, atol=1e-5, rtol=0)
    for stage in stages:
        stage.drop_cache("c")
    np.testing.assert_allclose(_run(stages, tokens[:, :1], cache_id="c"), full[:, :1], atol=1e-5, rtol=0)
    with pytest.raises(BackendError, match="rows"):
        _run(stages, tokens[:1, 1:2], cache_id="c")


@pytest.mark.parametrize("arch", ["llama", "qwen2"])
def test_pipeline_gradients_match_torch_autograd_across_interleaved_micro_batches(arch):
    model, config = _hf_model(arch)
    first, last = _pipeline(model, config, 2)
    rng = np.random.default_rng(5)
    batches = [(_tokens(2, 9, seed=s), _tokens(2, 9, seed=s + 10)) for s in (1, 2)]
    weights = [rng.standard_normal((2, 9)).astype(np.float32) for _ in batches]
    temperature = 0.7

    logprobs = []
    for i, (tokens, targets) in enumerate(batches):  # both micro-batches in flight before any backward
        hidden = first.forward(tokens, key=f"mb{i}")
        logprobs.append(last.token_logprobs(hidden, targets, key=f"mb{i}", temperature=temperature))
    for i in reversed(range(len(batches))):
        grad_hidden = last.backward(f"mb{i}", weights[i])
        assert grad_hidden.shape == (2, 9, config.hidden_size) and grad_hidden.dtype == np.float32
        assert first.backward(f"mb{i}", grad_hidden) is None

    loss = 0.0
    for (tokens, targets), w, got in zip(batches, weights, logprobs):
        logits = model(torch.from_numpy(tokens)).logits / temperature
        lp = torch.log_softmax(logits, dim=-1).gather(-1, torch.from_numpy(targets)[..., None])[..., 0]
        np.testing.assert_allclose(got, lp.detach().numpy(), atol=1e-5, rtol=0)
        loss = loss + (lp * torch.from_numpy(w)).sum()
    loss.backward()
    got = {**first.grads(), **last.grads()}
    expected = {n: p.grad.numpy() for n, p in model.named_parameters()}
    assert set(got) == set(expected)
    for name, value in expected.items():
        np.testing.assert_allclose(got[name], value, atol=1e-5 * max(np.abs(value).max(), 1e-3), rtol=0,
                                   err_msg=name)
    with pytest.raises(BackendError, match="unknown training key"):
        last.backward("mb0", weights[0])


def test_adamw_step_matches_torch_adamw():
    model, config = _hf_model("qwen2", layers=2)
    opt_config = OptimizerConfig(lr=3e-3, beta1=0.9, beta2=0.99, eps=1e-8, weight_decay=0.1)
    (stage,) = _pipeline(model, config, 1, opt_config)
    params = dict(model.named_parameters())
    torch_opt = torch.optim.AdamW(params.values(), lr=opt_config.lr, betas=(opt_config.beta1, opt_config.beta2),
                                  eps=opt_config.eps, weight_decay=opt_config.weight_decay)
    rng = np.random.default_rng(7)
    for grad_scale in (0.5, 1.0, 2.0):  # three steps exercise the bias correction schedule
        grads = {n: rng.standard_normal(p.shape).astype(np.float32) for n, p in params.items()}
        stage.set_grads(grads)
        stage.step(grad_scale)
        for name, p in params.items():
            p.grad = torch.from_numpy(grads[name] * grad_scale)
        torch_opt.step()
        torch_opt.zero_grad()
    got = stage.state_dict()
    for name, p in params.items():
        np.testing.assert_allclose(got[name], p.detach().numpy(), atol=1e-6, rtol=0, err_msg=name)
    assert all(not g.any() for g in stage.grads().values())  # step zeroes the gradients


def test_state_dict_apply_delta_and_set_weights_round_trip():
    model, config = _hf_model("llama", layers=2)
    spec = _specs(2, 2)[1]
    weights = _slice(_weights(model), spec)
    stage = registry.create("mlx", device="cpu")
    stage.load(spec, weights, config)
    state = stage.state_dict()
    assert set(state) == set(weights)
    for name in weights:
        np.testing.assert_array_equal(state[name], weights[name])
    name = "model.layers.1.mlp.up_proj.weight"
    delta = np.random.default_rng(0).standard_normal(weights[name].shape).astype(np.float32)
    stage.apply_delta({name: delta})
    np.testing.assert_allclose(stage.state_dict()[name], weights[name] + delta, atol=1e-6)
    stage.set_weights({name: weights[name]})
    np.testing.assert_array_equal(stage.state_dict()[name], weights[name])
    state[name][...] = 0  # returned arrays are copies, not views of the parameters
    assert stage.state_dict()[name].any()
    with pytest.raises(BackendError, match="shape"):
        stage.apply_delta({name: delta.T})
    with pytest.raises(BackendError, match="unknown parameter"):
        stage.set_weights({"model.layers.0.mlp.up_proj.weight": weights[name]})


def test_bad_inputs_and_weights_raise_backend_errors():
    model, config = _hf_model("llama", layers=2)
    first_spec, last_spec = _specs(2, 2)
    weights = _weights(model)
    stage = registry.create("mlx", device="cpu")
    with pytest.raises(BackendError, match="load"):
        stage.forward(_tokens(1, 2))
    missing = _slice(weights, first_spec)
    missing.pop("model.layers.0.self_attn.k_proj.weight")
    with pytest.raises(BackendError, match="missing"):
        stage.load(first_spec, missing, config)
    wrong = _slice(weights, first_spec)
    wrong["model.embed_tokens.weight"] = wrong["model.embed_tokens.weight"][:-1]
    with pytest.raises(BackendError, match="shape"):
        stage.load(first_spec, wrong, config)
    stage.load(first_spec, _slice(weights, first_spec), config)
    with pytest.raises(BackendError, match="token ids"):
        stage.forward(np.array([[0, VOCAB]]))
    with pytest.raises(BackendError, match="token ids"):
        stage.forward(np.zeros((2, 3, 4), np.float32))
    with pytest.raises(BackendError, match="not both"):
        stage.forward(_tokens(1, 2), cache_id="c", key="k")
    with pytest.raises(BackendError, match="last stage"):
        stage.token_logprobs(_tokens(1, 2), _tokens(1, 2))
    stage.forward(_tokens(1, 2), key="k")
    with pytest.raises(BackendError, match="in flight"):
        stage.forward(_tokens(1, 2), key="k")
    with pytest.raises(BackendError, match="shape"):
        stage.backward("k", np.zeros((1, 3, config.hidden_size), np.float32))
    stage.release("k")
    with pytest.raises(BackendError, match="unknown training key"):
        stage.backward("k", np.zeros((1, 2, config.hidden_size), np.float32))

    last = registry.create("mlx", device="cpu")
    last.load(last_spec, _slice(weights, last_spec), config)
    with pytest.raises(BackendError, match="hidden states"):
        last.forward(np.zeros((1, 2, config.hidden_size + 1), np.float32))
    with pytest.raises(BackendError, match="temperature"):
        last.token_logprobs(np.zeros((1, 2, config.hidden_size), np.float32), _tokens(1, 2), temperature=0.0)
    with pytest.raises(BackendError, match="target ids"):
        last.token_logprobs(np.zeros((1, 2, config.hidden_size), np.float32), np.full((1, 2), VOCAB))

    errors = []
    worker = threading.Thread(target=lambda: errors.append(_capture(lambda: last.forward(
        np.zeros((1, 2, config.hidden_size), np.float32)))))
    worker.start()
    worker.join()
    assert errors and isinstance(errors[0], BackendError) and "thread" in str(errors[0])
    last.close()
    with pytest.raises(BackendError, match="closed"):
        last.state_dict()


def _capture(fn):
    try:
        fn()
    except Exception as exc:  # noqa: BLE001 - the test inspects it
        return exc
    return None


def test_stage_created_on_a_worker_thread_runs_there():
    model, config = _hf_model("llama", layers=2)
    weights = _weights(model)
    tokens = _tokens(2, 5)
    result = {}

    def work():
        stage = registry.create("mlx", device="cpu")
        stage.load(StageSpec(0, 1, 0, 2), weights, config)
        result["logits"] = stage.forward(tokens)
        stage.close()

    worker = threading.Thread(target=work, name="compute")
    worker.start()
    worker.join()
    with torch.no_grad():
        expected = model(torch.from_numpy(tokens)).logits.numpy()
    np.testing.assert_allclose(result["logits"], expected, atol=1e-5, rtol=0)
