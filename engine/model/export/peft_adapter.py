"""A LoRA run's adapters in PEFT's on-disk format: ``adapter_config.json`` + ``adapter_model.safetensors``.

Polis names adapter tensors as PEFT does inside the model (``backends.lora``:
``model.layers.3.self_attn.q_proj.lora_A.weight``); PEFT's saved files prefix them with
``base_model.model.`` (the ``PeftModel`` wrapping the ``*ForCausalLM``), and the config
states rank, alpha, targets and a zero dropout. ``peft.PeftModel.from_pretrained(base,
DIR)`` then rebuilds the trained model on the untouched base checkpoint. Every stage's
adapters go into the one file (PEFT reads a single ``adapter_model.safetensors``).

What it does not know: where the adapters came from, merged weights.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, Mapping, Sequence

import numpy as np

from engine.model.errors import CheckpointError
from engine.model.importers.output import write_json

ADAPTER_CONFIG_FILE = "adapter_config.json"
ADAPTER_WEIGHTS_FILE = "adapter_model.safetensors"
#: PEFT's prefix of adapter tensor names in a saved file
PEFT_PREFIX = "base_model.model."


def adapter_config(lora: Mapping[str, Any], base_dir: Path) -> dict[str, Any]:
    """PEFT's ``LoraConfig`` fields for these adapters (plain LoRA: no DoRA, no rsLoRA, no bias)."""
    return {
        "peft_type": "LORA", "task_type": "CAUSAL_LM", "base_model_name_or_path": str(base_dir),
        "r": int(lora["rank"]), "lora_alpha": float(lora["alpha"]), "lora_dropout": 0.0,
        "target_modules": sorted(lora["target_modules"]), "bias": "none", "fan_in_fan_out": False,
        "inference_mode": True, "init_lora_weights": True, "modules_to_save": None, "use_rslora": False,
        "use_dora": False, "layers_to_transform": None, "layers_pattern": None, "rank_pattern": {},
        "alpha_pattern": {}, "revision": None,
    }


def write_adapter(directory: Path, stages: Sequence[Mapping[str, np.ndarray]], lora: Mapping[str, Any],
                  base_dir: Path) -> tuple[str, ...]:
    """Write every stage's adapters and the config into ``directory``; returns the file names."""
    from safetensors.numpy import save_file

    tensors: dict[str, np.ndarray] = {}
    for stage in stages:
        for name, array in stage.items():
            if ".lora_A." not in name and ".lora_B." not in name:
                raise CheckpointError(directory, f"stage tensor {name} is not a LoRA adapter")
            tensors[PEFT_PREFIX + name] = np.ascontiguousarray(array, dtype=np.float32)
    save_file(tensors, str(directory / ADAPTER_WEIGHTS_FILE), metadata={"format": "pt"})
    write_json(directory / ADAPTER_CONFIG_FILE, adapter_config(lora, base_dir))
    return ADAPTER_WEIGHTS_FILE, ADAPTER_CONFIG_FILE
