"""LoRA on a torch ``StageModule`` through PEFT, with Polis's tensor names.

``attach_lora`` injects PEFT's LoRA layers (``peft.inject_adapter_in_model``; dropout
0, no adapter bias, scaling ``alpha / rank``) into the stage's targeted ``nn.Linear``
modules, freezes every base parameter, sets the adapters to the values given
(``backends.lora.initial_adapters``, so torch and MLX start alike) and returns the
adapters keyed by the names of ``backends.lora`` (PEFT's own names carry the adapter
name: ``...q_proj.lora_A.default.weight``). ``base_parameters`` maps the base weights
back to their HF names (PEFT moves a wrapped weight to ``...q_proj.base_layer.weight``).

PEFT is imported only here, and only when a LoRA stage is built. What this module
does not know: numpy, optimisers, the StageBackend protocol (``backends.torch_stage``).
"""

from __future__ import annotations

from typing import Mapping

import numpy as np
import torch
from torch import nn

from backends.base import BackendUnavailable, LoraConfig

_ADAPTER = "default"


def attach_lora(module: nn.Module, lora: LoraConfig,
                values: Mapping[str, np.ndarray]) -> dict[str, nn.Parameter]:
    """Wrap ``module``'s targeted linears with PEFT LoRA layers holding ``values``; freeze the rest."""
    try:
        import peft
    except ImportError:
        raise BackendUnavailable('LoRA on torch needs PEFT (the real-model extra): '
                                 'pip install "peft>=0.13" "transformers>=4.45"') from None
    config = peft.LoraConfig(r=lora.rank, lora_alpha=lora.alpha, target_modules=list(lora.target_modules),
                             lora_dropout=0.0, bias="none")
    peft.inject_adapter_in_model(config, module, adapter_name=_ADAPTER)
    found = {}
    for name, param in module.named_parameters():
        polis_name = name.replace(f".{_ADAPTER}.weight", ".weight") if ".lora_" in name else None
        if polis_name is None:
            param.requires_grad_(False)
        else:
            found[polis_name] = param
    if set(found) != set(values):
        missing, extra = sorted(set(values) - set(found)), sorted(set(found) - set(values))
        raise RuntimeError(f"PEFT built other adapters than planned: missing {missing[:3]}, extra {extra[:3]}")
    with torch.no_grad():
        for name, param in found.items():
            param.copy_(torch.from_numpy(np.asarray(values[name], np.float32)))
            param.requires_grad_(True)
    return {name: found[name] for name in values}  # in the planned order


def base_parameters(module: nn.Module) -> dict[str, nn.Parameter]:
    """The module's non-adapter parameters under their HF names (``.base_layer`` removed)."""
    return {name.replace(".base_layer.", "."): p for name, p in module.named_parameters() if ".lora_" not in name}
