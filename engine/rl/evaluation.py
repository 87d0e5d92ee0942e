"""Held-out evaluation: greedy decoding of a task's eval split, exact match and mean reward.

What it does not know: training, staleness, transports (it only decodes through a
``StagePipeline``).
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Sequence

import numpy as np

from engine.rl.codec import TaskCodec
from engine.rl.pipeline import StagePipeline
from engine.rl.rollout import greedy_completions
from engine.rl.tasks import Example, Task
from engine.rl.tasks.rewards import exact_match, token_reward


@dataclass(frozen=True)
class EvalResult:
    exact_match: float  #: fraction of examples answered exactly (then EOS)
    mean_reward: float  #: mean of the task's reward over examples
    num_examples: int
    seconds: float


def evaluate_greedy(pipeline: StagePipeline, codec: TaskCodec, task: Task, max_new_tokens: int,
                    examples: Sequence[Example] | None = None) -> EvalResult:
    """Greedy completions of ``examples`` (default: the task's held-out split), scored from tokens."""
    t0 = time.perf_counter()
    examples = list(task.eval_split() if examples is None else examples)
    completions = greedy_completions(pipeline, [codec.encode_prompt(e.prompt) for e in examples],
                                     max_new_tokens, codec.eos_id)
    exact = [exact_match(task, e.prompt, c, codec) for e, c in zip(examples, completions)]
    rewards = [token_reward(task, e.prompt, c, codec) for e, c in zip(examples, completions)]
    return EvalResult(exact_match=float(np.mean(exact)), mean_reward=float(np.mean(rewards)),
                      num_examples=len(examples), seconds=time.perf_counter() - t0)
