"""Scoring of decoded text against a known answer: exact match and partial credit.

Pure functions over strings; a task calls ``text_reward`` with the answer it knows. Empty or
over-long completions score 0.

What it does not know: tokens (``engine.rl.tasks.rewards`` turns token ids into text first),
tasks, models.
"""

from __future__ import annotations

from enum import Enum


class RewardKind(str, Enum):
    """How a well-formed completion is scored against the correct answer."""

    EXACT = "exact"  #: 1.0 if equal, else 0.0
    PER_POSITION = "per_position"  #: matching positions / max(len(answer), len(completion))
    LCS = "lcs"  #: 2 * longest-common-subsequence / (len(answer) + len(completion))


def lcs_length(a: str, b: str) -> int:
    """Length of the longest common subsequence (O(len(a) * len(b)))."""
    if not a or not b:
        return 0
    prev = [0] * (len(b) + 1)
    for ca in a:
        cur = [0]
        for j, cb in enumerate(b):
            cur.append(prev[j] + 1 if ca == cb else max(prev[j + 1], cur[j]))
        prev = cur
    return prev[-1]


def text_reward(answer: str, completion: str, kind: RewardKind, *, max_chars: int) -> float:
    """Score ``completion`` against ``answer``. Empty or over-long completions score 0."""
    if not completion or len(completion) > max(max_chars, len(answer)):
        return 0.0
    if kind is RewardKind.EXACT:
        return float(completion == answer)
    if kind is RewardKind.PER_POSITION:
        hits = sum(1 for x, y in zip(answer, completion) if x == y)
        return hits / max(len(answer), len(completion))
    if kind is RewardKind.LCS:
        return 2.0 * lcs_length(answer, completion) / (len(answer) + len(completion))
    raise ValueError(f"unknown reward kind {kind!r}")
