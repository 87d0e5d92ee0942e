"""The real-model recipe in process: ``polis demo --model``'s run config, two torch stages, a trainer, an eval.

The in-process real-model benches (``engine.bench.act_learning``: activation encodings at the
stage boundary; ``engine.bench.comm_real``: replica sync of LoRA adapters) train exactly what
``polis demo --model`` trains: the very ``RunConfig`` that ``engine.swarm.train_command`` builds
(LoRA, learning rate, task, batch shape), cut into two stages on the CPU, driven by the
in-process ``Trainer``. This module builds those parts once for both, and takes one held-out
eval point the way both report it.

What it does not know: encodings, replicas, bytes on the wire, which scheme is good.
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Any

#: the pipeline depth of the in-process benches (the demo's)
STAGES = 2


def recipe(model: Path, settings: Sequence[str] = ()) -> Any:
    """``polis demo --model``'s ``RunConfig`` for ``model``, with ``settings`` (``KEY=VALUE``) on top."""
    from engine.swarm.train_command import run_config

    return run_config(argparse.Namespace(model=str(model), task=None, set=list(settings), env=""))


def load_stages(model: Path, run: Any) -> list[Any]:
    """``model`` cut into :data:`STAGES` torch stages on the CPU, with ``run``'s optimiser (and LoRA)."""
    from engine.model.checkpoint import Checkpoint
    from engine.model.loader import load_stage
    from engine.model.shard_plan import plan_stages
    from engine.swarm.train_command import optimizer_config

    ck = Checkpoint(model)
    return [load_stage(ck, spec, "torch", "cpu", optimizer_config(run))
            for spec in plan_stages(ck.config.num_hidden_layers, STAGES)]


def make_trainer(model: Path, run: Any, stages: Sequence[Any]) -> Any:
    """The in-process trainer of ``run`` over ``stages`` (the stages themselves, or wrappers that
    encode the boundary between them)."""
    from engine.rl.codec import load_codec
    from engine.rl.pipeline import LocalPipeline
    from engine.rl.trainer import Trainer
    from engine.swarm.train_command import trainer_config

    return Trainer(LocalPipeline(list(stages)), load_codec(model), trainer_config(run))


def eval_point(chain: Sequence[Any], trainer: Any, version: int, samples: int,
               trained: dict[str, Any] | None = None) -> dict[str, Any]:
    """One held-out eval of ``trainer``: strict and content-only scores at ``version`` after
    ``samples`` trained samples. ``chain``: encoded boundaries (``engine.bench.act_boundary``) whose
    meters hold what crossed since the last point; that is added to ``trained`` first (kind ->
    meter), and the eval's own traffic is dropped after. Progress goes to stderr."""
    for kind, meter in (trained or {}).items():
        for boundary in chain:
            meter.merge(boundary.meters[kind])
    e = trainer.evaluate()
    for boundary in chain:
        boundary.reset_meters()
    point = {"version": version, "samples": samples, "strict": round(e.exact_match, 4),
             "content": None if e.content is None else round(e.content, 4)}
    print(f"    v{version} ({samples} samples): strict {e.exact_match:.3f} content {point['content']}",
          file=sys.stderr, flush=True)
    return point
