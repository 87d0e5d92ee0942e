"""A small local "run directory" made with the swarm's real parts, for export tests.

``make_run`` cuts a base checkpoint into stages with ``StageRuntime`` (the node's own
stage code, torch), trains them a few optimiser steps on random token ids the way the
swarm's ``apply`` does (a tied embedding's two gradients summed and installed on both
copies, as the coordinator-driven step keeps them), saves each stage with ``save_stage``
where a node would (``<run_dir>/node<k>/stages/<run_id>/stage<k>.safetensors``) and writes
the coordinator's database (``engine.swarm.store.Store``) with the run config, stage count,
run id, versions and the reported checkpoint paths. The runtimes are returned so a test can
compare the exported model against the very pipeline that served the version.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from backends.base import OptimizerConfig
from backends.stage_layout import EMBED
from engine.model.shard_plan import plan_stages
from engine.swarm.run_config import RunConfig
from engine.swarm.stage_runtime import StageRuntime
from engine.swarm.store import Store

RUN_ID = "testrun"


@dataclass
class StageRun:
    run_dir: Path
    runtimes: list[StageRuntime]
    version: int

    def logits(self, ids: np.ndarray) -> np.ndarray:
        """The pipeline's logits (every position) for ``ids`` through the live stages."""
        x = np.asarray(ids, dtype=np.int64)
        for rt in self.runtimes:
            x = rt.forward_only(x)
        return x

    def close(self) -> None:
        for rt in self.runtimes:
            rt.close()


def make_run(run_dir: Path, base_dir: Path, *, num_stages: int = 2, steps: int = 2,
             checkpoint_version: int | None = None, optimizer: OptimizerConfig | None = None,
             run: RunConfig | None = None, seed: int = 0,
             vocab_low: int = 3, vocab_high: int = 12, lr: float = 1e-2) -> StageRun:
    """Train ``steps`` versions and checkpoint every stage at the last one (or ``checkpoint_version``)."""
    from engine.model.checkpoint import Checkpoint

    optimizer = optimizer or OptimizerConfig(lr=lr)
    config = Checkpoint(base_dir).config
    specs = plan_stages(config.num_hidden_layers, num_stages)
    runtimes = []
    for spec in specs:
        rt = StageRuntime("torch", "cpu")
        rt.load_checkpoint(base_dir, spec, optimizer)
        runtimes.append(rt)
    rng = np.random.default_rng(seed)
    store = Store(run_dir / "coordinator.db")
    run = run or RunConfig()
    store.set_meta("run", run.to_dict())
    store.set_meta("num_stages", num_stages)
    store.set_meta("run_id", RUN_ID)
    for version in range(1, steps + 1):
        ids = rng.integers(vocab_low, vocab_high, size=(4, 6))
        _train_step(runtimes, ids, rng, f"s{version}")
        grads = [rt.grads() for rt in runtimes]
        if config.tie_word_embeddings and num_stages > 1 and EMBED in grads[0] and EMBED in grads[-1]:
            total = grads[0][EMBED] + grads[-1][EMBED]
            grads[0][EMBED], grads[-1][EMBED] = total, total.copy()
        for rt, g in zip(runtimes, grads):
            rt.apply(g, max_grad_norm=0.0, version=version)
        store.record_version(version, reward_mean=0.5, samples=int(ids.shape[0]),
                             info={"staleness_mean": float(version % 2)})
    at = checkpoint_version or steps
    paths = {}
    for k, rt in enumerate(runtimes):
        path = run_dir / f"node{k}" / "stages" / RUN_ID / f"stage{k}.safetensors"
        rt.save_stage(path, at)
        paths[k] = str(path)
    store.set_meta("stage_checkpoints", paths)
    store.set_meta("version", steps)
    store.record_eval(0, 0.25, 8)
    store.record_eval(steps, 0.5, 8)
    store.upsert_peer("peer-a", "key-a", backend="torch", device="cpu", stage=0, role="trainer")
    store.upsert_peer("peer-b", "key-b", backend="torch", device="cpu", stage=num_stages - 1, role="trainer")
    store.add_self_reported("peer-a", bytes_sent=12_345)
    store.add_credit({"peer-a": {"tokens_generated": 100}})
    store.close()
    return StageRun(run_dir=run_dir, runtimes=runtimes, version=at)


def _train_step(runtimes: list[StageRuntime], ids: np.ndarray, rng: np.random.Generator, key: str) -> None:
    """One forward/backward through the chain with a random last-stage output gradient."""
    x: Any = ids
    for rt in runtimes:
        rt.zero_grad()
        x = rt.train_forward(key, x)
    grad = rng.normal(0.0, 1e-2, size=x.shape).astype(np.float32)
    for rt in reversed(runtimes):
        grad = rt.train_backward(key, grad)
