"""ModelConfig from HF config.json: llama and qwen2, 4.x and 5.x layouts, clear refusals."""

from __future__ import annotations

import json

import pytest

from engine.model.config import ModelConfig
from engine.model.errors import CheckpointError

transformers = pytest.importorskip("transformers")


def _hf_dict(arch: str, **overrides) -> dict:
    common = dict(vocab_size=40, hidden_size=64, intermediate_size=96, num_hidden_layers=3,
                  num_attention_heads=8, num_key_value_heads=2, rope_theta=5000.0, **overrides)
    cls = transformers.LlamaConfig if arch == "llama" else transformers.Qwen2Config
    return json.loads(cls(**common).to_json_string())


@pytest.mark.parametrize("arch", ["llama", "qwen2"])
def test_transformers_configs_parse_with_their_architecture(arch):
    config = ModelConfig.from_dict(_hf_dict(arch, tie_word_embeddings=arch == "qwen2"))
    assert (config.model_type, config.hidden_size, config.num_hidden_layers) == (arch, 64, 3)
    assert (config.num_attention_heads, config.num_key_value_heads, config.head_dim) == (8, 2, 8)
    assert config.rope_theta == 5000.0
    assert config.attention_bias == (arch == "qwen2")
    assert config.tie_word_embeddings == (arch == "qwen2")


@pytest.mark.parametrize("arch, tied", [("llama", False), ("qwen2", True)])
def test_parameter_count_matches_transformers(arch, tied):
    torch = pytest.importorskip("torch")
    hf = _hf_dict(arch, tie_word_embeddings=tied)
    model_cls = transformers.LlamaForCausalLM if arch == "llama" else transformers.Qwen2ForCausalLM
    with torch.device("meta"):
        model = model_cls(transformers.AutoConfig.for_model(**hf))
    assert ModelConfig.from_dict(hf).num_parameters == sum(p.numel() for p in model.parameters())


def test_transformers_4_layout_with_top_level_rope_theta_parses():
    old = {"model_type": "llama", "vocab_size": 32, "hidden_size": 32, "intermediate_size": 64,
           "num_hidden_layers": 2, "num_attention_heads": 4, "rope_theta": 250000.0, "rope_scaling": None,
           "eos_token_id": [2, 3]}
    config = ModelConfig.from_dict(old)
    assert config.rope_theta == 250000.0 and config.num_key_value_heads == 4 and config.eos_token_id == 2


def test_to_hf_dict_round_trips_and_transformers_reads_it():
    config = ModelConfig.from_dict(_hf_dict("qwen2"))
    assert ModelConfig.from_dict(config.to_hf_dict()) == config
    hf = transformers.AutoConfig.for_model(**config.to_hf_dict())
    assert hf.num_key_value_heads == 2 and hf.rope_parameters["rope_theta"] == 5000.0


@pytest.mark.parametrize("change, match", [
    ({"rope_parameters": {"rope_type": "llama3", "rope_theta": 1e4, "factor": 8.0}}, "rope_type 'llama3'"),
    ({"rope_scaling": {"type": "linear", "factor": 2.0}}, "rope_type 'linear'"),
    ({"model_type": "gpt2"}, "model_type 'gpt2'"),
    ({"hidden_act": "gelu"}, "hidden_act"),
    ({"attention_bias": True}, "o_proj bias"),
    ({"mlp_bias": True}, "mlp_bias"),
    ({"num_key_value_heads": 3}, "multiple of num_key_value_heads"),
    ({"vocab_size": 0}, "vocab_size must be a positive integer"),
    ({"eos_token_id": 99}, "outside the vocabulary"),
])
def test_configs_we_cannot_reproduce_exactly_are_refused(change, match):
    data = {**_hf_dict("llama"), **change}
    with pytest.raises(CheckpointError, match=match):
        ModelConfig.from_dict(data, source="/ckpt/config.json")


def test_missing_field_and_sliding_window_name_the_file(tmp_path):
    data = _hf_dict("qwen2")
    del data["intermediate_size"]
    path = tmp_path / "config.json"
    path.write_text(json.dumps(data))
    with pytest.raises(CheckpointError, match=r"config\.json: missing required field 'intermediate_size'"):
        ModelConfig.from_file(path)
    path.write_text(json.dumps({**_hf_dict("qwen2"), "use_sliding_window": True}))
    with pytest.raises(CheckpointError, match="sliding-window"):
        ModelConfig.from_file(path)
    path.write_text("[1, 2]")
    with pytest.raises(CheckpointError, match="not a JSON object"):
        ModelConfig.from_file(path)
