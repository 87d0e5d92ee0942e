"""Which Hugging Face parameters one pipeline stage holds, and their shapes.

Given a :class:`~backends.base.StageSpec` and a model config (``ModelConfigLike``)
this module says which HF-named tensors the stage needs (``model.embed_tokens.weight``
on the first stage, ``model.layers.{i}.*`` for its layers, ``model.norm.weight``
and the LM head on the last), which are optional (biases that only some
checkpoints carry), and what shape each must have. Backends use it to validate
the weights they are given before building anything, so a wrong or truncated
shard fails with a clear :class:`~backends.base.BackendError` instead of a shape
error deep inside a matmul.

It is plain Python (no numpy maths, no torch, no mlx) and knows nothing about
how tensors are computed, stored or sent.

Head convention: the last stage's LM head is ``lm_head.weight`` when given. If
the config ties word embeddings and ``lm_head.weight`` is absent, the head is
``model.embed_tokens.weight`` (which a non-first last stage then holds only for
the head). Cut into several stages, a tied model's first and last stage both list
that name in ``StageLayout.tied_names``: two copies that training keeps equal.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Iterable

from backends.base import BackendError, ModelConfigLike, StageSpec

EMBED = "model.embed_tokens.weight"
FINAL_NORM = "model.norm.weight"
LM_HEAD = "lm_head.weight"

#: names HF checkpoints sometimes carry that are buffers, not parameters
_IGNORED_SUFFIXES = ("rotary_emb.inv_freq",)


def layer_prefix(layer: int) -> str:
    return f"model.layers.{layer}."


@dataclass(frozen=True)
class LayerBiases:
    """Which optional biases a decoder layer carries (decided from the given names)."""

    qkv: bool  #: q_proj/k_proj/v_proj biases (Qwen2; Llama with ``attention_bias``)
    o: bool  #: o_proj bias (Llama with ``attention_bias``)
    mlp: bool  #: gate/up/down biases (Llama with ``mlp_bias``)


@dataclass(frozen=True)
class StageLayout:
    """The validated parameter layout of one stage."""

    spec: StageSpec
    shapes: dict[str, tuple[int, ...]]  #: every parameter the stage holds -> shape
    biases: LayerBiases
    head_name: str | None  #: name of the LM-head matrix on the last stage, else None
    #: names another stage also holds: the tied embedding on the first and the last stage
    #: of a tied model cut into several stages (see ``StageBackend.tied_names``)
    tied_names: tuple[str, ...] = ()

    @property
    def names(self) -> list[str]:
        return list(self.shapes)


def _layer_shapes(config: ModelConfigLike, layer: int) -> dict[str, tuple[int, ...]]:
    h, d = config.hidden_size, config.head_dim
    q_out = config.num_attention_heads * d
    kv_out = config.num_key_value_heads * d
    p = layer_prefix(layer)
    return {
        p + "input_layernorm.weight": (h,),
        p + "self_attn.q_proj.weight": (q_out, h),
        p + "self_attn.k_proj.weight": (kv_out, h),
        p + "self_attn.v_proj.weight": (kv_out, h),
        p + "self_attn.o_proj.weight": (h, q_out),
        p + "post_attention_layernorm.weight": (h,),
        p + "mlp.gate_proj.weight": (config.intermediate_size, h),
        p + "mlp.up_proj.weight": (config.intermediate_size, h),
        p + "mlp.down_proj.weight": (h, config.intermediate_size),
    }


def _bias_shapes(config: ModelConfigLike, layer: int) -> dict[str, dict[str, tuple[int, ...]]]:
    h, d = config.hidden_size, config.head_dim
    p = layer_prefix(layer)
    kv_out = config.num_key_value_heads * d
    return {
        "qkv": {p + "self_attn.q_proj.bias": (config.num_attention_heads * d,),
                p + "self_attn.k_proj.bias": (kv_out,),
                p + "self_attn.v_proj.bias": (kv_out,)},
        "o": {p + "self_attn.o_proj.bias": (h,)},
        "mlp": {p + "mlp.gate_proj.bias": (config.intermediate_size,),
                p + "mlp.up_proj.bias": (config.intermediate_size,),
                p + "mlp.down_proj.bias": (h,)},
    }


def check_config(config: ModelConfigLike) -> None:
    """Raise :class:`BackendError` if the config cannot describe a decoder we can build."""
    for field in ("vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers",
                  "num_attention_heads", "num_key_value_heads", "head_dim"):
        value = getattr(config, field, None)
        if not isinstance(value, int) or value <= 0:
            raise BackendError(f"model config field {field} must be a positive int, got {value!r}")
    if config.num_attention_heads % config.num_key_value_heads:
        raise BackendError(f"num_attention_heads {config.num_attention_heads} is not a multiple of "
                           f"num_key_value_heads {config.num_key_value_heads}")
    if config.head_dim % 2:
        raise BackendError(f"head_dim {config.head_dim} must be even for rotary embeddings")
    if not config.rms_norm_eps > 0 or not config.rope_theta > 0:
        raise BackendError("rms_norm_eps and rope_theta must be positive")


def plan_stage(spec: StageSpec, config: ModelConfigLike, given: Iterable[str]) -> StageLayout:
    """Work out and validate the layout of ``spec`` from the names actually ``given``.

    Raises :class:`BackendError` naming missing and unexpected tensors. Shapes are
    returned, not checked (see :func:`check_shapes`).
    """
    check_config(config)
    if spec.layer_end > config.num_hidden_layers:
        raise BackendError(f"stage layers [{spec.layer_start}, {spec.layer_end}) exceed the model's "
                           f"{config.num_hidden_layers} layers")
    given_set = {n for n in given if not n.endswith(_IGNORED_SUFFIXES)}
    required: dict[str, tuple[int, ...]] = {}
    optional_groups: dict[str, dict[str, tuple[int, ...]]] = {"qkv": {}, "o": {}, "mlp": {}}
    h = config.hidden_size
    if spec.is_first:
        required[EMBED] = (config.vocab_size, h)
    for layer in range(spec.layer_start, spec.layer_end):
        required.update(_layer_shapes(config, layer))
        for group, shapes in _bias_shapes(config, layer).items():
            optional_groups[group].update(shapes)
    head_name = None
    if spec.is_last:
        required[FINAL_NORM] = (h,)
        if LM_HEAD in given_set or not config.tie_word_embeddings:
            head_name = LM_HEAD
        else:
            head_name = EMBED
        required[head_name] = (config.vocab_size, h)

    present = {}
    for group, shapes in optional_groups.items():
        hits = [n for n in shapes if n in given_set]
        if hits and len(hits) != len(shapes):
            missing = sorted(set(shapes) - set(hits))
            raise BackendError(f"incomplete {group} biases: missing {_short(missing)}")
        present[group] = bool(hits)
    if config.attention_bias and not present["qkv"] and optional_groups["qkv"]:
        raise BackendError("config has attention_bias but no q/k/v biases were given")

    shapes = dict(required)
    for group, group_shapes in optional_groups.items():
        if present[group]:
            shapes.update(group_shapes)
    missing = sorted(set(shapes) - given_set)
    unexpected = sorted(given_set - set(shapes))
    if missing:
        raise BackendError(f"weights for {spec.describe(config.num_hidden_layers)} are missing "
                           f"{len(missing)} tensors: {_short(missing)}")
    if unexpected:
        raise BackendError(f"unexpected tensors for {spec.describe(config.num_hidden_layers)}: "
                           f"{_short(unexpected)}")
    tied_names: tuple[str, ...] = ()
    if spec.num_stages > 1 and config.tie_word_embeddings and (spec.is_first or head_name == EMBED):
        tied_names = (EMBED,)
    return StageLayout(spec=spec, shapes=shapes,
                       biases=LayerBiases(qkv=present["qkv"], o=present["o"], mlp=present["mlp"]),
                       head_name=head_name, tied_names=tied_names)


def check_shapes(layout: StageLayout, shapes: dict[str, tuple[int, ...]], *, what: str = "weights") -> None:
    """Raise :class:`BackendError` if any given name is unknown or has the wrong shape."""
    for name, shape in shapes.items():
        want = layout.shapes.get(name)
        if want is None:
            raise BackendError(f"{what}: unknown parameter {name!r} for this stage")
        if tuple(shape) != want:
            raise BackendError(f"{what}: {name} has shape {tuple(shape)}, expected {want}")


def _short(names: list[str], limit: int = 6) -> str:
    text = ", ".join(names[:limit])
    return text + (f" ... (+{len(names) - limit} more)" if len(names) > limit else "")
