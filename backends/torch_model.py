"""A slice of a Llama/Qwen2 decoder as a plain PyTorch module, with HF parameter names.

``StageModule`` is built from a ``backends.stage_layout.StageLayout`` and holds
what one pipeline stage owns — optionally the token embedding, a contiguous run
of decoder layers (kept under their *global* indices, so ``named_parameters()``
yields ``model.layers.7.mlp.up_proj.weight``), and optionally the final RMSNorm
and the LM head (``model.embed_tokens.weight`` itself when the layout says the
head is tied). The maths follows ``transformers``' Llama exactly: RMSNorm in
fp32, default RoPE with ``rotate_half``, grouped-query attention with the
optional biases the layout found (q/k/v for Qwen2; o and MLP for some Llamas),
SwiGLU MLP.

A KV cache is a plain ``dict`` layer index -> ``(k, v)`` of shape
``[B, kv_heads, L, head_dim]`` passed into ``forward`` and updated in place.
This module knows nothing about numpy, devices, optimisers or the protocol; it
is the maths only (``backends.torch_stage`` wraps it).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from backends.stage_layout import EMBED, LayerBiases, StageLayout

KVCache = dict[int, tuple[torch.Tensor, torch.Tensor]]


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float) -> None:
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        dtype = x.dtype
        x = x.float()
        x = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * x.to(dtype)


def rope_cos_sin(positions: torch.Tensor, head_dim: int, theta: float) -> tuple[torch.Tensor, torch.Tensor]:
    """cos/sin tables ``[T, head_dim]`` for the default (unscaled) rotary embedding."""
    inv_freq = 1.0 / (theta ** (torch.arange(0, head_dim, 2, dtype=torch.float, device=positions.device) / head_dim))
    freqs = positions[:, None].float() * inv_freq
    emb = torch.cat((freqs, freqs), dim=-1)
    return emb.cos(), emb.sin()


def _rotate_half(x: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    return torch.cat((-x[..., half:], x[..., :half]), dim=-1)


def _apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    return x * cos + _rotate_half(x) * sin


class Attention(nn.Module):
    def __init__(self, config, biases: LayerBiases) -> None:
        super().__init__()
        self.n_heads, self.n_kv = config.num_attention_heads, config.num_key_value_heads
        self.head_dim = config.head_dim
        h, bias = config.hidden_size, biases.qkv
        self.q_proj = nn.Linear(h, self.n_heads * self.head_dim, bias=bias)
        self.k_proj = nn.Linear(h, self.n_kv * self.head_dim, bias=bias)
        self.v_proj = nn.Linear(h, self.n_kv * self.head_dim, bias=bias)
        self.o_proj = nn.Linear(self.n_heads * self.head_dim, h, bias=biases.o)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                past: tuple[torch.Tensor, torch.Tensor] | None,
                mask: torch.Tensor | None = None) -> tuple[torch.Tensor, tuple]:
        b, t, _ = x.shape
        q = self.q_proj(x).view(b, t, self.n_heads, self.head_dim).transpose(1, 2)
        k = self.k_proj(x).view(b, t, self.n_kv, self.head_dim).transpose(1, 2)
        v = self.v_proj(x).view(b, t, self.n_kv, self.head_dim).transpose(1, 2)
        q, k = _apply_rope(q, cos, sin), _apply_rope(k, cos, sin)
        past_len = 0
        if past is not None:
            past_len = past[0].shape[2]
            k, v = torch.cat((past[0], k), dim=2), torch.cat((past[1], v), dim=2)
        # grouped-query attention without copying each key/value head per query head (a copy of the
        # whole cache per layer and step was ~30 % of a SmolLM2 decoding step on a CPU)
        gqa = self.n_heads != self.n_kv
        if mask is not None:  # packed rows: each row's own mask [B, 1, T, T] (no cache)
            out = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, enable_gqa=gqa)
        elif past_len == 0:
            out = F.scaled_dot_product_attention(q, k, v, is_causal=t > 1, enable_gqa=gqa)
        elif t == 1:
            out = F.scaled_dot_product_attention(q, k, v, enable_gqa=gqa)
        else:  # new query i sits at position past_len + i and sees keys 0..past_len + i
            mask = torch.ones(t, past_len + t, dtype=torch.bool, device=x.device).tril(diagonal=past_len)
            out = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, enable_gqa=gqa)
        out = out.transpose(1, 2).reshape(b, t, self.n_heads * self.head_dim)
        return self.o_proj(out), (k, v)


class MLP(nn.Module):
    def __init__(self, config, bias: bool) -> None:
        super().__init__()
        h, m = config.hidden_size, config.intermediate_size
        self.gate_proj = nn.Linear(h, m, bias=bias)
        self.up_proj = nn.Linear(h, m, bias=bias)
        self.down_proj = nn.Linear(m, h, bias=bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


class DecoderLayer(nn.Module):
    def __init__(self, config, biases: LayerBiases) -> None:
        super().__init__()
        self.input_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.self_attn = Attention(config, biases)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.mlp = MLP(config, biases.mlp)

    def forward(self, x, cos, sin, past, mask=None):
        attn, present = self.self_attn(self.input_layernorm(x), cos, sin, past, mask)
        x = x + attn
        return x + self.mlp(self.post_attention_layernorm(x)), present


class _Body(nn.Module):
    """Holds the parameters that HF keeps under ``model.``."""

    def __init__(self, config, layout: StageLayout, has_embed: bool, has_norm: bool) -> None:
        super().__init__()
        if has_embed:
            self.embed_tokens = nn.Embedding(config.vocab_size, config.hidden_size)
        layers = range(layout.spec.layer_start, layout.spec.layer_end)
        self.layers = nn.ModuleDict({str(i): DecoderLayer(config, layout.biases) for i in layers})
        if has_norm:
            self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps)


class StageModule(nn.Module):
    """The stage ``layout`` describes (its spec decides embedding, layers, norm and head)."""

    def __init__(self, config, layout: StageLayout) -> None:
        super().__init__()
        self.first, self.last = layout.spec.is_first, layout.spec.is_last
        self.tied = layout.head_name == EMBED
        self.head_dim, self.rope_theta = config.head_dim, config.rope_theta
        self.model = _Body(config, layout, has_embed=self.first or self.tied, has_norm=self.last)
        if self.last and not self.tied:
            self.lm_head = nn.Linear(config.hidden_size, config.vocab_size, bias=False)

    def forward(self, x: torch.Tensor, start_pos: int = 0, cache: KVCache | None = None,
                last_only: bool = False, layout: tuple[torch.Tensor, torch.Tensor] | None = None) -> torch.Tensor:
        """Token ids ``[B, T]`` (first stage) or hidden ``[B, T, H]`` -> hidden or logits.

        With ``cache`` the new keys/values are appended to it in place. ``last_only``: the last
        stage normalises and projects only each row's last position (logits ``[B, 1, V]``).
        ``layout``: packed rows' positions ``[B, T]`` and attention mask ``[B, T, T]``
        (``backends.base.segment_layout``), instead of causal rows from ``start_pos``.
        """
        if self.first:
            x = self.model.embed_tokens(x)
        mask = None
        if layout is None:
            positions = torch.arange(start_pos, start_pos + x.shape[1], device=x.device)
            cos, sin = rope_cos_sin(positions, self.head_dim, self.rope_theta)
        else:
            rows, width = layout[0].shape
            cos, sin = rope_cos_sin(layout[0].reshape(-1), self.head_dim, self.rope_theta)
            cos, sin = cos.view(rows, 1, width, -1), sin.view(rows, 1, width, -1)
            mask = layout[1][:, None]
        for key, layer in self.model.layers.items():
            index = int(key)
            x, present = layer(x, cos, sin, None if cache is None else cache.get(index), mask)
            if cache is not None:
                cache[index] = present
        if not self.last:
            return x
        if last_only:
            x = x[:, -1:]
        x = self.model.norm(x)
        head = self.model.embed_tokens.weight if self.tied else self.lm_head.weight
        return F.linear(x, head)
