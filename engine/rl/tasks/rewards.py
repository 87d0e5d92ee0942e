"""Rewards from tokens for the character-level tasks; malformed completions score 0.

``token_reward`` is what a coordinator calls: it takes the completion token ids exactly as
sampled (possibly empty, unfinished, out of vocabulary) and returns a float in [0, 1]
without raising. A completion earns credit only if it ends with EOS within the token
budget and contains nothing but answer characters.

Text scoring itself is ``engine.rl.tasks.scoring``.

What it does not know: how tokens were produced, models, advantages.
"""

from __future__ import annotations

from typing import Sequence

from engine.rl.codec import TaskCodec
from engine.rl.tasks.base import Task


def completion_text(codec: TaskCodec, completion_ids: Sequence[int], allowed: str) -> str | None:
    """The text before EOS, or ``None`` if there is no EOS or a token is not an allowed char."""
    ids = [int(i) for i in completion_ids]
    if codec.eos_id not in ids:
        return None
    text = codec.decode_strict(ids[: ids.index(codec.eos_id)])
    if text is None or any(ch not in allowed for ch in text):
        return None
    return text


def token_reward(task: Task, prompt: str, completion_ids: Sequence[int], codec: TaskCodec) -> float:
    """Reward of one sampled completion. Never raises on any completion."""
    try:
        text = completion_text(codec, completion_ids, task.alphabet)
    except (TypeError, ValueError, OverflowError):
        return 0.0
    if text is None:
        return 0.0
    return task.reward_text(prompt, text)


def exact_match(task: Task, prompt: str, completion_ids: Sequence[int], codec: TaskCodec) -> bool:
    """Whether the completion is exactly the answer followed by EOS (for evals)."""
    try:
        text = completion_text(codec, completion_ids, task.alphabet)
        return text is not None and text == task.solve(prompt)
    except (TypeError, ValueError, OverflowError):
        return False
