"""The one RL update planner: from scored groups to the mini-batches of optimiser steps.

The in-process ``Trainer`` (``engine.rl.trainer``) and the swarm's ``StepRunner``
(``engine.swarm.step_runner``) both call :func:`plan_update` on the groups of one batch and
:func:`clip_scale` on each stage's gradient norm, so the same rollouts give the same
mini-batches, advantages and (through ``engine.rl.objective``) the same per-token gradients
on both paths. The rules, in the order they apply:

1. **Staleness.** A group's staleness is how many optimiser steps the trainer is ahead of the
   oldest policy that produced any of its tokens, per stage, maximised over stages
   (``engine.rl.staleness``). Groups staler than ``max_staleness`` are dropped and counted;
   the staleness histogram counts every group seen, the dropped ones included, in groups.
2. **Advantages.** Group-relative: ``r - mean(r)``, divided by ``std + objective.std_eps``
   when ``objective.scale_by_std`` (``engine.rl.objective.group_advantages``).
3. **Zero variance.** A group whose rewards are all equal carries no signal: it is skipped and
   counted (``zero_variance``), never trained on.
4. **Mini-batches by whole groups.** The informative groups, in the order given, are cut into
   ``min(updates_per_batch, groups)`` contiguous chunks of whole groups — at most one update
   per informative group, so a tiny batch is never split into a few rows per optimiser step,
   and every update sees complete groups (a group's advantages sum to zero within its
   mini-batch). Each chunk becomes one ``TrainBatch`` (rows sorted longest first).
5. **Clipping: per stage.** Each stage's gradient is clipped to L2 norm ``max_grad_norm`` on
   its own (:func:`clip_scale` of that stage's norm). A pipeline cannot know the global norm
   without one more cross-stage round trip per optimiser step (an internet RTT between the
   last backward and the step), and per-stage clipping means one buggy or hostile stage
   with a huge gradient cannot shrink the updates of the other stages. The in-process
   trainer follows the same rule so its figures predict the swarm's. One exception: the
   first and the last stage of a model with tied embeddings hold two copies of one matrix,
   so they clip as one unit (norm over both stages, the tied tensor counted once) and step
   with one scale; those two stages exchange the tied gradient each step anyway.

What it does not know: models, transports, where groups come from (a lagged queue or a
replay buffer), rewards' meaning.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Sequence

import numpy as np

from engine.rl.batch import TrainBatch, build_batch
from engine.rl.objective import ObjectiveConfig, group_advantages
from engine.rl.rollout import Group
from engine.rl.staleness import group_staleness, histogram


@dataclass(frozen=True)
class UpdateRules:
    """The settings the planner applies. Validated on construction.

    Fields:
      objective: its ``scale_by_std`` and ``std_eps`` shape the advantages.
      max_staleness: groups more than this many versions behind the trainer are dropped.
      updates_per_batch: optimiser steps per batch at most (never more than its informative groups).
      max_grad_norm: per-stage L2 clip of the gradient (0 disables clipping).
      pack_groups: each group trains as one packed row, its prompt computed once for its G samples
        (``engine.rl.batch``); False: one plain row per sample.
    """

    objective: ObjectiveConfig = field(default_factory=ObjectiveConfig)
    max_staleness: int = 4
    updates_per_batch: int = 1
    max_grad_norm: float = 1.0
    pack_groups: bool = True

    def __post_init__(self) -> None:
        if self.max_staleness < 0:
            raise ValueError(f"max_staleness must be >= 0, got {self.max_staleness}")
        if self.updates_per_batch < 1:
            raise ValueError(f"updates_per_batch must be >= 1, got {self.updates_per_batch}")
        if not 0.0 <= self.max_grad_norm < math.inf:
            raise ValueError(f"max_grad_norm must be finite and >= 0, got {self.max_grad_norm}")

    def advantages(self, rewards: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """``(advantages [groups, G], keep [groups])`` of rewards ``[groups, G]`` (rules 2 and 3)."""
        return group_advantages(rewards, scale_by_std=self.objective.scale_by_std, eps=self.objective.std_eps)

    def oldest_fresh_version(self, trainer_version: int) -> int:
        """The oldest policy version a rollout may come from to be trained at ``trainer_version``."""
        return int(trainer_version) - self.max_staleness

    def stage_clip_scales(self, stage_sq_norms: Sequence[float],
                          units: Sequence[Sequence[int]] | None = None) -> list[float]:
        """One gradient scale per stage (rule 5): each clipping unit (by default each stage alone;
        stages sharing a tied tensor form one, see ``StagePipeline.clip_units``) is clipped on the
        norm of all its stages' gradients, and every stage of the unit takes that unit's scale."""
        units = [(i,) for i in range(len(stage_sq_norms))] if units is None else units
        scales = [1.0] * len(stage_sq_norms)
        for unit in units:
            norm = math.sqrt(sum(max(float(stage_sq_norms[i]), 0.0) for i in unit))
            for i in unit:
                scales[i] = clip_scale(norm, self.max_grad_norm)
        return scales


def clip_scale(norm: float, max_grad_norm: float) -> float:
    """The factor that brings a gradient of L2 norm ``norm`` within ``max_grad_norm`` (0 = no clip)."""
    if not math.isfinite(norm):
        raise ValueError(f"gradient norm must be finite, got {norm!r}")
    if max_grad_norm > 0 and norm > max_grad_norm:
        return max_grad_norm / (norm + 1e-12)
    return 1.0


@dataclass
class UpdatePlan:
    """What to train on from one batch of groups, and the books of what was left out.

    Group indices refer to the ``groups`` given to :func:`plan_update`.
    """

    minibatches: list[TrainBatch]  #: one optimiser step each, in order
    minibatch_groups: list[list[int]]  #: the groups of each mini-batch
    advantages: dict[int, np.ndarray]  #: per trained group, its G advantages (float64)
    staleness: list[int]  #: of every group seen, in input order
    stale: list[int]  #: groups dropped as staler than max_staleness
    zero_variance: list[int]  #: fresh groups skipped for equal rewards

    @property
    def trained(self) -> list[int]:
        return [g for groups in self.minibatch_groups for g in groups]

    @property
    def staleness_histogram(self) -> dict[int, int]:
        return histogram(self.staleness)

    @property
    def dropped_stale(self) -> int:
        return len(self.stale)

    @property
    def zero_variance_fraction(self) -> float:
        """Of the fresh (non-stale) groups; 0 when none was fresh."""
        fresh = len(self.staleness) - len(self.stale)
        return len(self.zero_variance) / fresh if fresh else 0.0

    @property
    def trained_rows(self) -> int:
        return sum(b.num_rows for b in self.minibatches)


def plan_update(groups: Sequence[Group], trainer_versions: Sequence[int], rules: UpdateRules, pad_id: int, *,
                shuffle_rng: np.random.Generator | None = None,
                packable: Sequence[bool] | None = None) -> UpdatePlan:
    """Apply rules 1-4 to one batch of scored groups (all of the same group size).

    ``trainer_versions``: the trainer's version per stage at the start of the batch.
    ``shuffle_rng``: the negative control — permute the fresh groups' rewards across the batch
    before the advantages (None in real runs). ``packable``: per group, whether it may be packed
    when ``rules.pack_groups`` (the swarm packs only groups whose samples one node generated, so
    that a row has one generator for the log-prob audit); None: every group.
    """
    staleness = [group_staleness(g, trainer_versions) for g in groups]
    stale = [i for i, s in enumerate(staleness) if s > rules.max_staleness]
    fresh = [i for i, s in enumerate(staleness) if s <= rules.max_staleness]
    plan = UpdatePlan(minibatches=[], minibatch_groups=[], advantages={}, staleness=staleness, stale=stale,
                      zero_variance=[])
    if not fresh:
        return plan
    rewards = np.stack([groups[i].rewards() for i in fresh])
    if shuffle_rng is not None:
        rewards = shuffle_rng.permutation(rewards.ravel()).reshape(rewards.shape)
    adv, keep = rules.advantages(rewards)
    plan.zero_variance = [i for i, k in zip(fresh, keep) if not k]
    kept = [(i, a) for i, a, k in zip(fresh, adv, keep) if k]
    if not kept:
        return plan
    for chunk in np.array_split(np.arange(len(kept)), min(rules.updates_per_batch, len(kept))):
        members = [kept[j] for j in chunk]
        plan.minibatch_groups.append([i for i, _ in members])
        plan.minibatches.append(build_batch([groups[i] for i, _ in members], [a for _, a in members], pad_id,
                                            trainer_versions,
                                            [rules.pack_groups and (packable is None or packable[i])
                                             for i, _ in members]))
    plan.advantages = dict(kept)
    return plan
