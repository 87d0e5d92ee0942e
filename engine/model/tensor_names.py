"""Which Hugging Face tensors (names and shapes) a pipeline stage holds.

Names follow the HF Llama/Qwen2 checkpoint layout (``model.embed_tokens.weight``,
``model.layers.{i}.self_attn.q_proj.weight``, ``model.norm.weight``,
``lm_head.weight``). Stage 0 holds the embeddings, every stage its layers, the
last stage the final norm and the head. With ``tie_word_embeddings`` the head *is*
the embedding matrix, so the last stage holds ``model.embed_tokens.weight`` too
(its own copy when it is not also stage 0) and there is no ``lm_head.weight``.
This is what a checkpoint must contain, derived from its config (Llama/Qwen2
without o_proj/MLP biases, which ``ModelConfig`` refuses); the backends check
what they are actually given with ``backends.stage_layout``, which also accepts
those optional biases. This module knows the naming convention only; it reads
no file.
"""

from __future__ import annotations

from backends.base import ModelConfigLike, StageSpec
from backends.stage_layout import EMBED, FINAL_NORM, LM_HEAD


def layer_tensor_shapes(config: ModelConfigLike, layer: int) -> dict[str, tuple[int, ...]]:
    """Names and shapes of one decoder layer's parameters."""
    h, d = config.hidden_size, config.head_dim
    q, kv = config.num_attention_heads * d, config.num_key_value_heads * d
    p = f"model.layers.{layer}."
    shapes = {
        p + "input_layernorm.weight": (h,),
        p + "self_attn.q_proj.weight": (q, h),
        p + "self_attn.k_proj.weight": (kv, h),
        p + "self_attn.v_proj.weight": (kv, h),
        p + "self_attn.o_proj.weight": (h, q),
        p + "post_attention_layernorm.weight": (h,),
        p + "mlp.gate_proj.weight": (config.intermediate_size, h),
        p + "mlp.up_proj.weight": (config.intermediate_size, h),
        p + "mlp.down_proj.weight": (h, config.intermediate_size),
    }
    if config.attention_bias:
        shapes.update({p + "self_attn.q_proj.bias": (q,), p + "self_attn.k_proj.bias": (kv,),
                       p + "self_attn.v_proj.bias": (kv,)})
    return shapes


def stage_tensor_shapes(config: ModelConfigLike, spec: StageSpec) -> dict[str, tuple[int, ...]]:
    """Names and shapes of every parameter stage ``spec`` holds, in model order."""
    embed_shape = (config.vocab_size, config.hidden_size)
    shapes: dict[str, tuple[int, ...]] = {}
    if spec.is_first:
        shapes[EMBED] = embed_shape
    for layer in range(spec.layer_start, spec.layer_end):
        shapes.update(layer_tensor_shapes(config, layer))
    if spec.is_last:
        shapes[FINAL_NORM] = (config.hidden_size,)
        if config.tie_word_embeddings:
            shapes[EMBED] = embed_shape
        else:
            shapes[LM_HEAD] = embed_shape
    return shapes
