"""The unsplit ``transformers`` model: the yardstick sharded stages are checked against.

Loads a checkpoint directory with ``AutoModelForCausalLM`` (fp32, eval mode, no
hub access: ``HF_HUB_OFFLINE`` is forced) and returns logits or greedy
continuations as numpy. torch and transformers are imported inside the
functions, never at module import, so ``engine`` stays free of them. This module
knows nothing about stages or backends.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any, Sequence

import numpy as np


def load_reference_model(checkpoint_dir: str | Path) -> Any:
    """``AutoModelForCausalLM`` for the checkpoint, fp32, eval mode, local files only."""
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    os.environ.setdefault("TRANSFORMERS_NO_ADVISORY_WARNINGS", "1")
    import torch
    from transformers import AutoModelForCausalLM
    from transformers.utils import logging as hf_logging

    hf_logging.disable_progress_bar()
    model = AutoModelForCausalLM.from_pretrained(str(checkpoint_dir), local_files_only=True)
    return model.to(torch.float32).eval()


def reference_logits(model: Any, tokens: np.ndarray) -> np.ndarray:
    """Logits ``float32 [B, T, V]`` of the unsplit model for token ids ``[B, T]``."""
    import torch

    with torch.no_grad():
        return model(torch.from_numpy(np.asarray(tokens, dtype=np.int64))).logits.float().numpy()


def reference_greedy(model: Any, prompt: Sequence[int], max_new_tokens: int, eos_id: int | None) -> list[int]:
    """Greedy continuation of one prompt by ``generate`` (new tokens only, stops after eos)."""
    import torch

    with torch.no_grad():
        out = model.generate(torch.tensor([list(prompt)], dtype=torch.int64), max_new_tokens=max_new_tokens,
                             min_new_tokens=0, do_sample=False, eos_token_id=eos_id, pad_token_id=eos_id,
                             attention_mask=torch.ones(1, len(prompt), dtype=torch.int64))
    return out[0, len(prompt):].tolist()


def reference_logits_fp64(model: Any, tokens: np.ndarray) -> np.ndarray:
    """Logits ``float64 [B, T, V]`` of the model in float64 — the yardstick's own rounding, measured.

    Converts ``model`` to float64 in place (callers use it last).
    """
    import torch

    model.to(torch.float64)
    with torch.no_grad():
        return model(torch.from_numpy(np.asarray(tokens, dtype=np.int64))).logits.numpy()
