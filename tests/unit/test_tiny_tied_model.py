"""The test-support tiny tied Llama loads in transformers like a real tied chat model."""

import numpy as np
import pytest

from engine.model.checkpoint import Checkpoint
from tests.support.tiny_tied_llama import IM_END, write_tiny_tied_llama

transformers = pytest.importorskip("transformers")


def test_tiny_tied_llama_loads_tied_in_transformers_and_in_polis(tmp_path):
    directory = write_tiny_tied_llama(tmp_path / "tiny")
    checkpoint = Checkpoint(directory)
    assert checkpoint.config.tie_word_embeddings
    assert "lm_head.weight" not in checkpoint.tensor_names
    model = transformers.AutoModelForCausalLM.from_pretrained(str(directory), local_files_only=True)
    assert model.lm_head.weight.data_ptr() == model.model.embed_tokens.weight.data_ptr()
    embed = checkpoint.read(["model.embed_tokens.weight"])["model.embed_tokens.weight"]
    np.testing.assert_array_equal(model.lm_head.weight.detach().numpy(), embed)


def test_tiny_tied_llama_tokenizer_renders_its_chat_template_in_transformers(tmp_path):
    directory = write_tiny_tied_llama(tmp_path / "tiny")
    tok = transformers.AutoTokenizer.from_pretrained(str(directory), local_files_only=True)
    text = tok.apply_chat_template([{"role": "user", "content": "What is 3 + 4?"}], tokenize=False,
                                   add_generation_prompt=True)
    assert text == "<|im_start|>user\nWhat is 3 + 4?<|im_end|>\n<|im_start|>assistant\n"
    assert tok.eos_token == IM_END and tok.eos_token_id == 2
    ids = tok(text, add_special_tokens=False)["input_ids"]
    assert ids[0] == 1 and tok.decode(ids) == text
