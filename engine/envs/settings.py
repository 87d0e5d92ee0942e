"""The environment settings of a run: which environment episodes run in, and its limits.

A frozen, validated dataclass that ``engine.swarm.run_config.RunConfig`` embeds as ``env`` and
``engine.rl.run_task.make_run_task`` reads. What it does not know: the environments themselves
(``engine.envs.registry``), tokens, the swarm.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Annotated, Literal

from msgspec import Meta


@dataclass(frozen=True)
class EnvSettings:
    """The environment episodes run in (``engine.envs``), or none: the task alone, one turn each.

    Fields:
      name: ``""`` (the task's single-turn episodes) or ``calculator`` (the chat task's questions
        with a calculator tool, ``engine.envs.tool_env``; needs a chat task).
      max_turns: model turns per episode (a tool-call loop is cut there).
      max_context_tokens: tokens of an episode's whole context (prompt, turns, observations).
      max_tool_s: seconds of tool time per episode.
      tool_use_weight: the reward part paid for a right answer reached with a working tool call.
    """

    name: Literal["", "calculator"] = ""
    max_turns: Annotated[int, Meta(ge=1, le=64)] = 4
    max_context_tokens: Annotated[int, Meta(ge=16, le=1 << 20)] = 1024
    max_tool_s: Annotated[float, Meta(gt=0.0, le=3600.0)] = 10.0
    tool_use_weight: Annotated[float, Meta(ge=0.0, le=0.5)] = 0.05
