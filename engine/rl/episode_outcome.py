"""What a rollout is to the coordinator: an episode stepped turn by turn, and its finished outcome.

``EpisodeRun`` is what the turn driver (``engine.swarm.episodes``) steps: the ids the next turn
generates after, its token budget, ``step`` with the sampled ids. ``EpisodeOutcome`` is the
finished episode as it is stored, trained on (ids after the prompt, their loss mask, behaviour
log-probs), scored and shown. ``OneTurnEpisode`` is the one-turn case every single-turn task
uses (``engine.rl.run_task``); environments with turns and tools have
``engine.rl.env_run_task``.

What it does not know: tasks, environments, jobs, nodes, the store.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Mapping, Protocol, Sequence

#: items kept for scoring (far above what is ever in flight: two batches plus re-queued jobs)
MAX_LIVE_ITEMS = 16384


@dataclass(frozen=True)
class EvalScore:
    """One greedy held-out completion's scores, each in [0, 1].

    Fields:
      strict: the task's own measure (digit tasks: exact match; chat tasks: the answer in tags).
      content: the answer the text states, format ignored (digit tasks: equal to ``strict``).
    """

    strict: float
    content: float


@dataclass(frozen=True)
class EpisodeOutcome:
    """A finished episode as the coordinator stores, trains and shows it.

    Fields:
      completion_ids: every id after the prompt: the model's turns and the context between them.
      loss_mask: 1 on the model's own ids (trained), 0 on context ids (template, tool, observation).
      logprobs: the behaviour log-prob of each model id, 0.0 on context ids (never in a ratio).
      reward / parts: the training reward and its named parts (their sum, or 0 when cut).
      score: the held-out scores of the episode (used when it is an eval).
      turns / tool_calls / tool_errors / tool_s: counts and seconds of tool time.
      cuts: the limits that cut it (``engine.envs.contract.CutKind`` values), empty when it ended itself.
      gold / given: the gold answer and the answer the final turn gives (None: none), for the
        shortcut monitor.
      question / transcript: the question and ``(role, text)`` of every turn after the prompt, for people.
    """

    completion_ids: tuple[int, ...]
    loss_mask: tuple[int, ...]
    logprobs: tuple[float, ...]
    reward: float
    parts: Mapping[str, float]
    score: EvalScore
    gold: str
    given: str | None
    question: str
    transcript: tuple[tuple[str, str], ...]
    turns: int = 1
    tool_calls: int = 0
    tool_errors: int = 0
    tool_s: float = 0.0
    cuts: tuple[str, ...] = ()

    def __post_init__(self) -> None:
        if not len(self.completion_ids) == len(self.loss_mask) == len(self.logprobs):
            raise ValueError("completion ids, loss mask and log-probs differ in length")


class EpisodeRun(Protocol):
    """One running episode, stepped by the coordinator's turn driver (``engine.swarm.episodes``)."""

    runs_tools: bool  #: ``step`` may run tools (the driver then steps it off the event loop)
    tool_s_left: float  #: seconds of tool time the episode has left (bounds a step off the loop)

    @property
    def context_ids(self) -> tuple[int, ...]:
        """The ids the next turn generates after (the prompt, then every turn and observation)."""

    @property
    def budget(self) -> int:
        """Tokens the next turn may take; 0: the context is full (``cut_full``)."""

    @property
    def outcome(self) -> EpisodeOutcome | None:
        """The finished episode (None while it runs)."""

    def step(self, ids: Sequence[int], logprobs: Sequence[float], finished: bool) -> tuple[int, ...] | None:
        """Take a sampled turn; the ids to append before the next one, or None: the episode is over."""

    def cut_full(self) -> EpisodeOutcome:
        """End it before a turn: no room is left in its context."""


class OneTurnEpisode:
    """The one-turn case: the first turn is the completion, scored by ``score`` and the end."""

    runs_tools = False
    tool_s_left = 0.0

    def __init__(self, prompt_ids: Sequence[int], budget: int,
                 score: Callable[[Sequence[int], Sequence[float]], EpisodeOutcome]) -> None:
        self._ids = tuple(int(i) for i in prompt_ids)
        self._budget = budget
        self._score = score
        self._outcome: EpisodeOutcome | None = None

    @property
    def context_ids(self) -> tuple[int, ...]:
        return self._ids

    @property
    def budget(self) -> int:
        return self._budget

    @property
    def outcome(self) -> EpisodeOutcome | None:
        return self._outcome

    def step(self, ids: Sequence[int], logprobs: Sequence[float], finished: bool) -> tuple[int, ...] | None:
        self._outcome = self._score(ids, logprobs)
        return None

    def cut_full(self) -> EpisodeOutcome:  # a one-turn prompt is never over its budget before its turn
        raise RuntimeError("a one-turn episode has no context limit")


def one_turn_outcome(ids: Sequence[int], logprobs: Sequence[float], reward: float, score: EvalScore,
                     parts: Mapping[str, float], gold: str, given: str | None, question: str,
                     answer_text: str) -> EpisodeOutcome:
    """The outcome of a one-turn episode: every id is the model's."""
    return EpisodeOutcome(completion_ids=tuple(int(i) for i in ids), loss_mask=(1,) * len(ids),
                          logprobs=tuple(float(x) for x in logprobs), reward=float(reward), parts=dict(parts),
                          score=score, gold=gold, given=given, question=question,
                          transcript=(("assistant", answer_text),))


