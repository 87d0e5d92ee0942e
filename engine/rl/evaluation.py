"""Held-out evaluation: greedy decoding of a task's eval split, exact match and mean reward.

``evaluate_greedy`` scores a digit task through its character codec; ``evaluate_run_task``
scores any ``RunTask`` (digit or chat) with the run task's own ``eval_score`` and ``reward`` —
what the swarm's coordinator records for its evals — so the in-process trainer's evals and the
swarm's are the same figures: strict and, for chat tasks, content-only.

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
from engine.rl.run_task import RunTask
from engine.rl.tasks import Example, Task, is_chat_task_name
from engine.rl.tasks.rewards import exact_match, token_reward


@dataclass(frozen=True)
class EvalResult:
    exact_match: float  #: fraction of examples answered exactly (then EOS); chat tasks: the strict score
    mean_reward: float  #: mean of the task's reward over examples
    num_examples: int
    seconds: float
    content: float | None = None  #: chat tasks: the stated answer's score with tags ignored


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


def evaluate_run_task(pipeline: StagePipeline, task: RunTask, max_new_tokens: int,
                      prompts: Sequence[str] | None = None) -> EvalResult:
    """Greedy completions of the run task's held-out prompt keys (default: all), scored by the task.

    ``content`` is None for digit tasks (there it equals the strict score)."""
    t0 = time.perf_counter()
    keys = list(task.eval_prompts() if prompts is None else prompts)
    completions = greedy_completions(pipeline, [task.prompt_ids(k) for k in keys], max_new_tokens, task.stop_ids)
    scores = [task.eval_score(k, [int(t) for t in c]) for k, c in zip(keys, completions)]
    rewards = [task.reward(k, [int(t) for t in c]) for k, c in zip(keys, completions)]
    chat = is_chat_task_name(task.name)
    return EvalResult(exact_match=float(np.mean([s.strict for s in scores])), mean_reward=float(np.mean(rewards)),
                      num_examples=len(keys), seconds=time.perf_counter() - t0,
                      content=float(np.mean([s.content for s in scores])) if chat else None)
