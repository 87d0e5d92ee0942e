"""An exported HF checkpoint as one GGUF file (Llama architecture, f32 or f16) for llama.cpp / Ollama users.

Written with the ``gguf`` package (the one ``transformers`` reads GGUF with):

* the architecture keys of ``llama`` from ``config.json`` (context, width, layers, heads,
  KV heads, RoPE base and dimension, RMSNorm epsilon, vocabulary size);
* every tensor under its GGUF name (``gguf.get_tensor_name_map``: ``token_embd``,
  ``blk.N.attn_q``, ...), ``attn_q`` / ``attn_k`` rows permuted the way llama.cpp's own
  converter does (its RoPE pairs adjacent rows; ``transformers`` undoes it on load); a tied
  model has no ``output.weight`` (the runtime reuses ``token_embd``); 1-D norms stay f32;
* the tokenizer in GGUF metadata: a byte-level BPE ``tokenizer.json`` as ``gpt2`` (tokens in
  id order, token types with the special tokens as control, merges), BOS / EOS / PAD ids,
  and the chat template.

Only Llama-architecture models with a byte-level BPE tokenizer are written; others (the
character-level shipped base, Qwen2 biases) are refused with a message.

What it does not know: runs, stages, model cards.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import numpy as np

from engine.extras import require
from engine.model.checkpoint import CONFIG_FILE, Checkpoint
from engine.model.errors import CheckpointError
from engine.model.importers.output import TOKENIZER_CONFIG_FILE, TOKENIZER_FILE, read_json

GGUF_DTYPES = ("f32", "f16")
#: token types of GGUF's tokenizer metadata
_NORMAL, _CONTROL = 1, 3


def _permute(weights: np.ndarray, n_head: int, n_head_kv: int | None = None) -> np.ndarray:
    """llama.cpp's q/k row order (convert_hf_to_gguf.py ``LlamaModel.permute``)."""
    if n_head_kv is not None and n_head != n_head_kv:
        n_head = n_head_kv
    return (weights.reshape(n_head, 2, weights.shape[0] // n_head // 2, *weights.shape[1:])
            .swapaxes(1, 2).reshape(weights.shape))


def _tokenizer_metadata(directory: Path) -> dict[str, Any]:
    data = json.loads((directory / TOKENIZER_FILE).read_text(encoding="utf-8"))
    model = data.get("model") or {}
    if model.get("type") != "BPE" or (data.get("pre_tokenizer") or {}).get("type") not in ("ByteLevel", "Sequence"):
        raise CheckpointError(directory / TOKENIZER_FILE, "only byte-level BPE tokenizers are written to GGUF "
                                                          "(the character-level shipped base has no GGUF form)")
    vocab = dict(model["vocab"])
    special = set()
    for added in data.get("added_tokens") or []:
        vocab[added["content"]] = int(added["id"])
        if added.get("special"):
            special.add(int(added["id"]))
    size = max(vocab.values()) + 1
    tokens = [f"[PAD{i}]" for i in range(size)]
    for token, i in vocab.items():
        tokens[i] = token
    types = [_CONTROL if i in special else _NORMAL for i in range(size)]
    merges = [m if isinstance(m, str) else " ".join(m) for m in model.get("merges") or []]
    return {"tokens": tokens, "types": types, "merges": merges}


def write_gguf(checkpoint_dir: str | Path, out_path: str | Path, dtype: str = "f32") -> Path:
    """Write ``checkpoint_dir`` (an HF Llama directory) as GGUF ``out_path`` with ``dtype`` matrices."""
    require("writing a GGUF file", ("gguf",))
    import gguf

    if dtype not in GGUF_DTYPES:
        raise ValueError(f"GGUF dtype must be one of {GGUF_DTYPES}, got {dtype!r}")
    checkpoint_dir, out_path = Path(checkpoint_dir), Path(out_path)
    checkpoint = Checkpoint(checkpoint_dir)
    config = checkpoint.config
    raw = read_json(checkpoint_dir / CONFIG_FILE)
    if raw.get("model_type") != "llama" or config.attention_bias:
        raise CheckpointError(checkpoint_dir / CONFIG_FILE, "only Llama-architecture models are written to GGUF")
    tok = _tokenizer_metadata(checkpoint_dir)
    tok_config_path = checkpoint_dir / TOKENIZER_CONFIG_FILE
    tok_config = read_json(tok_config_path) if tok_config_path.exists() else {}
    writer = gguf.GGUFWriter(str(out_path), "llama")
    writer.add_name(checkpoint_dir.name)
    writer.add_context_length(int(raw.get("max_position_embeddings", 2048)))
    writer.add_embedding_length(config.hidden_size)
    writer.add_block_count(config.num_hidden_layers)
    writer.add_feed_forward_length(config.intermediate_size)
    writer.add_head_count(config.num_attention_heads)
    writer.add_head_count_kv(config.num_key_value_heads)
    writer.add_rope_dimension_count(config.head_dim)
    writer.add_key_length(config.head_dim)
    writer.add_value_length(config.head_dim)
    writer.add_rope_freq_base(float(config.rope_theta))
    writer.add_layer_norm_rms_eps(float(config.rms_norm_eps))
    writer.add_vocab_size(config.vocab_size)
    writer.add_file_type(gguf.LlamaFileType.ALL_F32 if dtype == "f32" else gguf.LlamaFileType.MOSTLY_F16)
    writer.add_tokenizer_model("gpt2")
    writer.add_tokenizer_pre("default")
    writer.add_token_list(tok["tokens"])
    writer.add_token_types(tok["types"])
    writer.add_token_merges(tok["merges"])
    for key, add in (("bos_token_id", writer.add_bos_token_id), ("eos_token_id", writer.add_eos_token_id),
                     ("pad_token_id", writer.add_pad_token_id)):
        value = raw.get(key)
        value = value[0] if isinstance(value, list) and value else value
        if isinstance(value, int):
            add(value)
    if isinstance(tok_config.get("chat_template"), str):
        writer.add_chat_template(tok_config["chat_template"])
    names = gguf.get_tensor_name_map(gguf.MODEL_ARCH.LLAMA, config.num_hidden_layers)
    for name in checkpoint.tensor_names:
        if config.tie_word_embeddings and name == "lm_head.weight":
            continue
        gguf_name = names.get_name(name, try_suffixes=(".weight", ".bias"))
        if gguf_name is None:
            raise CheckpointError(checkpoint.file_of(name), f"tensor {name} has no GGUF name for Llama")
        array = checkpoint.read([name])[name]
        if name.endswith("self_attn.q_proj.weight"):
            array = _permute(array, config.num_attention_heads, config.num_attention_heads)
        elif name.endswith("self_attn.k_proj.weight"):
            array = _permute(array, config.num_attention_heads, config.num_key_value_heads)
        if dtype == "f16" and array.ndim > 1:
            array = array.astype(np.float16)
        writer.add_tensor(gguf_name, np.ascontiguousarray(array))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return out_path
