"""The StageBackend contract, proved for every backend against the unsplit transformers model.

Each test runs once per backend variant: torch on CPU, torch on CUDA / MPS (skip
when absent) and MLX (marker ``mlx``; skips while ``backends/mlx_stage.py`` or mlx
is missing). Checkpoints are written by ``transformers.save_pretrained`` in
several safetensors shards and loaded through ``engine.model.load_stage``.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import numpy as np
import pytest

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

from backends.base import BackendError, OptimizerConfig, StageBackend  # noqa: E402
from backends.stage_layout import EMBED  # noqa: E402
from engine.model.checkpoint import Checkpoint  # noqa: E402
from engine.model.sharded_decode import pipeline_forward  # noqa: E402
from engine.rl.pipeline import LocalPipeline  # noqa: E402
from tests.support.stage_variants import BACKENDS, assert_grads_close, load_pipeline, skip_reason, summed_grads  # noqa: E402
from tests.support.tiny_tied_llama import write_tiny_tied_llama  # noqa: E402

LOGITS_ATOL = 1e-5
INIT_STD = 0.05  #: weights std; norms ~ 1 + noise and biases ~ noise so that every term matters


@pytest.fixture(params=BACKENDS)
def variant(request) -> str:
    reason = skip_reason(request.param)
    if reason:
        pytest.skip(reason)
    return request.param


@dataclass
class Model:
    path: Path
    hf: object  #: the unsplit transformers model
    num_layers: int
    vocab: int
    tied: bool


def _write_model(root: Path, arch: str, tied: bool, seed: int) -> Model:
    common = dict(vocab_size=37, hidden_size=48, intermediate_size=80, num_hidden_layers=4, num_attention_heads=4,
                  num_key_value_heads=2, rms_norm_eps=1e-5, max_position_embeddings=64, tie_word_embeddings=tied)
    if arch == "llama":
        config, cls = transformers.LlamaConfig(rope_theta=500.0, **common), transformers.LlamaForCausalLM
    else:
        config, cls = transformers.Qwen2Config(rope_theta=10000.0, **common), transformers.Qwen2ForCausalLM
    torch.manual_seed(seed)
    model = cls(config).float().eval()
    with torch.no_grad():
        for name, p in model.named_parameters():
            centre = 1.0 if "norm" in name else 0.0
            p.copy_(centre + torch.randn_like(p) * (0.1 if centre or name.endswith("bias") else INIT_STD))
    path = root / arch
    model.save_pretrained(path, max_shard_size="40KB")
    return Model(path, model, config.num_hidden_layers, config.vocab_size, tied)


@pytest.fixture(scope="session")
def models(tmp_path_factory) -> dict[str, Model]:
    root = tmp_path_factory.mktemp("contract-checkpoints")
    return {"llama": _write_model(root, "llama", tied=False, seed=1),
            "qwen2": _write_model(root, "qwen2", tied=True, seed=2)}


@pytest.fixture(params=["llama", "qwen2"])
def model(request, models) -> Model:
    return models[request.param]


def _pipeline(model: Model, backends: list[str] | str, num_stages: int,
              optimizer: OptimizerConfig | None = None) -> list[StageBackend]:
    return load_pipeline(model.path, backends, num_stages, optimizer)


def _tokens(model: Model, shape: tuple[int, int], seed: int = 0) -> np.ndarray:
    return np.random.default_rng(seed).integers(0, model.vocab, shape).astype(np.int64)


def _hf_logits(model: Model, tokens: np.ndarray) -> np.ndarray:
    with torch.no_grad():
        return model.hf(torch.from_numpy(tokens)).logits.numpy()


def _hf_grads(model: Model) -> dict[str, np.ndarray]:
    return {n: p.grad.numpy().copy() for n, p in model.hf.named_parameters()}


_pipeline_grads = summed_grads  # a tied embedding's gradient is split between stage 0 and the last stage
_assert_grads_close = assert_grads_close


def _train_forward(stages: list[StageBackend], tokens: np.ndarray, key: str) -> np.ndarray:
    x = tokens
    for stage in stages:
        x = stage.forward(x, key=key)
    return x


def _train_backward(stages: list[StageBackend], key: str, grad: np.ndarray) -> None:
    for stage in reversed(stages):
        grad = stage.backward(key, grad)
    assert grad is None  # the first stage takes token ids: nothing to return


@pytest.mark.parametrize("num_stages", [1, 2, 4])
def test_pipeline_logits_equal_unsplit_transformers_logits(variant, model, num_stages):
    tokens = _tokens(model, (3, 11))
    stages = _pipeline(model, variant, num_stages)
    logits = pipeline_forward(stages, tokens)
    assert logits.dtype == np.float32 and logits.shape == (3, 11, model.vocab)
    np.testing.assert_allclose(logits, _hf_logits(model, tokens), rtol=0, atol=LOGITS_ATOL)


@pytest.mark.parametrize("num_stages", [1, 3])
def test_pipeline_backward_equals_full_model_parameter_gradients(variant, model, num_stages):
    tokens = _tokens(model, (2, 9), seed=1)
    dloss_dlogits = np.random.default_rng(2).standard_normal((2, 9, model.vocab)).astype(np.float32)
    model.hf.zero_grad(set_to_none=True)
    model.hf(torch.from_numpy(tokens)).logits.backward(torch.from_numpy(dloss_dlogits))
    stages = _pipeline(model, variant, num_stages)
    _train_forward(stages, tokens, "mb0")
    _train_backward(stages, "mb0", dloss_dlogits)
    _assert_grads_close(_pipeline_grads(stages), _hf_grads(model))


def test_token_logprobs_and_backward_equal_autograd_on_transformers(variant, model):
    tokens, targets = _tokens(model, (3, 8), seed=3), _tokens(model, (3, 8), seed=4)
    weights = np.random.default_rng(5).standard_normal((3, 8)).astype(np.float32)
    temperature = 0.7
    model.hf.zero_grad(set_to_none=True)
    logits = model.hf(torch.from_numpy(tokens)).logits / temperature
    want = torch.log_softmax(logits, -1).gather(-1, torch.from_numpy(targets)[..., None])[..., 0]
    (want * torch.from_numpy(weights)).sum().backward()

    stages = _pipeline(model, variant, 2)
    hidden = stages[0].forward(tokens, key="k")
    logp = stages[1].token_logprobs(hidden, targets, key="k", temperature=temperature)
    np.testing.assert_allclose(logp, want.detach().numpy(), rtol=0, atol=1e-5)
    _train_backward(stages[:1], "k", stages[1].backward("k", weights))
    _assert_grads_close(_pipeline_grads(stages), _hf_grads(model))
    no_key = stages[1].token_logprobs(stages[0].forward(tokens), targets, temperature=temperature)
    np.testing.assert_allclose(no_key, logp, rtol=0, atol=1e-6)


def test_kv_cached_decoding_equals_full_recomputation(variant, models):
    model = models["qwen2"]
    stages = _pipeline(model, variant, 2)
    seq = _tokens(model, (3, 12), seed=6)
    other = _tokens(model, (2, 12), seed=7)
    chunks = [(0, 5), (5, 7), (7, 8), (8, 9), (9, 12)]  # prompt, a 2-token chunk, single steps, a 3-token chunk
    for start, end in chunks:
        got = pipeline_forward(stages, seq[:, start:end], cache_id="a")
        pipeline_forward(stages, other[:, start:end], cache_id="b")  # an interleaved second cache
        want = pipeline_forward(stages, seq[:, :end])[:, start:end]
        np.testing.assert_allclose(got, want, rtol=0, atol=1e-5)
    final_b = pipeline_forward(stages, other[:, 12 - 1:], cache_id="b")
    np.testing.assert_allclose(final_b[:, -1], pipeline_forward(stages, np.concatenate(
        [other, other[:, -1:]], axis=1))[:, -1], rtol=0, atol=1e-5)
    for stage in stages:
        stage.drop_cache("a")
        stage.drop_cache("never-existed")
    restarted = pipeline_forward(stages, seq[:, :4], cache_id="a")
    np.testing.assert_allclose(restarted, pipeline_forward(stages, seq[:, :4]), rtol=0, atol=1e-5)
    with pytest.raises(BackendError):
        stages[0].forward(seq[:2, 4:5], cache_id="a")  # a cache's rows are fixed


def test_a_prefill_of_distinct_rows_expanded_decodes_as_the_repeated_rows_do(variant, models):
    """``expand_cache`` after a prefill of each prompt once equals prefilling every sample's copy,
    and ``last_only`` logits are the last position of the full logits."""
    model = models["qwen2"]
    stages = _pipeline(model, variant, 2)
    prompts = _tokens(model, (2, 7), seed=8)
    expand = np.array([1, 0, 0, 1, 1], dtype=np.int64)  # five samples of two prompts, in any order
    steps = _tokens(model, (5, 3), seed=9)
    full = pipeline_forward(stages, prompts[expand], cache_id="rep")
    x = prompts
    for stage in stages:
        x = stage.forward(x, cache_id="once", last_only=True)
        stage.expand_cache("once", expand)
    assert x.shape == (2, 1, model.vocab)
    np.testing.assert_allclose(x[expand, -1], full[:, -1], rtol=0, atol=1e-5)
    for t in range(steps.shape[1]):
        want = pipeline_forward(stages, steps[:, t:t + 1], cache_id="rep")
        got = pipeline_forward(stages, steps[:, t:t + 1], cache_id="once", last_only=True)
        np.testing.assert_allclose(got, want, rtol=0, atol=1e-5)
    for bad in (np.array([5]), np.array([-1]), np.array([], dtype=np.int64), np.zeros((1, 1), np.int64)):
        with pytest.raises(BackendError):
            stages[0].expand_cache("once", bad)
    with pytest.raises(BackendError):
        stages[0].expand_cache("never-existed", expand)
    with pytest.raises(BackendError):
        stages[1].forward(np.zeros((1, 2, 48), np.float32), key="k", last_only=True)


def _packed_and_plain(model: Model) -> tuple[list[np.ndarray], np.ndarray, np.ndarray, list, np.ndarray]:
    """Three completions of one prompt as plain rows (prompt + completion, shifted), and the same
    packed in one row (the prompt once) beside a plain row of another prompt; returns (plain rows'
    inputs per completion, packed inputs, packed targets, segments, which packed targets count)."""
    prompt, others = _tokens(model, (1, 5), seed=20)[0], _tokens(model, (1, 6), seed=21)[0]
    completions = [_tokens(model, (1, n), seed=22 + n)[0] for n in (3, 1, 4)]
    plain = [np.concatenate([prompt, c]) for c in completions]
    packed = np.concatenate([prompt[:-1]] + [np.concatenate([prompt[-1:], c[:-1]]) for c in completions])
    targets = np.concatenate([prompt[1:]] + completions)
    width = len(packed)
    inputs = np.stack([packed, np.pad(others[:-1], (0, width - 5))])
    target_rows = np.stack([targets, np.pad(others[1:], (0, width - 5))])
    counts = np.zeros((2, width), dtype=bool)
    counts[0, 4:] = True
    counts[1, :5] = True
    return plain, inputs, target_rows, [(4, 3, 1, 4), None], counts


def test_packed_rows_give_the_log_probs_and_gradients_of_their_plain_rows(variant, models):
    """A prompt packed once with its completions (``segments``) scores each completion token and
    backpropagates exactly as the plain rows prompt + completion do, beside a plain row."""
    model = models["qwen2"]  # tied embeddings across the two stages
    plain, inputs, targets, segments, counts = _packed_and_plain(model)
    weights = np.random.default_rng(30).standard_normal(targets.shape).astype(np.float32) * counts
    stages = _pipeline(model, variant, 2)
    hidden = stages[0].forward(inputs, key="packed", segments=segments)
    logp = stages[1].token_logprobs(hidden, targets, key="packed", temperature=0.7, segments=segments)
    _train_backward(stages[:1], "packed", stages[1].backward("packed", weights))
    packed_grads = _pipeline_grads(stages)

    want_logp, start = [], 4
    reference = _pipeline(model, variant, 2)
    rows = [(seq[:-1], seq[1:], 4) for seq in plain]
    rows.append((inputs[1, :5], targets[1, :5], 0))
    for i, (row_in, row_tgt, first) in enumerate(rows):
        h = reference[0].forward(row_in[None], key=f"r{i}")
        lp = reference[1].token_logprobs(h, row_tgt[None], key=f"r{i}", temperature=0.7)[0]
        if i < len(plain):
            n = len(row_tgt) - first
            row_w = np.zeros_like(lp)
            row_w[first:] = weights[0, start:start + n]
            want_logp.append(lp[first:])
            start += n
        else:
            row_w = weights[1, :5]
            np.testing.assert_allclose(logp[1, :5], lp, rtol=0, atol=1e-5)
        _train_backward(reference[:1], f"r{i}", reference[1].backward(f"r{i}", row_w[None].astype(np.float32)))
    np.testing.assert_allclose(logp[0, 4:], np.concatenate(want_logp), rtol=0, atol=1e-5)
    _assert_grads_close(packed_grads, _pipeline_grads(reference))
    unkeyed = stages[1].token_logprobs(stages[0].forward(inputs, segments=segments), targets, temperature=0.7,
                                       segments=segments)
    np.testing.assert_allclose(unkeyed, logp, rtol=0, atol=1e-6)
    for bad in ([(4, 3, 1, 40), None], [(4, 0, 1), None], [(4,), None], [(4, 3, 1, 4)]):
        with pytest.raises(BackendError):
            stages[0].forward(inputs, segments=bad)


def test_training_keys_in_flight_accumulate_and_release_forgets(variant, models):
    model = models["llama"]
    tokens = [_tokens(model, (2, 6), seed=s) for s in (10, 11, 12)]
    grads = [np.random.default_rng(s).standard_normal((2, 6, model.vocab)).astype(np.float32) for s in (13, 14)]
    together = _pipeline(model, variant, 2)
    for i in range(3):
        _train_forward(together, tokens[i], f"mb{i}")
    together[1].release("mb2")
    together[0].release("mb2")
    _train_backward(together, "mb1", grads[1])  # out of order
    _train_backward(together, "mb0", grads[0])
    with pytest.raises(BackendError):
        together[1].backward("mb2", grads[0])  # released
    with pytest.raises(BackendError):
        together[1].backward("mb0", grads[0])  # consumed

    separate = []
    for i in range(2):
        stages = _pipeline(model, variant, 2)
        _train_forward(stages, tokens[i], "k")
        _train_backward(stages, "k", grads[i])
        separate.append(_pipeline_grads(stages))
    _assert_grads_close(_pipeline_grads(together), {n: separate[0][n] + separate[1][n] for n in separate[0]})
    for stage in together:
        stage.zero_grad()
    assert all(not g.any() for g in _pipeline_grads(together).values())


def _adamw_reference(p, grads, opt: OptimizerConfig, scale: float):
    m, v = np.zeros_like(p, dtype=np.float64), np.zeros_like(p, dtype=np.float64)
    p = p.astype(np.float64)
    for t, g in enumerate(grads, start=1):
        g = g.astype(np.float64) * scale
        p = p * (1 - opt.lr * opt.weight_decay)
        m = opt.beta1 * m + (1 - opt.beta1) * g
        v = opt.beta2 * v + (1 - opt.beta2) * g * g
        m_hat, v_hat = m / (1 - opt.beta1 ** t), v / (1 - opt.beta2 ** t)
        p = p - opt.lr * m_hat / (np.sqrt(v_hat) + opt.eps)
    return p


def test_step_is_adamw_with_grad_scale_and_zeroes_gradients(variant, models):
    opt = OptimizerConfig(lr=1e-2, beta1=0.8, beta2=0.95, eps=1e-6, weight_decay=0.1)
    stage = _pipeline(models["llama"], variant, 2, optimizer=opt)[1]
    before = stage.state_dict()
    rng = np.random.default_rng(8)
    history = {n: [rng.standard_normal(p.shape).astype(np.float32) for _ in range(2)] for n, p in before.items()}
    for i in range(2):
        stage.set_grads({n: h[i] for n, h in history.items()})
        stage.step(grad_scale=0.5)
        assert all(not g.any() for g in stage.grads().values())
    after = stage.state_dict()
    for name, p in before.items():
        np.testing.assert_allclose(after[name], _adamw_reference(p, history[name], opt, 0.5),
                                   rtol=0, atol=1e-6, err_msg=name)
    stage.step()  # no gradients at all: nothing changes
    assert all(np.array_equal(stage.state_dict()[n], after[n]) for n in after)


def test_state_dict_set_weights_and_apply_delta_round_trip(variant, models):
    model = models["llama"]
    first, last = _pipeline(model, variant, 2)
    state = last.state_dict()
    assert set(state) == set(Checkpoint(model.path).stage_tensor_names(last.spec))
    tokens = _tokens(model, (2, 5))
    hidden = first.forward(tokens)
    base = last.forward(hidden)
    delta = {"model.norm.weight": np.full_like(state["model.norm.weight"], 0.25)}
    last.apply_delta(delta)
    np.testing.assert_allclose(last.state_dict()["model.norm.weight"], state["model.norm.weight"] + 0.25, atol=1e-7)
    assert np.abs(last.forward(hidden) - base).max() > 1e-3
    last.set_weights({"model.norm.weight": state["model.norm.weight"]})
    np.testing.assert_allclose(last.forward(hidden), base, rtol=0, atol=1e-6)
    state["model.norm.weight"][:] = 7.0  # state_dict returns copies, not views of the parameters
    np.testing.assert_allclose(last.forward(hidden), base, rtol=0, atol=1e-6)


def test_bad_requests_raise_backend_error_and_leave_the_stage_usable(variant, models):
    model = models["llama"]
    first, last = _pipeline(model, variant, 2)
    tokens = _tokens(model, (2, 5))
    hidden = first.forward(tokens)
    bad_calls = [
        lambda: first.forward(np.full((2, 5), model.vocab)),  # id outside the vocabulary
        lambda: first.forward(np.zeros((2, 5), np.float32) + 0.5),  # floats where ids belong
        lambda: first.forward(np.zeros((5,), np.int64)),  # wrong rank
        lambda: last.forward(hidden[..., :-1]),  # wrong hidden size
        lambda: last.forward(hidden, cache_id="c", key="k"),
        lambda: first.token_logprobs(tokens, tokens),  # not the last stage
        lambda: last.token_logprobs(hidden, tokens[:, :3]),  # targets shape
        lambda: last.token_logprobs(hidden, tokens, temperature=0.0),
        lambda: last.backward("unknown", np.zeros((2, 5, model.vocab), np.float32)),
        lambda: last.apply_delta({"model.layers.0.mlp.up_proj.weight": np.zeros((80, 48), np.float32)}),
        lambda: last.set_weights({"model.norm.weight": np.zeros(3, np.float32)}),
        lambda: last.set_grads({"no.such.weight": np.zeros(3, np.float32)}),
    ]
    for call in bad_calls:
        with pytest.raises(BackendError):
            call()
    last.forward(hidden, key="k")
    with pytest.raises(BackendError):
        last.forward(hidden, key="k")  # key already in flight
    with pytest.raises(BackendError):
        last.backward("k", np.zeros((2, 5, 3), np.float32))  # wrong gradient shape
    np.testing.assert_allclose(pipeline_forward([first, last], tokens), _hf_logits(model, tokens),
                               rtol=0, atol=LOGITS_ATOL)


def test_closed_stage_refuses_work(variant, models):
    first, _ = _pipeline(models["llama"], variant, 2)
    first.close()
    with pytest.raises(BackendError):
        first.forward(_tokens(models["llama"], (1, 3)))


@pytest.mark.mlx
@pytest.mark.parametrize("chain", [["torch-cpu", "mlx", "torch-cpu"], ["torch-cpu", "mlx", "torch-cpu", "mlx"],
                                   ["mlx", "torch-cpu"]])
def test_mixed_torch_and_mlx_pipeline_gives_the_same_logits_and_gradients(model, chain):
    reason = skip_reason("mlx")
    if reason:
        pytest.skip(reason)
    tokens = _tokens(model, (2, 7), seed=9)
    stages = _pipeline(model, chain, len(chain))
    np.testing.assert_allclose(pipeline_forward(stages, tokens), _hf_logits(model, tokens), rtol=0, atol=LOGITS_ATOL)
    dloss = np.random.default_rng(10).standard_normal((2, 7, model.vocab)).astype(np.float32)
    model.hf.zero_grad(set_to_none=True)
    model.hf(torch.from_numpy(tokens)).logits.backward(torch.from_numpy(dloss))
    _train_forward(stages, tokens, "k")
    _train_backward(stages, "k", dloss)
    _assert_grads_close(_pipeline_grads(stages), _hf_grads(model))


# -- tied embeddings across stages ----------------------------------------------------------------

@pytest.fixture(scope="session")
def tiny_tied(tmp_path_factory) -> Model:
    """The test-support tiny tied Llama (no lm_head in its files), in several safetensors shards."""
    path = write_tiny_tied_llama(tmp_path_factory.mktemp("tiny-tied") / "m", init_std=0.05, max_shard_bytes=60_000)
    hf = transformers.AutoModelForCausalLM.from_pretrained(str(path), local_files_only=True, dtype=torch.float32)
    return Model(path, hf.eval(), hf.config.num_hidden_layers, hf.config.vocab_size, tied=True)


def _hf_logprob_grads(model: Model, tokens, targets, weights) -> tuple[np.ndarray, dict[str, np.ndarray]]:
    """log-probs at ``targets`` of the unsplit model and the gradients of ``sum(weights * logp)``."""
    model.hf.zero_grad(set_to_none=True)
    logits = model.hf(torch.from_numpy(tokens)).logits
    logp = torch.log_softmax(logits, -1).gather(-1, torch.from_numpy(targets)[..., None])[..., 0]
    (logp * torch.from_numpy(weights)).sum().backward()
    return logp.detach().numpy(), _hf_grads(model)  # named_parameters lists the tied matrix once


def _rl_batch(model: Model, seed: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    tokens, targets = _tokens(model, (3, 8), seed=seed), _tokens(model, (3, 8), seed=seed + 1)
    weights = np.random.default_rng(seed + 2).standard_normal((3, 8)).astype(np.float32)
    return tokens, targets, weights


def test_a_tied_embedding_is_shared_by_the_first_and_the_last_stage_only(variant, tiny_tied, models):
    assert [s.tied_names for s in _pipeline(tiny_tied, variant, 1)] == [()]  # one copy: autograd sums both uses
    assert [s.tied_names for s in _pipeline(tiny_tied, variant, 3)] == [(EMBED,), (), (EMBED,)]
    assert [s.tied_names for s in _pipeline(models["llama"], variant, 2)] == [(), ()]  # untied


@pytest.mark.parametrize("num_stages", [1, 2, 3])
def test_tied_pipeline_logits_and_gradients_equal_the_full_model_with_the_tied_gradient_summed(
        variant, tiny_tied, num_stages):
    tokens, targets, weights = _rl_batch(tiny_tied, seed=20)
    want_logp, want = _hf_logprob_grads(tiny_tied, tokens, targets, weights)
    pipe = LocalPipeline(_pipeline(tiny_tied, variant, num_stages))
    np.testing.assert_allclose(pipeline_forward(pipe.backends, tokens), _hf_logits(tiny_tied, tokens),
                               rtol=0, atol=LOGITS_ATOL)
    np.testing.assert_allclose(pipe.token_logprobs(tokens, targets, key="k"), want_logp, rtol=0, atol=1e-5)
    pipe.backward("k", weights)
    got = pipe.grads()
    for stage_grads in got:  # every copy of the tied matrix holds the full gradient (both uses summed)
        assert_grads_close(stage_grads, {n: want[n] for n in stage_grads})
    assert set().union(*got) == set(want)
    want_sq = sum(float(np.square(g, dtype=np.float64).sum()) for g in want.values())
    assert sum(pipe.grad_sq_norms()) == pytest.approx(want_sq, rel=1e-5)  # the tied matrix counted once
    if num_stages > 1:
        pipe.token_logprobs(tokens, targets, key="k2")
        with pytest.raises(ValueError):  # summed already: another backward would count stage 0's part twice
            pipe.backward("k2", weights)


TIED_CHAINS = [pytest.param(["torch-cpu", "torch-cpu"], id="torch"),
               pytest.param(["mlx", "mlx", "mlx"], id="mlx", marks=pytest.mark.mlx),
               pytest.param(["torch-cpu", "mlx"], id="torch-mlx", marks=pytest.mark.mlx),
               pytest.param(["mlx", "torch-cpu", "torch-cpu"], id="mlx-torch", marks=pytest.mark.mlx)]


@pytest.mark.parametrize("chain", TIED_CHAINS)
def test_tied_copies_stay_identical_through_adamw_steps_and_follow_the_whole_model(tiny_tied, chain):
    for v in chain:
        if skip_reason(v):
            pytest.skip(skip_reason(v))
    opt = OptimizerConfig(lr=1e-3, beta1=0.9, beta2=0.99, eps=1e-6, weight_decay=0.01)
    split = LocalPipeline(_pipeline(tiny_tied, chain, len(chain), optimizer=opt))
    whole = LocalPipeline(_pipeline(tiny_tied, chain[0], 1, optimizer=opt))  # one copy: tied by construction
    for step in range(3):
        tokens, targets, weights = _rl_batch(tiny_tied, seed=30 + 3 * step)
        norms = []
        for pipe in (split, whole):
            pipe.zero_grad()
            pipe.token_logprobs(tokens, targets, key="k")
            pipe.backward("k", weights)
            norms.append(float(np.sqrt(sum(pipe.grad_sq_norms()))))
        want = whole.grads()[0]
        for stage_grads in split.grads():  # both copies hold the whole model's tied gradient
            assert_grads_close(stage_grads, {n: want[n] for n in stage_grads})
        assert norms[0] == pytest.approx(norms[1], rel=1e-5)
        for pipe, norm in zip((split, whole), norms):
            pipe.step(grad_scale=min(1.0, 1.0 / norm))  # one scale for all: the whole model is one unit
    first, last = split.backends[0].state_dict()[EMBED], split.backends[-1].state_dict()[EMBED]
    if len(set(chain)) == 1:
        np.testing.assert_array_equal(first, last)  # same backend: bit-identical copies
    else:
        np.testing.assert_allclose(first, last, rtol=0, atol=1e-6)  # torch vs MLX AdamW: fp32 rounding
    want = whole.state_dicts()[0]
    got = {n: w for sd in split.state_dicts() for n, w in sd.items()}
    assert set(got) == set(want)
    for name in want:
        np.testing.assert_allclose(got[name], want[name], rtol=0, atol=2e-5, err_msg=name)
    assert np.abs(first - _pipeline(tiny_tied, "torch-cpu", 1)[0].state_dict()[EMBED]).max() > 1e-3  # it trained


def test_tied_first_and_last_stages_are_one_clipping_unit_and_refuse_unequal_scales(tiny_tied):
    split = LocalPipeline(_pipeline(tiny_tied, "torch-cpu", 3))
    assert split.clip_units() == [(0, 2), (1,)]
    tokens, targets, weights = _rl_batch(tiny_tied, seed=5)
    split.token_logprobs(tokens, targets, key="k")
    split.backward("k", weights)
    with pytest.raises(ValueError, match="tied"):
        split.step([0.5, 1.0, 1.0])  # the two copies of the embedding would drift apart
    split.step([0.5, 1.0, 0.5])
    np.testing.assert_array_equal(split.backends[0].state_dict()[EMBED], split.backends[-1].state_dict()[EMBED])
