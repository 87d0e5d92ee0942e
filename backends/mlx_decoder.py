"""The maths of one Llama/Qwen2 decoder stage in MLX, as pure functions of a parameter dict.

Parameters are a flat ``dict[str, mx.array]`` keyed by Hugging Face names, so
the same dict is what the optimiser updates, what gradients are keyed by and
what crosses the wire. Pure functions (no module state) make it simple to
differentiate a stage with ``mx.vjp`` at backward time against exactly the
parameter arrays that the forward pass used.

The stage computes, matching ``transformers``' Llama/Qwen2 in fp32:
token embedding (first stage) -> for each layer: RMSNorm, grouped-query attention
with rotary position embeddings (HF ``rotate_half`` convention,
``traditional=False``), optional q/k/v (and o) biases, residual; RMSNorm, SwiGLU
MLP, residual -> final RMSNorm and LM head (last stage). A linear weight with a LoRA
adapter in the dict (``<module>.lora_A.weight`` / ``.lora_B.weight``, see
``backends.lora``) computes ``W x + lora_scaling * B (A x)``, the order PEFT uses.

What it does not know: where parameters come from, KV-cache bookkeeping across
calls (it takes the past keys/values and returns the new ones), gradients
accumulation, optimisers, numpy, threads. Rope scaling variants (llama3, yarn)
and sliding-window attention are not implemented.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import NamedTuple

import mlx.core as mx
import numpy as np

from backends.base import ModelConfigLike
from backends.stage_layout import EMBED, FINAL_NORM, StageLayout, layer_prefix

#: per layer: (keys, values), each ``[B, kv_heads, T_total, head_dim]``
LayerKV = tuple[mx.array, mx.array]


@dataclass(frozen=True)
class StageDims:
    """Everything about a stage's architecture the maths needs (no tensors)."""

    hidden_size: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rms_norm_eps: float
    rope_theta: float
    layers: tuple[int, ...]  #: global indices of this stage's decoder layers
    is_first: bool
    is_last: bool
    qkv_bias: bool
    o_bias: bool
    mlp_bias: bool
    head_name: str | None  #: parameter used as the LM head on the last stage
    lora_scaling: float = 0.0  #: ``alpha / rank`` for the adapters in the parameter dict (unused without)

    @classmethod
    def from_layout(cls, layout: StageLayout, config: ModelConfigLike, lora_scaling: float = 0.0) -> "StageDims":
        spec = layout.spec
        return cls(hidden_size=config.hidden_size, num_heads=config.num_attention_heads,
                   num_kv_heads=config.num_key_value_heads, head_dim=config.head_dim,
                   rms_norm_eps=float(config.rms_norm_eps), rope_theta=float(config.rope_theta),
                   layers=tuple(range(spec.layer_start, spec.layer_end)),
                   is_first=spec.is_first, is_last=spec.is_last,
                   qkv_bias=layout.biases.qkv, o_bias=layout.biases.o, mlp_bias=layout.biases.mlp,
                   head_name=layout.head_name, lora_scaling=float(lora_scaling))


def _linear(x: mx.array, params: dict[str, mx.array], name: str, bias: bool, dims: StageDims) -> mx.array:
    weight = params[name + ".weight"]
    y = mx.addmm(params[name + ".bias"], x, weight.T) if bias else x @ weight.T
    lora_a = params.get(name + ".lora_A.weight")
    if lora_a is not None:
        y = y + ((x @ lora_a.T) @ params[name + ".lora_B.weight"].T) * dims.lora_scaling
    return y


def rope_periods(head_dim: int, theta: float) -> mx.array:
    """``1 / inv_freq`` per rotated pair, with ``inv_freq`` computed in fp32 exactly as transformers does.

    ``mx.fast.rope`` given ``base`` derives the frequencies its own way, which drifts
    from transformers by ~1e-5 at moderate positions; given these periods it matches
    to fp32 rounding.
    """
    exponents = np.arange(0, head_dim, 2, dtype=np.int64).astype(np.float32) / np.float32(head_dim)
    inv_freq = np.float32(1.0) / (np.float32(theta) ** exponents)
    return mx.array((np.float32(1.0) / inv_freq).astype(np.float32))


def _causal_mask(new_len: int) -> str | None:
    """Mask for ``new_len`` new queries over all keys so far.

    MLX's ``"causal"`` mask is aligned to the bottom right (query ``i`` of the new
    block sees keys ``0 .. offset + i``), which is exactly what a KV-cached chunk
    needs; a single query sees every key, so it needs none.
    """
    return None if new_len == 1 else "causal"


class PackedLayout(NamedTuple):
    """Packed rows (``backends.base.segment_layout``): per-row rotary tables and the attention mask."""

    cos: mx.array  #: ``[B, 1, T, head_dim / 2]``
    sin: mx.array
    mask: mx.array  #: bool ``[B, 1, T, T]``, True where a query may attend to a key

    @classmethod
    def build(cls, positions: np.ndarray, mask: np.ndarray, periods: mx.array) -> "PackedLayout":
        angles = mx.array(positions.astype(np.float32))[:, None, :, None] / periods
        return cls(mx.cos(angles), mx.sin(angles), mx.array(mask)[:, None])


