"""Evidence a swarm test reads after the fact: the coordinator's step log and stage checkpoints.

The step log is the stats API's ``steps`` (one entry per applied update, ``StepRunner._record_step``);
each entry's ``stages`` holds per stage what its replicas' ``stepped`` said
(``engine.swarm.step_runner.stage_figures``: replicas that stepped, the median pre-clip gradient
norm, whether the update was skipped as non-finite, the weights digest the vote decided). A stage
checkpoint is what a stage's leader wrote under its data folder (``StageRuntime.save_stage``);
its digest (``engine.swarm.weight_votes.weights_digest``) compares with the votes' and the base's.

What it does not know: how the swarm was started, which node is hostile, what a test asserts.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any


def ready_peers(stats: dict) -> set[str]:
    """Peer ids of the nodes the coordinator counts as ready."""
    return {n["peer_id"] for n in stats.get("nodes", []) if n["ready"]}


def stage_steps(stats: dict, *, after: int = 0, stage: int = 0, replicas: int | None = None) -> list[dict[str, Any]]:
    """Per update of a version above ``after``: ``stage``'s figures with the ``version`` it made, oldest
    first; with ``replicas``, only updates that exactly that many replicas of the stage stepped."""
    out = []
    for entry in stats.get("steps", []):
        figures = entry.get("stages") or []
        if entry["version"] <= after or len(figures) <= stage:
            continue
        if replicas is None or figures[stage]["replicas"] == replicas:
            out.append({"version": entry["version"], **figures[stage]})
    return out


def grad_norms(steps: list[dict[str, Any]]) -> list[float]:
    """The gradient norms of ``steps`` (:func:`stage_steps`) that were applied."""
    return [s["grad_norm"] for s in steps if s["grad_norm"] is not None and not s["skipped"]]


def stage_checkpoint(data_dir: Path, stage: int = 0) -> tuple[int, dict[str, Any]] | None:
    """``(version, weights)`` of the newest ``stage`` checkpoint a node wrote under ``data_dir``
    (None: it wrote none, e.g. it never led the stage)."""
    from safetensors import safe_open

    files = sorted(data_dir.glob(f"stages/*/stage{stage}.safetensors"), key=lambda p: p.stat().st_mtime)
    if not files:
        return None
    with safe_open(str(files[-1]), framework="numpy") as f:  # one open: the leader replaces the file whole
        return int((f.metadata() or {})["polis_version"]), {name: f.get_tensor(name) for name in f.keys()}


def base_stage_digest(checkpoint: str | Path, *, num_stages: int = 1, stage: int = 0) -> str:
    """The weights digest of ``stage`` of ``num_stages`` cut from the base ``checkpoint`` (what a
    replica holds before its first update)."""
    from backends.base import OptimizerConfig
    from engine.model.checkpoint import Checkpoint
    from engine.model.shard_plan import plan_stages
    from engine.swarm.stage_runtime import StageRuntime
    from engine.swarm.weight_votes import weights_digest

    spec = plan_stages(Checkpoint(Path(checkpoint)).config.num_hidden_layers, num_stages)[stage]
    rt = StageRuntime("torch", "cpu")
    try:
        rt.load_checkpoint(checkpoint, spec, OptimizerConfig())
        return weights_digest(rt.state_dict())
    finally:
        rt.close()


def all_finite(weights: dict[str, Any]) -> bool:
    import numpy as np

    return all(bool(np.isfinite(w).all()) for w in weights.values())
