"""Held-out accuracy of any HF checkpoint directory on a task: what ``polis eval`` measures.

``evaluate_checkpoint`` loads the whole model as one stage through the project's own stage
backends (``engine.rl.pipeline.LocalPipeline``: torch, else MLX), decodes the task's
held-out split greedily (``engine.rl.rollout.greedy_completions``, the decoding the trainer
and the swarm's evals use) and scores the completions from their token ids:

* a digit task (character-level checkpoint, ``engine.rl.codec.TaskCodec``): strict = exact
  match then EOS (``engine.rl.tasks.rewards.exact_match``), plus the mean task reward;
* a chat task (``reasoning_gym:<dataset>``, ``mixture``; a checkpoint with a chat template,
  ``ChatCodec``): every item's prompt goes through the model's chat template, the completion
  is cut at the first stop id and scored by the dataset (``ChatTask.score_tokens``): strict
  (answer in tags), content-only (tags ignored) and well-formed shares.

Why the project's backends rather than ``transformers``: the numbers are then those of the
very decoding the swarm trains and evaluates with (same tokenizer path, same stop rule, same
greedy argmax), and ``polis eval`` works where ``transformers`` is not installed (the
desktop build). A checkpoint whose architecture the backends do not run (qwen3) is refused
with a message. The held-out split is the task's fixed one (``TaskConfig.eval_size``,
independent of any run seed), the same items the training run held out.

What it does not know: where checkpoints come from, runs, tables or JSON output.
"""

from __future__ import annotations

import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from engine.rl.tasks import TaskConfig, is_chat_task_name

#: completion budget of a chat eval when nothing else says (a worked answer then its tags)
DEFAULT_CHAT_TOKENS = 64
#: completion budget of a digit eval: the runs' own 8 (engine.rl.recipe), or the longest answer
#: (an addition's carry digit included) plus EOS; exact match is the same for any budget above that
DIGIT_TOKENS = 8


class EvalError(ValueError):
    """The checkpoint and the task do not fit together (say why and what to do)."""


@dataclass(frozen=True)
class TaskEval:
    """One checkpoint's held-out figures on one task.

    Fields:
      task: the task name (``reversal``, ``reasoning_gym:chain_sum``, ...).
      items: held-out items decoded.
      strict: digit tasks: exact match; chat tasks: the dataset's score of the tagged answer.
      content: chat tasks: the dataset's score of the stated answer, tags ignored (None for digits).
      well_formed: chat tasks: share of well-formed answers (None for digits).
      reward: mean training reward of the greedy completions.
      max_new_tokens: completion budget of each item.
      seconds: wall clock of the decoding and scoring.
      backend: the stage backend that decoded (``torch`` / ``mlx``).
    """

    task: str
    items: int
    strict: float
    content: float | None
    well_formed: float | None
    reward: float
    max_new_tokens: int
    seconds: float
    backend: str

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


def default_max_new_tokens(task: TaskConfig) -> int:
    return DEFAULT_CHAT_TOKENS if is_chat_task_name(task.name) else max(DIGIT_TOKENS, task.max_digits + 2)


def evaluate_checkpoint(checkpoint_dir: str | Path, task: TaskConfig, *, n: int | None = None,
                        max_new_tokens: int | None = None, backend: str = "auto",
                        device: str | None = None) -> TaskEval:
    """Greedy held-out figures of ``checkpoint_dir`` on ``task`` (the first ``n`` items of its split)."""
    from engine.rl.codec import ChatCodec, TaskCodec, load_codec
    from engine.rl.pipeline import LocalPipeline

    checkpoint_dir = Path(checkpoint_dir)
    codec = load_codec(checkpoint_dir)
    chat = is_chat_task_name(task.name)
    if chat and not isinstance(codec, ChatCodec):
        raise EvalError(f"{checkpoint_dir}: a character-level checkpoint cannot do the chat task {task.name}; "
                        "evaluate it on a digit task (reversal, sorting, addition)")
    if not chat and not isinstance(codec, TaskCodec):
        raise EvalError(f"{checkpoint_dir}: a BPE checkpoint does not speak the character-level digit task "
                        f"{task.name}; evaluate it on a chat task, e.g. --task reasoning_gym:chain_sum")
    budget = max_new_tokens or default_max_new_tokens(task)
    pipeline = LocalPipeline.from_checkpoint(checkpoint_dir, 1, backend, device)
    try:
        started = time.perf_counter()
        if chat:
            figures = _chat_figures(pipeline, codec, task, n, budget)
        else:
            figures = _digit_figures(pipeline, codec, task, n, budget)
        return TaskEval(task=task.name, max_new_tokens=budget, seconds=round(time.perf_counter() - started, 3),
                        backend=pipeline.backends[0].name, **figures)
    finally:
        pipeline.close()


def _digit_figures(pipeline, codec, task_config: TaskConfig, n: int | None, budget: int) -> dict[str, Any]:
    from engine.rl.evaluation import evaluate_greedy
    from engine.rl.tasks import make_task

    task = make_task(task_config)
    examples = list(task.eval_split())[:n]
    result = evaluate_greedy(pipeline, codec, task, budget, examples)
    return {"items": result.num_examples, "strict": result.exact_match, "content": None, "well_formed": None,
            "reward": result.mean_reward}


def _chat_figures(pipeline, codec, task_config: TaskConfig, n: int | None, budget: int) -> dict[str, Any]:
    from engine.rl.rollout import greedy_completions
    from engine.rl.tasks import make_chat_task, summarise

    task = make_chat_task(task_config)
    items = task.eval_items()[:n]
    prompts = [codec.encode_messages(item.prompt.as_dicts()) for item in items]
    completions = greedy_completions(pipeline, prompts, budget, codec.eos_id)
    summary = summarise(items, [task.score_tokens(item, [int(t) for t in ids], codec)
                                for item, ids in zip(items, completions)])
    return {"items": summary.items, "strict": summary.strict, "content": summary.content,
            "well_formed": summary.well_formed, "reward": summary.reward}
