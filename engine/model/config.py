"""``ModelConfig``: the architecture of a Llama/Qwen2 decoder, read from an HF ``config.json``.

Accepts what ``transformers`` writes for ``model_type`` ``"llama"`` and
``"qwen2"``, in both the 4.x layout (``rope_theta``/``rope_scaling`` at top level)
and the 5.x layout (``rope_parameters``). Everything a backend cannot reproduce
exactly is refused with a :class:`CheckpointError` naming ``config.json`` rather
than silently computing something else: rope scaling other than the default,
sliding-window attention, an activation other than SiLU, MLP biases, and Llama's
``attention_bias`` (which would add an ``o_proj`` bias as well).

The fields are those of ``backends.base.ModelConfigLike`` plus a few facts the
engine uses (token ids, maximum context). This module knows nothing about files
other than ``config.json`` itself.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any, Mapping

from engine.model.errors import CheckpointError
from engine.model.json_file import read_json_object

#: model types this module understands
SUPPORTED_MODEL_TYPES = ("llama", "qwen2")
#: largest config.json read (a real one is a few KB)
MAX_CONFIG_BYTES = 1024 * 1024


@dataclass(frozen=True)
class ModelConfig:
    """Architecture of a Llama/Qwen2-style decoder (validated on construction)."""

    model_type: str  #: ``"llama"`` or ``"qwen2"``
    vocab_size: int  #: rows of the embedding matrix and of the LM head
    hidden_size: int  #: width of the residual stream
    intermediate_size: int  #: width of the SwiGLU MLP
    num_hidden_layers: int  #: decoder layers
    num_attention_heads: int  #: query heads
    num_key_value_heads: int  #: key/value heads (grouped-query attention when fewer than query heads)
    head_dim: int  #: width of one attention head
    rms_norm_eps: float  #: epsilon inside every RMSNorm
    rope_theta: float  #: RoPE base (default rope, no scaling)
    attention_bias: bool  #: q/k/v projections carry biases (Qwen2); o_proj never does here
    tie_word_embeddings: bool  #: LM head reuses the embedding matrix
    max_position_embeddings: int = 2048  #: longest context (positions) the model was built for
    bos_token_id: int | None = None
    eos_token_id: int | None = None
    pad_token_id: int | None = None

    def __post_init__(self) -> None:
        for name in ("vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers",
                     "num_attention_heads", "num_key_value_heads", "head_dim", "max_position_embeddings"):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value <= 0:
                raise ValueError(f"{name} must be a positive integer, got {value!r}")
        if self.model_type not in SUPPORTED_MODEL_TYPES:
            raise ValueError(f"model_type {self.model_type!r} is not supported "
                             f"(supported: {', '.join(SUPPORTED_MODEL_TYPES)})")
        if self.num_attention_heads % self.num_key_value_heads:
            raise ValueError(f"num_attention_heads ({self.num_attention_heads}) must be a multiple of "
                             f"num_key_value_heads ({self.num_key_value_heads})")
        if self.head_dim % 2:
            raise ValueError(f"head_dim must be even for RoPE, got {self.head_dim}")
        if not self.rms_norm_eps > 0:
            raise ValueError(f"rms_norm_eps must be positive, got {self.rms_norm_eps!r}")
        if not self.rope_theta > 0:
            raise ValueError(f"rope_theta must be positive, got {self.rope_theta!r}")
        for name in ("bos_token_id", "eos_token_id", "pad_token_id"):
            value = getattr(self, name)
            if value is not None and not 0 <= value < self.vocab_size:
                raise ValueError(f"{name} {value} is outside the vocabulary [0, {self.vocab_size})")

    @property
    def num_parameters(self) -> int:
        """Parameters of the whole model (the tied head counted once)."""
        h, kv = self.hidden_size, self.num_key_value_heads * self.head_dim
        q = self.num_attention_heads * self.head_dim
        attn = h * q + 2 * h * kv + q * h + (q + 2 * kv if self.attention_bias else 0)
        layer = attn + 3 * h * self.intermediate_size + 2 * h
        head = 0 if self.tie_word_embeddings else self.vocab_size * h
        return self.vocab_size * h + self.num_hidden_layers * layer + h + head

    @classmethod
    def from_file(cls, path: str | Path) -> "ModelConfig":
        """Read and validate ``config.json``; any problem is a CheckpointError naming it."""
        path = Path(path)
        data = read_json_object(path, max_bytes=MAX_CONFIG_BYTES,
                                missing="file not found (a checkpoint needs config.json)")
        return cls.from_dict(data, source=path)

    @classmethod
    def from_dict(cls, data: Mapping[str, Any], source: str | Path = "config.json") -> "ModelConfig":
        """Build from the parsed JSON of an HF config; errors name ``source``."""
        if not isinstance(data, Mapping):
            raise CheckpointError(source, "config is not a JSON object")
        try:
            return cls(**_fields_from_hf(data, source))
        except (TypeError, ValueError) as exc:
            if isinstance(exc, CheckpointError):
                raise
            raise CheckpointError(source, f"invalid model config: {exc}") from None

    def to_hf_dict(self) -> dict[str, Any]:
        """A ``config.json`` body that ``transformers`` (4.x and 5.x) loads as this model."""
        arch = {"llama": "LlamaForCausalLM", "qwen2": "Qwen2ForCausalLM"}[self.model_type]
        out: dict[str, Any] = {
            "architectures": [arch], "model_type": self.model_type, "vocab_size": self.vocab_size,
            "hidden_size": self.hidden_size, "intermediate_size": self.intermediate_size,
            "num_hidden_layers": self.num_hidden_layers, "num_attention_heads": self.num_attention_heads,
            "num_key_value_heads": self.num_key_value_heads, "head_dim": self.head_dim,
            "hidden_act": "silu", "rms_norm_eps": self.rms_norm_eps, "rope_theta": self.rope_theta,
            "rope_parameters": {"rope_type": "default", "rope_theta": self.rope_theta},
            "max_position_embeddings": self.max_position_embeddings,
            "tie_word_embeddings": self.tie_word_embeddings, "torch_dtype": "float32",
            "bos_token_id": self.bos_token_id, "eos_token_id": self.eos_token_id,
            "pad_token_id": self.pad_token_id,
        }
        if self.model_type == "llama":
            out.update(attention_bias=False, mlp_bias=False)
        else:
            out.update(use_sliding_window=False, sliding_window=None)
        return out


def _fields_from_hf(data: Mapping[str, Any], source: str | Path) -> dict[str, Any]:
    def refuse(problem: str) -> CheckpointError:
        return CheckpointError(source, f"unsupported model: {problem}")

    def required(key: str) -> Any:
        if key not in data:
            raise CheckpointError(source, f"missing required field '{key}'")
        return data[key]

    model_type = required("model_type")
    if model_type not in SUPPORTED_MODEL_TYPES:
        raise refuse(f"model_type {model_type!r} (supported: {', '.join(SUPPORTED_MODEL_TYPES)})")
    act = data.get("hidden_act", "silu")
    if act != "silu":
        raise refuse(f"hidden_act {act!r} (only 'silu' is implemented)")
    if data.get("mlp_bias"):
        raise refuse("mlp_bias=true (MLP biases are not implemented)")
    if model_type == "llama" and data.get("attention_bias"):
        raise refuse("llama with attention_bias=true (o_proj bias is not implemented)")
    if model_type == "qwen2" and data.get("use_sliding_window"):
        raise refuse("use_sliding_window=true (sliding-window attention is not implemented)")
    rope_theta = _rope_theta(data, refuse)

    hidden, heads = required("hidden_size"), required("num_attention_heads")
    head_dim = data.get("head_dim")
    if head_dim is None:
        if not isinstance(hidden, int) or not isinstance(heads, int) or heads <= 0 or hidden % heads:
            raise CheckpointError(source, f"hidden_size {hidden!r} is not divisible by "
                                          f"num_attention_heads {heads!r} and no head_dim is given")
        head_dim = hidden // heads
    kv_heads = data.get("num_key_value_heads")
    eos = data.get("eos_token_id")
    if isinstance(eos, list):  # HF allows several; the first is the canonical one
        eos = eos[0] if eos else None
    return dict(
        model_type=model_type, vocab_size=required("vocab_size"), hidden_size=hidden,
        intermediate_size=required("intermediate_size"), num_hidden_layers=required("num_hidden_layers"),
        num_attention_heads=heads, num_key_value_heads=heads if kv_heads is None else kv_heads,
        head_dim=head_dim, rms_norm_eps=float(data.get("rms_norm_eps", 1e-6)), rope_theta=rope_theta,
        attention_bias=model_type == "qwen2", tie_word_embeddings=bool(data.get("tie_word_embeddings", False)),
        max_position_embeddings=data.get("max_position_embeddings", 2048),
        bos_token_id=data.get("bos_token_id"), eos_token_id=eos, pad_token_id=data.get("pad_token_id"),
    )


def _rope_theta(data: Mapping[str, Any], refuse) -> float:
    """The RoPE base, refusing any rope type other than the default."""
    params = data.get("rope_parameters")
    scaling = data.get("rope_scaling")
    for block in (params, scaling):
        if block is None:
            continue
        if not isinstance(block, Mapping):
            raise refuse(f"rope settings {block!r} are not an object")
        rope_type = block.get("rope_type", block.get("type", "default"))
        if rope_type != "default":
            raise refuse(f"rope_type {rope_type!r} (only the default rope is implemented)")
    theta = (params or {}).get("rope_theta", data.get("rope_theta", 10000.0))
    if isinstance(theta, bool) or not isinstance(theta, (int, float)):
        raise refuse(f"rope_theta {theta!r} is not a number")
    return float(theta)
