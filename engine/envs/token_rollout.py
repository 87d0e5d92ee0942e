"""Drive one episode at the token level: generate, decode, step the environment, extend the context.

The generator sees one growing context: the rendered prompt, then for every turn its own
sampled ids (kept verbatim) followed by the template's tail and the observation with the next
generation prompt. Each call's context is the previous call's context plus the ids added since,
so a generator that keeps its KV cache per episode only prefills the new observation tokens.
The result carries the trajectory (ids + loss mask: only sampled ids are trained) and the
behaviour log-probs aligned with it (0.0 on context tokens, which never enter a ratio).

What it does not know: how generation runs (one process or a pipeline; ``Generate`` is the
seam), tokenizers and templates (inside ``ChatRenderer``), advantages.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Sequence

from engine.envs.contract import Environment, EpisodeItem, EpisodeLimits, EpisodeResult, Message
from engine.envs.trajectory import ChatRenderer, Trajectory, TrajectoryBuilder


@dataclass(frozen=True)
class Generation:
    """One model turn as sampled.

    Fields:
      ids: the sampled token ids, the end-of-turn token included if it was sampled.
      logprobs: the behaviour log-prob of each sampled id (same length).
      finished: whether it ended with the end-of-turn token (False: the token budget ran out).
    """

    ids: tuple[int, ...]
    logprobs: tuple[float, ...]
    finished: bool

    def __post_init__(self) -> None:
        if len(self.ids) != len(self.logprobs):
            raise ValueError("ids and logprobs differ in length")


#: (context ids, max new tokens) -> the sampled turn
Generate = Callable[[Sequence[int], int], Generation]
#: ids -> text (special tokens kept), to hand the model's turn to the environment
Decode = Callable[[Sequence[int]], str]


@dataclass(frozen=True)
class TokenEpisode:
    """A finished episode with its trajectory and behaviour log-probs (aligned with ``trajectory.ids``)."""

    result: EpisodeResult
    trajectory: Trajectory
    logprobs: tuple[float, ...]


def run_token_episode(env: Environment, item: EpisodeItem, renderer: ChatRenderer, generate: Generate,
                      decode: Decode, *, limits: EpisodeLimits | None = None,
                      max_new_tokens: int = 256) -> TokenEpisode:
    """Run ``item`` to its end with ``generate``; every limit is the episode's (see ``contract``)."""
    limits = limits or EpisodeLimits()
    episode = env.start(item, limits)
    builder = TrajectoryBuilder()
    logprobs: list[float] = []

    def add_context(text: str) -> None:
        ids = renderer.encode(text)
        builder.add_context(ids)
        logprobs.extend([0.0] * len(ids))

    add_context(renderer.prompt_text(episode.messages))
    while True:
        before = episode.messages
        room = limits.max_context_tokens - len(builder.context_ids)
        if room <= 0:
            return TokenEpisode(episode.cut_context(len(builder.context_ids)), builder.build(), tuple(logprobs))
        gen = generate(builder.context_ids, min(max_new_tokens, room))
        builder.add_model(gen.ids)
        logprobs.extend(gen.logprobs)
        text = decode(gen.ids)
        if gen.finished and text.endswith(renderer.end_of_turn):
            text = text[: -len(renderer.end_of_turn)]
        step = episode.step(text, context_tokens=len(builder.context_ids), finished=gen.finished)
        if step.result is not None:
            if gen.finished:  # the template's tail of the last turn: context, for an exact transcript
                add_context(renderer.after_turn_text(before, Message("assistant", text), (), False))
            return TokenEpisode(step.result, builder.build(), tuple(logprobs))
        assert step.observation is not None
        add_context(renderer.after_turn_text(before, Message("assistant", text), (step.observation,), True))
