"""A tiny random Llama with tied embeddings and a small byte-level BPE tokenizer, in HF layout.

Shaped like SmolLM2-135M-Instruct in miniature: ``tie_word_embeddings`` true, no
``lm_head.weight`` in the safetensors, a byte-level BPE tokenizer trained here with
``tokenizers`` on a small built-in corpus, the special tokens SmolLM2 uses at the
same ids (``<|endoftext|>`` 0, ``<|im_start|>`` 1, ``<|im_end|>`` 2), a ChatML chat
template in ``tokenizer_config.json`` and a ``generation_config.json`` whose
``eos_token_id`` names the end-of-turn token. ``transformers``'
``AutoModelForCausalLM`` / ``AutoTokenizer`` load the directory as they load the
real model, and so do Polis's checkpoint reader and codec.

Test-only: the weights are random (no training), the tokenizer is trained on a
few sentences. Building takes well under a second; nothing is downloaded.
"""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers

from engine.model.config import ModelConfig
from engine.model.random_checkpoint import small_config, write_random_checkpoint

ENDOFTEXT, IM_START, IM_END = "<|endoftext|>", "<|im_start|>", "<|im_end|>"
SPECIAL_TOKENS = (ENDOFTEXT, IM_START, IM_END)

#: ChatML, as SmolLM2-Instruct's template but without its default system line
CHAT_TEMPLATE = (
    "{% for message in messages %}"
    "{{ '<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>' + '\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)

_CORPUS = [
    "You are a helpful assistant. Answer inside <answer></answer> tags.",
    "What is 3 + 4? Think step by step. 3 + 4 = 7. <answer>7</answer>",
    "What is 12 - 9? 12 - 9 = 3. <answer>3</answer>",
    "How many letters r are in the word strawberry? There are 3. <answer>3</answer>",
    "system user assistant: the quick brown fox jumps over the lazy dog 0123456789",
    "Reverse the digits 1234 to get 4321. Sort 3141 to get 1134.",
]


def build_bpe_tokenizer(vocab_size: int = 384) -> Tokenizer:
    """A byte-level BPE tokenizer (any text encodes) with SmolLM2's special tokens at ids 0, 1, 2."""
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    tok.post_processor = processors.ByteLevel(trim_offsets=False)
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=list(SPECIAL_TOKENS),
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False)
    tok.train_from_iterator(_CORPUS * 4, trainer=trainer)
    for i, token in enumerate(SPECIAL_TOKENS):
        assert tok.token_to_id(token) == i, (token, tok.token_to_id(token))
    return tok


def tiny_tied_config(vocab_size: int, *, num_layers: int = 4, hidden_size: int = 64, num_heads: int = 4,
                     num_kv_heads: int = 2) -> ModelConfig:
    """The tiny model's architecture: tied embeddings, GQA, SmolLM2's special ids (bos 1, eos 2, pad 2)."""
    config = small_config(vocab_size, hidden_size=hidden_size, num_layers=num_layers, num_heads=num_heads,
                          num_kv_heads=num_kv_heads, tie_word_embeddings=True)
    return dataclasses.replace(config, bos_token_id=1, eos_token_id=2, pad_token_id=2)


def write_tiny_tied_llama(directory: str | Path, *, seed: int = 0, num_layers: int = 4, hidden_size: int = 64,
                          num_heads: int = 4, num_kv_heads: int = 2, init_std: float = 0.05,
                          max_shard_bytes: int | None = None, vocab_size: int = 384) -> Path:
    """Write the tiny tied model (weights, tokenizer, chat template, generation config) into ``directory``."""
    directory = Path(directory)
    tok = build_bpe_tokenizer(vocab_size)
    config = tiny_tied_config(tok.get_vocab_size(), num_layers=num_layers, hidden_size=hidden_size,
                              num_heads=num_heads, num_kv_heads=num_kv_heads)
    write_random_checkpoint(directory, config, seed=seed, init_std=init_std, max_shard_bytes=max_shard_bytes)
    tok.save(str(directory / "tokenizer.json"))
    tokenizer_config = {
        "tokenizer_class": "PreTrainedTokenizerFast", "bos_token": IM_START, "eos_token": IM_END,
        "pad_token": IM_END, "unk_token": ENDOFTEXT, "model_max_length": config.max_position_embeddings,
        "clean_up_tokenization_spaces": False, "add_bos_token": False, "add_eos_token": False,
        "chat_template": CHAT_TEMPLATE,
        "added_tokens_decoder": {str(i): {"content": t, "special": True, "lstrip": False, "rstrip": False,
                                          "normalized": False, "single_word": False}
                                 for i, t in enumerate(SPECIAL_TOKENS)},
    }
    _write_json(directory / "tokenizer_config.json", tokenizer_config)
    _write_json(directory / "special_tokens_map.json",
                {"bos_token": IM_START, "eos_token": IM_END, "pad_token": IM_END, "unk_token": ENDOFTEXT})
    _write_json(directory / "generation_config.json",
                {"bos_token_id": 1, "eos_token_id": [2, 0], "pad_token_id": 2})
    return directory


def _write_json(path: Path, data: dict) -> None:
    path.write_text(json.dumps(data, indent=2) + "\n", encoding="utf-8")
