"""The settings of one swarm training run, shared by the coordinator and its nodes.

The coordinator owns the run: it builds a :class:`RunConfig` (from flags or its
database), hands it to every node in the ``welcome`` message as a plain dict, and
nodes rebuild it with :func:`run_config_from_dict`, which validates every field
(the dict crossed a network). The RL pieces reuse the in-process configs of
``engine.rl`` so the swarm runs the very same objective, sampling and tasks.

The defaults are the tested recipe of ``engine.rl.recipe`` (the task the shipped base
was warmed up on, its sampling and batch settings), so the swarm and the
in-process trainer learn the same thing the same way. It knows nothing about
sockets or tensors.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field, fields
from typing import Any, Mapping

from engine.rl.objective import ObjectiveConfig
from engine.rl.recipe import BASE_TASK
from engine.rl.rollout import SamplingConfig
from engine.rl.tasks import TaskConfig

#: activation encodings a run may choose (engine.net.tensor_codec names)
ACTIVATION_ENCODINGS = ("fp32", "fp16", "bf16", "int8_rowwise")
#: how replicas exchange gradients (engine.swarm.replica_sync; kept here so configs need no numpy)
UPDATE_ENCODINGS = ("int8", "topk", "fp32")


@dataclass(frozen=True)
class RunConfig:
    """One RL run across the swarm.

    Fields:
      task: which verifiable task, its difficulty and reward.
      objective: decoupled-PPO hyper-parameters (engine.rl.objective).
      sampling: temperature / top-p / completion budget for rollouts.
      group_size: samples per prompt (G).
      prompts_per_step: prompt groups consumed by one optimiser step.
      micro_batch_rows: most sequences in one training micro-batch through the pipeline.
      updates_per_batch: optimiser steps per batch (its rows split into this many mini-batches);
        with more than one, a forward-only pass first records the proximal log-probs of every
        row under the weights at the start of the batch (decoupled PPO's anchor).
      max_staleness: rollouts more than this many versions behind are dropped.
      lr: AdamW learning rate on every stage.
      max_grad_norm: per-stage gradient-norm clip after replica aggregation (0 = off).
      activation_encoding: how activations and their gradients travel between stages.
      update_encoding: how replicas exchange gradients, with error feedback: "int8" (every
        entry, per-row scales: ~1/4 of fp32), "topk" (the update_topk_fraction largest
        entries, int8 values: a few % of fp32) or "fp32" (dense, lossless). Measured
        (polis bench swarm, 2 x 2 swarm, equal versions): top-k at 2 % and 10 % learned
        25-30 points slower than the in-process trainer at 480 versions, int8 and fp32 kept
        pace, so int8 is the default and top-k is for links too slow for it.
      update_topk_fraction: share of gradient entries sent each step with "topk".
      prompts_per_job: prompts of one token length decoded together in one generation job
        (prompts_per_job x group_size rows share a KV cache; more rows amortise per-step latency).
      generations_in_flight: generation jobs kept in flight per pipeline route (the replay
        buffer's cap of two batches still bounds how much is generated ahead). Measured on 2
        cores: 3 -> 8 raised the demo from 672 to 796 versions in 8 minutes.
      eval_every_versions: greedy held-out eval every this many versions (0 = start/end only).
      checkpoint_every_versions: stage leaders write a stage checkpoint this often.
      max_versions: the run stops training after this version (0 = never).
      seed: seeds the coordinator's prompt stream and the nodes' samplers.
    """

    task: TaskConfig = field(default_factory=lambda: BASE_TASK)
    objective: ObjectiveConfig = field(default_factory=lambda: ObjectiveConfig(scale_by_std=True))
    sampling: SamplingConfig = field(default_factory=lambda: SamplingConfig(temperature=0.7, max_new_tokens=8))
    group_size: int = 16
    prompts_per_step: int = 32
    micro_batch_rows: int = 128
    updates_per_batch: int = 4
    max_staleness: int = 4
    lr: float = 3e-4  # measured in the swarm demo (12.5% -> 100% in 483 s); the in-process recipe uses 2.5e-4
    max_grad_norm: float = 1.0
    activation_encoding: str = "int8_rowwise"
    update_encoding: str = "int8"
    update_topk_fraction: float = 0.02
    prompts_per_job: int = 8
    generations_in_flight: int = 8  # two WebRTC hops per token need several jobs to keep both stages busy
    eval_every_versions: int = 20
    checkpoint_every_versions: int = 5
    max_versions: int = 0
    seed: int = 0

    def __post_init__(self) -> None:
        checks = [
            (2 <= self.group_size <= 256, "group_size must be in [2, 256]"),
            (1 <= self.prompts_per_step <= 4096, "prompts_per_step must be in [1, 4096]"),
            (1 <= self.micro_batch_rows <= 4096, "micro_batch_rows must be in [1, 4096]"),
            (1 <= self.updates_per_batch <= 64, "updates_per_batch must be in [1, 64]"),
            (0 <= self.max_staleness <= 1000, "max_staleness must be in [0, 1000]"),
            (0.0 < self.lr < 1.0, "lr must be in (0, 1)"),
            (0.0 <= self.max_grad_norm < 1e6, "max_grad_norm must be in [0, 1e6)"),
            (self.activation_encoding in ACTIVATION_ENCODINGS,
             f"activation_encoding must be one of {ACTIVATION_ENCODINGS}"),
            (self.update_encoding in UPDATE_ENCODINGS, f"update_encoding must be one of {UPDATE_ENCODINGS}"),
            (0.0 < self.update_topk_fraction <= 1.0, "update_topk_fraction must be in (0, 1]"),
            (1 <= self.generations_in_flight <= 64, "generations_in_flight must be in [1, 64]"),
            (1 <= self.prompts_per_job <= 256, "prompts_per_job must be in [1, 256]"),
            (0 <= self.eval_every_versions <= 100000, "eval_every_versions must be >= 0"),
            (1 <= self.checkpoint_every_versions <= 100000, "checkpoint_every_versions must be >= 1"),
            (0 <= self.max_versions <= 10**9, "max_versions must be >= 0"),
        ]
        for ok, message in checks:
            if not ok:
                raise ValueError(message)

    def to_dict(self) -> dict[str, Any]:
        out = asdict(self)
        out["task"]["reward"] = self.task.reward.value
        return out


def _build(cls, data: Any, what: str):
    if not isinstance(data, Mapping):
        raise ValueError(f"{what} must be an object")
    known = {f.name for f in fields(cls)}
    unknown = set(data) - known
    if unknown:
        raise ValueError(f"{what}: unknown fields {sorted(unknown)}")
    try:
        return cls(**data)
    except TypeError as exc:
        raise ValueError(f"{what}: {exc}") from None


def run_config_from_dict(data: Any) -> RunConfig:
    """Rebuild and validate a RunConfig that crossed the network (raises ValueError)."""
    if not isinstance(data, Mapping):
        raise ValueError("run config must be an object")
    data = dict(data)
    nested = {"task": TaskConfig, "objective": ObjectiveConfig, "sampling": SamplingConfig}
    for name, cls in nested.items():
        if name in data:
            data[name] = _build(cls, data[name], name)
    return _build(RunConfig, data, "run")


def apply_overrides(config: RunConfig, assignments: list[str]) -> RunConfig:
    """``["lr=0.001", "task.max_digits=5", "objective.decoupled=false"]`` applied to ``config`` (validated)."""
    data = config.to_dict()
    for item in assignments:
        key, sep, raw = item.partition("=")
        if not sep:
            raise ValueError(f"expected KEY=VALUE, got {item!r}")
        target = data
        parts = key.strip().split(".")
        for part in parts[:-1]:
            if not isinstance(target.get(part), dict):
                raise ValueError(f"unknown setting {key!r}")
            target = target[part]
        if parts[-1] not in target:
            raise ValueError(f"unknown setting {key!r}")
        old = target[parts[-1]]
        raw = raw.strip()
        if isinstance(old, bool):
            if raw.lower() not in ("true", "false", "1", "0"):
                raise ValueError(f"{key} must be true or false")
            value: Any = raw.lower() in ("true", "1")
        elif isinstance(old, int):
            value = int(raw)
        elif isinstance(old, float):
            value = float(raw)
        else:
            value = raw
        target[parts[-1]] = value
    return run_config_from_dict(data)
