"""Logits of a swarm's pipeline at a version, and of a transformers checkpoint, for export tests."""

from __future__ import annotations

from pathlib import Path
from typing import Sequence

import numpy as np

#: token ids the export tests feed both sides (within the tiny base's vocabulary)
SAMPLE_IDS = np.random.default_rng(0).integers(3, 20, size=(4, 9))


def pipeline_logits(base_checkpoint: str | Path, stage_files: Sequence[str], version: int,
                    ids: np.ndarray = SAMPLE_IDS, num_layers: int = 2) -> np.ndarray:
    """The pipeline at ``version``: every stage restored from its checkpoint as a node restores it
    (``num_layers``: the base's decoder layers, 2 in the tiny base)."""
    from backends.base import OptimizerConfig
    from engine.model.shard_plan import plan_stages
    from engine.swarm.stage_runtime import StageRuntime

    runtimes = []
    for spec, stage_file in zip(plan_stages(num_layers, len(stage_files)), stage_files):
        rt = StageRuntime("torch", "cpu")
        rt.load_checkpoint(str(base_checkpoint), spec, OptimizerConfig(), stage_file=stage_file, version=None)
        assert rt.version == version, (stage_file, rt.version, version)
        runtimes.append(rt)
    x = ids
    for rt in runtimes:
        x = rt.forward_only(x)
        rt.close()
    return x


def model_logits(model_dir: str | Path, ids: np.ndarray = SAMPLE_IDS) -> np.ndarray:
    """Plain transformers' logits of the checkpoint in ``model_dir`` (fp32)."""
    import torch
    import transformers

    model = transformers.AutoModelForCausalLM.from_pretrained(str(model_dir), dtype=torch.float32)
    with torch.no_grad():
        return model(torch.as_tensor(ids)).logits.numpy()
