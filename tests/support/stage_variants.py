"""Backend variants for contract tests: torch CPU / CUDA / MPS and MLX, and loading a split checkpoint.

A test module defines its own fixture over ``BACKENDS`` and calls :func:`skip_reason`
(so the skip message says what is missing); :func:`load_pipeline` loads a checkpoint
cut into stages, one variant per stage (mixed torch/MLX chains included), through
``engine.model.load_stage`` as the product does. Test-only.
"""

from __future__ import annotations

import importlib.util
from pathlib import Path
from typing import Sequence

import numpy as np
import pytest

from backends import registry
from backends.base import OptimizerConfig, StageBackend
from engine.model.checkpoint import Checkpoint
from engine.model.loader import load_stage
from engine.model.shard_plan import plan_stages

#: variant -> (registry name, device)
VARIANTS = {"torch-cpu": ("torch", "cpu"), "torch-cuda": ("torch", "cuda"),
            "torch-mps": ("torch", "mps"), "mlx": ("mlx", None)}
#: pytest params for a fixture over the variants, with their markers
BACKENDS = [pytest.param("torch-cpu"), pytest.param("torch-cuda", marks=pytest.mark.gpu),
            pytest.param("torch-mps", marks=pytest.mark.gpu), pytest.param("mlx", marks=pytest.mark.mlx)]


def skip_reason(variant: str) -> str | None:
    """Why ``variant`` cannot run here, or ``None``."""
    if variant == "mlx":
        if importlib.util.find_spec("backends.mlx_stage") is None:
            return "backends/mlx_stage.py is not written yet"
        return registry.unavailable_reason("mlx")
    import torch

    if variant == "torch-cuda" and not torch.cuda.is_available():
        return "no CUDA device"
    if variant == "torch-mps" and not torch.backends.mps.is_available():
        return "no MPS device"
    return None


def load_pipeline(path: str | Path, variants: Sequence[str] | str, num_stages: int,
                  optimizer: OptimizerConfig | None = None) -> list[StageBackend]:
    """The checkpoint at ``path`` cut into ``num_stages`` stages, stage i on ``variants[i]`` (or all one)."""
    chain = [variants] * num_stages if isinstance(variants, str) else list(variants)
    checkpoint = Checkpoint(path)
    stages = []
    for spec, variant in zip(plan_stages(checkpoint.config.num_hidden_layers, num_stages), chain):
        name, device = VARIANTS[variant]
        stages.append(load_stage(checkpoint, spec, name, device=device, optimizer=optimizer))
    return stages


def summed_grads(stages: Sequence[StageBackend]) -> dict[str, np.ndarray]:
    """Gradients of a chain keyed by name, summed where two stages hold the same tensor."""
    total: dict[str, np.ndarray] = {}
    for stage in stages:
        for name, g in stage.grads().items():
            total[name] = total[name] + g if name in total else g
    return total


def assert_grads_close(got: dict[str, np.ndarray], want: dict[str, np.ndarray], atol: float = 1e-5) -> None:
    """Same names, and each gradient within ``atol`` times max(1, its largest entry)."""
    assert set(got) == set(want)
    for name in want:
        scale = max(1.0, float(np.abs(want[name]).max()))
        np.testing.assert_allclose(got[name], want[name], rtol=0, atol=atol * scale, err_msg=name)
