"""LoRA adapters at the backend boundary: which weights get one, names, shapes, first values, merging.

One module for both backends, in numpy, so an adapter means the same thing on torch
and on MLX, on every replica and on the wire:

* a decoder layer's linear weight ``W [out, in]`` named ``<module>.weight`` (say
  ``model.layers.3.self_attn.q_proj.weight``) whose last name part is in
  ``LoraConfig.target_modules`` gets ``<module>.lora_A.weight`` ``[rank, in]`` and
  ``<module>.lora_B.weight`` ``[out, rank]`` — the names PEFT writes in an adapter file
  (less its ``base_model.model.`` prefix);
* the first ``A`` is uniform in ``+-1/sqrt(in)`` (PEFT's kaiming-uniform bound) from a
  generator seeded by ``LoraConfig.init_seed`` and the tensor's name, so every backend
  and machine draws the same adapter; ``B`` starts at zero, so version 0 is the base;
* the adapted weight is ``W + (alpha / rank) * B @ A`` (:func:`merge`, for export).

What it does not know: how a backend computes ``B A x`` (PEFT layers on torch,
``backends.mlx_decoder`` on MLX), optimisers, gradients, transports.
"""

from __future__ import annotations

import dataclasses
import zlib
from typing import Mapping

import numpy as np

from backends.base import BackendError, LoraConfig
from backends.stage_layout import StageLayout, layer_prefix

LORA_A = ".lora_A.weight"
LORA_B = ".lora_B.weight"
_ATTENTION = ("q_proj", "k_proj", "v_proj", "o_proj")


def adapted_modules(layout: StageLayout, lora: LoraConfig) -> list[str]:
    """Module names (``model.layers.3.self_attn.q_proj``) of this stage that get an adapter, layer order."""
    modules = []
    for layer in range(layout.spec.layer_start, layout.spec.layer_end):
        for target in lora.target_modules:
            part = "self_attn." if target in _ATTENTION else "mlp."
            modules.append(layer_prefix(layer) + part + target)
    return modules


def adapter_shapes(layout: StageLayout, lora: LoraConfig) -> dict[str, tuple[int, ...]]:
    """Adapter tensor name -> shape for every adapted weight of the stage (``A`` then ``B``)."""
    shapes: dict[str, tuple[int, ...]] = {}
    for module in adapted_modules(layout, lora):
        out_features, in_features = layout.shapes[module + ".weight"]
        shapes[module + LORA_A] = (lora.rank, in_features)
        shapes[module + LORA_B] = (out_features, lora.rank)
    return shapes


def adapter_layout(layout: StageLayout, lora: LoraConfig) -> StageLayout:
    """The layout of the stage's trainable tensors under LoRA: the adapters, nothing shared."""
    return dataclasses.replace(layout, shapes=adapter_shapes(layout, lora), tied_names=())


def initial_adapters(layout: StageLayout, lora: LoraConfig) -> dict[str, np.ndarray]:
    """The adapters every backend starts from: ``A`` seeded by (``init_seed``, name), ``B`` zeros; fp32."""
    values = {}
    for name, shape in adapter_shapes(layout, lora).items():
        if name.endswith(LORA_B):
            values[name] = np.zeros(shape, np.float32)
        else:
            bound = 1.0 / np.sqrt(shape[1])
            rng = np.random.default_rng([lora.init_seed, zlib.crc32(name.encode("utf-8"))])
            values[name] = rng.uniform(-bound, bound, size=shape).astype(np.float32)
    return values


def merge(base: Mapping[str, np.ndarray], adapters: Mapping[str, np.ndarray],
          lora: LoraConfig) -> dict[str, np.ndarray]:
    """``base`` (HF names, fp32) with ``(alpha / rank) * B @ A`` added to every adapted weight."""
    merged = dict(base)
    for name in adapters:
        if not name.endswith(LORA_A):
            continue
        module = name[: -len(LORA_A)]
        weight_name, b_name = module + ".weight", module + LORA_B
        if weight_name not in base or b_name not in adapters:
            raise BackendError(f"adapter {name} has no base weight {weight_name} or no {b_name}")
        update = adapters[b_name].astype(np.float32) @ adapters[name].astype(np.float32)
        merged[weight_name] = (base[weight_name] + np.float32(lora.scaling) * update).astype(np.float32)
    return merged