def _rotate(x: mx.array, layout: PackedLayout) -> mx.array:
    """The non-traditional rotary embedding at each row's own positions (what ``mx.fast.rope`` does
    at one offset for all rows)."""
    half = x.shape[-1] // 2
    a, b = x[..., :half], x[..., half:]
    return mx.concatenate([a * layout.cos - b * layout.sin, b * layout.cos + a * layout.sin], axis=-1)


def _attention(params: dict[str, mx.array], prefix: str, x: mx.array, dims: StageDims,
               offset: int, past: LayerKV | None, periods: mx.array,
               layout: PackedLayout | None = None) -> tuple[mx.array, LayerKV]:
    batch, length, _ = x.shape
    p = prefix + "self_attn."
    q = _linear(x, params, p + "q_proj", dims.qkv_bias, dims)
    k = _linear(x, params, p + "k_proj", dims.qkv_bias, dims)
    v = _linear(x, params, p + "v_proj", dims.qkv_bias, dims)
    q = q.reshape(batch, length, dims.num_heads, dims.head_dim).transpose(0, 2, 1, 3)
    k = k.reshape(batch, length, dims.num_kv_heads, dims.head_dim).transpose(0, 2, 1, 3)
    v = v.reshape(batch, length, dims.num_kv_heads, dims.head_dim).transpose(0, 2, 1, 3)
    if layout is not None:
        q, k = _rotate(q, layout), _rotate(k, layout)
    else:
        q = mx.fast.rope(q, dims.head_dim, traditional=False, base=None, freqs=periods, scale=1.0, offset=offset)
        k = mx.fast.rope(k, dims.head_dim, traditional=False, base=None, freqs=periods, scale=1.0, offset=offset)
    if past is not None:
        k = mx.concatenate([past[0], k], axis=2)
        v = mx.concatenate([past[1], v], axis=2)
    out = mx.fast.scaled_dot_product_attention(q, k, v, scale=dims.head_dim ** -0.5,
                                               mask=_causal_mask(length) if layout is None else layout.mask)
    out = out.transpose(0, 2, 1, 3).reshape(batch, length, dims.num_heads * dims.head_dim)
    return _linear(out, params, p + "o_proj", dims.o_bias, dims), (k, v)


def _mlp(params: dict[str, mx.array], prefix: str, x: mx.array, dims: StageDims) -> mx.array:
    p = prefix + "mlp."
    gate = _linear(x, params, p + "gate_proj", dims.mlp_bias, dims)
    up = _linear(x, params, p + "up_proj", dims.mlp_bias, dims)
    return _linear(gate * mx.sigmoid(gate) * up, params, p + "down_proj", dims.mlp_bias, dims)


def stage_forward(params: dict[str, mx.array], inputs: mx.array, dims: StageDims, *,
                  offset: int = 0, past: list[LayerKV] | None = None, last_only: bool = False,
                  layout: PackedLayout | None = None) -> tuple[mx.array, list[LayerKV]]:
    """Run the stage on token ids ``[B, T]`` (first stage) or hidden ``[B, T, H]``.

    ``offset`` is the position of the first input token; ``past`` the cached
    keys/values of earlier positions per layer (or ``None``). Returns the hidden
    states ``[B, T, H]`` (logits ``[B, T, V]`` on the last stage; ``[B, 1, V]``, each
    row's last position, with ``last_only``) and the keys / values per layer including
    the new positions. ``layout``: packed rows (no ``past``), see :class:`PackedLayout`.
    """
    x = mx.take(params[EMBED], inputs, axis=0) if dims.is_first else inputs
    present: list[LayerKV] = []
    periods = rope_periods(dims.head_dim, dims.rope_theta)
    for i, layer in enumerate(dims.layers):
        prefix = layer_prefix(layer)
        h = mx.fast.rms_norm(x, params[prefix + "input_layernorm.weight"], dims.rms_norm_eps)
        attn, kv = _attention(params, prefix, h, dims, offset, None if past is None else past[i],
                              periods, layout)
        present.append(kv)
        x = x + attn
        h = mx.fast.rms_norm(x, params[prefix + "post_attention_layernorm.weight"], dims.rms_norm_eps)
        x = x + _mlp(params, prefix, h, dims)
    if dims.is_last:
        if last_only:
            x = x[:, -1:]
        x = mx.fast.rms_norm(x, params[FINAL_NORM], dims.rms_norm_eps)
        x = x @ params[dims.head_name].T
    return x, present


def gather_logprobs(logits: mx.array, targets: mx.array, temperature: float) -> mx.array:
    """``log softmax(logits / temperature)`` at ``targets``: ``[B, T, V], [B, T] -> [B, T]``."""
    scaled = logits / temperature if temperature != 1.0 else logits
    chosen = mx.take_along_axis(scaled, targets[..., None], axis=-1)[..., 0]
    return chosen - mx.logsumexp(scaled, axis=-1)
