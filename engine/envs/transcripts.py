"""Correct tool-use transcripts of an environment's own training episodes, for a supervised warm-up.

For a training item of a calculator environment (``engine.envs.tool_env``), the episode is run
through the environment itself with the policy a good model would follow: first turn, one
calculator call on the question's expression (in the environment's own call format); second
turn, the tool's observation given back inside ``<answer></answer>`` tags. The environment
answers the call (its calculator computes the result) and scores the episode; a transcript is
kept only when the environment scores it as a right answer reached with a working tool call and
no limit cut it, so nothing here decides what is correct. Held-out items are refused: a
warm-up must never see the split its evaluation uses.

The expression of a question is the text after its last ``:`` with a trailing ``=`` dropped
(``State the final answer to the following arithmetic problem: 12 + 34 =`` -> ``12 + 34``), the
shape of the reasoning-gym arithmetic questions and of the worked example; an item whose
question does not yield a working call is skipped (counted by the caller).

What it does not know: tokens, templates, models, training (``engine.rl.tool_warmup`` renders
and trains on these).
"""

from __future__ import annotations

from itertools import islice

from engine.envs.contract import EpisodeItem, EpisodeLimits, EpisodeResult, Message, run_episode
from engine.envs.tool_env import ToolEnvironment
from engine.envs.tools import format_tool_call


def arithmetic_expression(question: str) -> str:
    """The expression an arithmetic question asks about (see the module docstring)."""
    text = question.rsplit(":", 1)[-1].strip()
    return text[:-1].strip() if text.endswith("=") else text


def _calculator_name(env: ToolEnvironment) -> str:
    for name, tool in env.tools.items():
        if "expression" in tool.parameters:
            return name
    raise ValueError(f"the {env.name} environment has no tool that takes an expression")


def tool_transcript(env: ToolEnvironment, item: EpisodeItem,
                    limits: EpisodeLimits | None = None) -> EpisodeResult | None:
    """The environment's episode of ``item`` under the correct calculator policy, or ``None`` when the
    environment does not score it as solved with a working call (see the module docstring)."""
    if item.held_out:
        raise ValueError(f"{item.item_id} is a held-out item; transcripts come from training items only")
    tool = _calculator_name(env)
    call = format_tool_call(tool, {"expression": arithmetic_expression(item.messages[-1].content)})

    def policy(messages) -> str:
        last: Message = messages[-1]
        return f"<answer>{last.content}</answer>" if last.role == "tool" else call

    result = run_episode(env, item, policy, limits)
    solved = result.parts.get("answer", 0.0) > 0.0 and result.tool_calls >= 1 and result.tool_errors == 0
    return result if solved and not result.cuts else None


def tool_transcripts(env: ToolEnvironment, seed: int, count: int, *, limits: EpisodeLimits | None = None,
                     max_items: int | None = None) -> tuple[list[tuple[EpisodeItem, EpisodeResult]], int]:
    """Up to ``count`` correct transcripts from the training stream of ``seed``, in stream order,
    looking at ``max_items`` items at most (default ``4 * count``); and how many items were skipped."""
    made: list[tuple[EpisodeItem, EpisodeResult]] = []
    skipped = 0
    for item in islice(env.train_items(seed), max_items if max_items is not None else 4 * count):
        if len(made) >= count:
            break
        result = tool_transcript(env, item, limits)
        if result is None:
            skipped += 1
        else:
            made.append((item, result))
    return made, skipped
