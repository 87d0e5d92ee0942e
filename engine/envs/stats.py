"""Figures of a batch of finished episodes, for logs, evals and a shortcut monitor.

A tool-call loop shows as a rising ``cut_share["turns"]`` and ``mean_tool_calls``; a run-on turn
as ``cut_share["unfinished_turn"]``; a reward won by format alone as ``mean_parts["format"]``
close to ``mean_reward``.

What it does not know: what the episodes were about, models, tokens.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Mapping, Sequence

from engine.envs.contract import CutKind, EpisodeResult


@dataclass(frozen=True)
class EpisodeStats:
    """Means over episodes.

    Fields:
      episodes: how many.
      mean_reward: mean paid reward (cut episodes count as 0).
      mean_parts: mean of each named part (as the environment scored it, cut or not).
      mean_turns / mean_tool_calls / mean_tool_s: per episode.
      tool_error_share: tool calls that answered with an error / all tool calls (0 if none).
      cut_share: share of episodes cut, per limit (every ``CutKind``, 0.0 if none).
    """

    episodes: int
    mean_reward: float
    mean_parts: Mapping[str, float]
    mean_turns: float
    mean_tool_calls: float
    mean_tool_s: float
    tool_error_share: float
    cut_share: Mapping[str, float]


def summarise_episodes(results: Sequence[EpisodeResult]) -> EpisodeStats:
    n = max(len(results), 1)
    names = sorted({k for r in results for k in r.parts})
    calls = sum(r.tool_calls for r in results)
    return EpisodeStats(
        episodes=len(results),
        mean_reward=sum(r.reward for r in results) / n,
        mean_parts={k: sum(r.parts.get(k, 0.0) for r in results) / n for k in names},
        mean_turns=sum(r.turns for r in results) / n,
        mean_tool_calls=calls / n,
        mean_tool_s=sum(r.tool_s for r in results) / n,
        tool_error_share=sum(r.tool_errors for r in results) / calls if calls else 0.0,
        cut_share={kind.value: sum(1 for r in results if any(c.kind is kind for c in r.cuts)) / n
                   for kind in CutKind})
