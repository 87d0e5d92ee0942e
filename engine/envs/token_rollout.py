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


class TokenEpisodeRun:
    """One episode at the token level, stepped by whoever generates (in process or a swarm's driver).

    ``context_ids`` is what the next model turn generates after; ``budget`` how many tokens it may
    take (0: the context is full, call ``cut_full``); ``step(gen)`` takes the sampled turn and
    returns the ids appended as context after it (template tail, observation, next generation
    prompt), or ``None`` when the episode ended (``outcome`` then holds it). ``prompt_len`` is the
    length of the rendered opening (the rest of ``trajectory`` is the episode's completion).
    """

    def __init__(self, env: Environment, item: EpisodeItem, renderer: ChatRenderer,
                 limits: EpisodeLimits | None = None, *, max_new_tokens: int = 256) -> None:
        self.limits = limits or EpisodeLimits()
        self.renderer = renderer
        self.max_new_tokens = max_new_tokens
        self.episode = env.start(item, self.limits)
        self._builder = TrajectoryBuilder()
        self._logprobs: list[float] = []
        self._outcome: TokenEpisode | None = None
        self._add_context(renderer.prompt_text(self.episode.messages))
        self.prompt_len = len(self._builder.context_ids)

    def _add_context(self, text: str) -> tuple[int, ...]:
        ids = tuple(self.renderer.encode(text))
        self._builder.add_context(ids)
        self._logprobs.extend([0.0] * len(ids))
        return ids

    @property
    def context_ids(self) -> tuple[int, ...]:
        return self._builder.context_ids

    @property
    def budget(self) -> int:
        room = self.limits.max_context_tokens - len(self._builder.context_ids)
        return max(0, min(self.max_new_tokens, room))

    @property
    def outcome(self) -> TokenEpisode | None:
        return self._outcome

    def _end(self, result: EpisodeResult) -> None:
        self._outcome = TokenEpisode(result, self._builder.build(), tuple(self._logprobs))

    def cut_full(self) -> TokenEpisode:
        """End the episode before a turn: its context leaves no room (a ``context_tokens`` cut)."""
        self._end(self.episode.cut_context(len(self._builder.context_ids)))
        assert self._outcome is not None
        return self._outcome

    def step(self, gen: Generation, decode: Decode) -> tuple[int, ...] | None:
        """Take one sampled model turn (see the class docstring)."""
        if self._outcome is not None:
            raise RuntimeError("the episode is over")
        before = self.episode.messages
        self._builder.add_model(gen.ids)
        self._logprobs.extend(gen.logprobs)
        text = decode(gen.ids)
        end = self.renderer.end_of_turn
        if gen.finished and text.endswith(end):
            text = text[: -len(end)]
        step = self.episode.step(text, context_tokens=len(self._builder.context_ids), finished=gen.finished)
        if step.result is not None:
            if gen.finished:  # the template's tail of the last turn: context, for an exact transcript
                self._add_context(self.renderer.after_turn_text(before, Message("assistant", text), (), False))
            self._end(step.result)
            return None
        assert step.observation is not None
        return self._add_context(self.renderer.after_turn_text(before, Message("assistant", text),
                                                               (step.observation,), True))


def run_token_episode(env: Environment, item: EpisodeItem, renderer: ChatRenderer, generate: Generate,
                      decode: Decode, *, limits: EpisodeLimits | None = None,
                      max_new_tokens: int = 256) -> TokenEpisode:
    """Run ``item`` to its end with ``generate``; every limit is the episode's (see ``contract``)."""
    run = TokenEpisodeRun(env, item, renderer, limits, max_new_tokens=max_new_tokens)
    while True:
        if run.budget <= 0:
            return run.cut_full()
        if run.step(generate(run.context_ids, run.budget), decode) is None:
            assert run.outcome is not None
            return run.outcome
