"""Write a randomly initialised HF-layout checkpoint (for tests, benches and the demo fallback).

Produces ``config.json``, one or several ``.safetensors`` shards (with
``model.safetensors.index.json`` when there are several) and, given an alphabet,
the character tokenizer — the same layout ``transformers``' ``save_pretrained``
writes, so ``AutoModelForCausalLM.from_pretrained(dir)`` loads it. Tensors are
generated one at a time with numpy (weights ~ N(0, init_std^2); norm weights and
biases perturbed so that a wrong norm or bias cannot go unnoticed) and written
with the ``safetensors`` library; peak memory is about one shard. Nothing here
trains anything, and no torch is needed.
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
from safetensors.numpy import save_file

from backends.base import StageSpec
from engine.model.checkpoint import CONFIG_FILE, INDEX_FILE, SINGLE_FILE
from engine.model.config import ModelConfig
from engine.model.tensor_names import stage_tensor_shapes
from engine.model.tokenizer import CharTokenizer

#: characters of the default tokenizer: digits, lower-case letters and a little punctuation
DEFAULT_ALPHABET = "0123456789abcdefghijklmnopqrstuvwxyz +-*=:,.?!()\n"


def small_config(vocab_size: int, *, model_type: str = "llama", hidden_size: int = 64, num_layers: int = 4,
                 num_heads: int = 4, num_kv_heads: int = 2, intermediate_size: int | None = None,
                 tie_word_embeddings: bool = False, rope_theta: float = 10000.0,
                 max_position_embeddings: int = 512) -> ModelConfig:
    """A small ModelConfig with sensible defaults (GQA, SwiGLU width ~ 8/3 hidden)."""
    return ModelConfig(
        model_type=model_type, vocab_size=vocab_size, hidden_size=hidden_size,
        intermediate_size=intermediate_size or max(16, (8 * hidden_size // 3 + 15) // 16 * 16),
        num_hidden_layers=num_layers, num_attention_heads=num_heads, num_key_value_heads=num_kv_heads,
        head_dim=hidden_size // num_heads, rms_norm_eps=1e-6, rope_theta=rope_theta,
        attention_bias=model_type == "qwen2", tie_word_embeddings=tie_word_embeddings,
        max_position_embeddings=max_position_embeddings, bos_token_id=1, eos_token_id=2, pad_token_id=0)


def write_random_checkpoint(directory: str | Path, config: ModelConfig, *, seed: int = 0, init_std: float = 0.02,
                            max_shard_bytes: int | None = None, tokenizer: CharTokenizer | None = None) -> Path:
    """Write a random checkpoint for ``config`` into ``directory``; returns the directory.

    ``max_shard_bytes`` splits the tensors over several files (each tensor whole);
    ``tokenizer`` (whose vocabulary must equal ``config.vocab_size``) is saved too.
    """
    directory = Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    if tokenizer is not None and tokenizer.vocab_size != config.vocab_size:
        raise ValueError(f"tokenizer has {tokenizer.vocab_size} tokens but config.vocab_size is {config.vocab_size}")
    rng = np.random.default_rng(seed)
    whole = StageSpec(0, 1, 0, config.num_hidden_layers)
    shards: list[list[tuple[str, tuple[int, ...]]]] = [[]]
    size = 0
    for name, shape in stage_tensor_shapes(config, whole).items():
        nbytes = 4 * int(np.prod(shape))
        if max_shard_bytes is not None and shards[-1] and size + nbytes > max_shard_bytes:
            shards.append([])
            size = 0
        shards[-1].append((name, shape))
        size += nbytes
    files = [SINGLE_FILE] if len(shards) == 1 else [
        f"model-{i + 1:05d}-of-{len(shards):05d}.safetensors" for i in range(len(shards))]
    weight_map, total = {}, 0
    for file_name, shard in zip(files, shards):
        tensors = {name: _random_tensor(rng, name, shape, init_std) for name, shape in shard}
        save_file(tensors, str(directory / file_name), metadata={"format": "pt"})
        total += sum(t.nbytes for t in tensors.values())
        weight_map.update({name: file_name for name in tensors})
        del tensors
    if len(files) > 1:
        index = {"metadata": {"total_size": total}, "weight_map": weight_map}
        (directory / INDEX_FILE).write_text(json.dumps(index, indent=2) + "\n", encoding="utf-8")
    (directory / CONFIG_FILE).write_text(json.dumps(config.to_hf_dict(), indent=2) + "\n", encoding="utf-8")
    if tokenizer is not None:
        tokenizer.save(directory, model_max_length=config.max_position_embeddings)
    return directory


def _random_tensor(rng: np.random.Generator, name: str, shape: tuple[int, ...], std: float) -> np.ndarray:
    if name.endswith("norm.weight"):
        return (1.0 + 0.1 * rng.standard_normal(shape, dtype=np.float32)).astype(np.float32)
    if name.endswith(".bias"):
        return (0.1 * rng.standard_normal(shape, dtype=np.float32)).astype(np.float32)
    return (std * rng.standard_normal(shape, dtype=np.float32)).astype(np.float32)
