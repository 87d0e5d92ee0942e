"""What one RL step and one held-out eval recorded: the trainer's logs, also saved with a run.

``engine.rl.trainer`` fills them; ``engine.rl.run_state`` writes and reads them back. Plain
dataclasses, no behaviour. What it does not know: how the figures were computed.
"""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass
class StepLog:
    """What one trainer step did (all fractions in [0, 1])."""

    step: int
    versions: tuple[int, ...]  #: after the step
    trained: bool  #: an optimiser step happened
    reward_mean: float = 0.0
    exact_fraction: float = 0.0  #: train samples that were exactly right
    finished_fraction: float = 0.0  #: samples that emitted EOS
    completion_tokens_mean: float = 0.0
    groups: int = 0  #: groups that came out of the queue
    trained_samples: int = 0  #: samples (rows) the optimiser steps of this step were computed on
    zero_variance_fraction: float = 0.0  #: of the non-stale groups
    dropped_stale: int = 0
    staleness_histogram: dict[int, int] = field(default_factory=dict)
    masked_fraction: float = 0.0
    clipped_fraction: float = 0.0
    ess: float = 1.0
    mean_weight: float = 1.0
    kl: float = 0.0
    entropy_proxy: float = 0.0  #: mean -log b over sampled tokens (an entropy estimate)
    loss: float = 0.0
    grad_norm: float = 0.0  #: L2 norm over all stages before clipping (each stage is clipped on its own)
    generate_s: float = 0.0
    train_s: float = 0.0


@dataclass
class EvalLog:
    step: int
    versions: tuple[int, ...]
    exact_match: float  #: greedy held-out strict score (digit tasks: exact match; chat tasks: answer in tags)
    mean_reward: float  #: greedy reward (the task's reward kind) on the held-out split
    seconds: float
    content: float | None = None  #: chat tasks: the stated answer's score, tags ignored (digit tasks: None)
