"""The environment contract: an episode is turns of model text and environment observations.

An ``Environment`` hands out seeded ``EpisodeItem``s (the opening messages and the gold answer,
a fixed held-out split beside an endless training stream). ``Environment.start(item, limits)``
opens an ``Episode``; whoever drives generation calls ``episode.step(model_text)`` once per
model turn and gets either the next observation (a ``tool`` or ``user`` message to append and
generate after) or the finished ``EpisodeResult``: the transcript, the reward and its named
parts (``answer``, ``format``, ``tool_use`` ...), counts, and every limit that cut it.

Limits (``EpisodeLimits``) are enforced here, the same for every environment: model turns,
tokens of context (the driver passes the count it rendered), seconds of tool time, and a model
turn that ended without its end-of-turn token. A cut ends the episode, is recorded in
``EpisodeResult.cuts`` (never silent) and pays nothing: a tool-call loop or a run-on turn
cannot farm the format or tool parts. A single-turn task is the one-turn case of the same
contract (``TaskEnvironment`` over ``engine.rl.tasks.Task``), so there is one rollout path.

What it does not know: tokens and chat templates (``engine.envs.trajectory``), models, tools
(``engine.envs.tool_env``), how rewards become advantages.
"""

from __future__ import annotations

import time
from abc import ABC, abstractmethod
from dataclasses import dataclass, field
from enum import Enum
from typing import Any, Callable, Iterator, Mapping, Sequence

from engine.rl.tasks.base import Task

ROLES = ("system", "user", "assistant", "tool")
MAX_MESSAGE_CHARS = 200_000


@dataclass(frozen=True)
class Message:
    """One turn. ``role``: system, user, assistant (the model) or tool (a tool's answer)."""

    role: str
    content: str

    def __post_init__(self) -> None:
        if self.role not in ROLES:
            raise ValueError(f"role must be one of {ROLES}, got {self.role!r}")
        if not isinstance(self.content, str) or len(self.content) > MAX_MESSAGE_CHARS:
            raise ValueError(f"content must be a string of at most {MAX_MESSAGE_CHARS} characters")

    def as_dict(self) -> dict[str, str]:
        return {"role": self.role, "content": self.content}


@dataclass(frozen=True)
class EpisodeItem:
    """The seeded start of an episode.

    Fields:
      item_id: stable name (for logs, dedup and the sample display).
      messages: the opening turns; the model answers after the last one.
      answer: the gold answer (never shown to the model).
      held_out: whether it is from the fixed eval split.
      source: what the environment needs to score it (a task's own item); never on the wire.
    """

    item_id: str
    messages: tuple[Message, ...]
    answer: str
    held_out: bool = False
    source: Any = field(default=None, compare=False, repr=False)

    def __post_init__(self) -> None:
        object.__setattr__(self, "messages", tuple(self.messages))
        if not self.messages or self.messages[-1].role == "assistant":
            raise ValueError("an episode opens with at least one message and the model speaks next")


@dataclass(frozen=True)
class EpisodeLimits:
    """Per-episode limits; validated on construction.

    Fields:
      max_turns: model turns; an observation asking for one more is a ``turns`` cut.
      max_context_tokens: tokens of the whole context (prompt, turns, observations); the
        driver passes its count to ``step`` and more is a ``context_tokens`` cut.
      max_tool_s: seconds of tool time summed over the episode (each call gets what is left);
        using all of it is a ``tool_s`` cut.
    """

    max_turns: int = 4
    max_context_tokens: int = 2048
    max_tool_s: float = 30.0

    def __post_init__(self) -> None:
        if not 1 <= self.max_turns <= 64:
            raise ValueError(f"max_turns must be in [1, 64], got {self.max_turns}")
        if not 16 <= self.max_context_tokens <= 1_048_576:
            raise ValueError(f"max_context_tokens must be in [16, 1048576], got {self.max_context_tokens}")
        if not 0 < self.max_tool_s <= 3600:
            raise ValueError(f"max_tool_s must be in (0, 3600], got {self.max_tool_s}")


class CutKind(str, Enum):
    """Which limit ended an episode early."""

    TURNS = "turns"  #: the environment answered but no model turn was left
    CONTEXT_TOKENS = "context_tokens"  #: the context outgrew max_context_tokens
    TOOL_S = "tool_s"  #: tool time ran past max_tool_s
    UNFINISHED_TURN = "unfinished_turn"  #: the model turn hit its token budget without end-of-turn


@dataclass(frozen=True)
class Cut:
    """One recorded cut: which limit, its value, what was reached, at which model turn (1-based)."""

    kind: CutKind
    limit: float
    reached: float
    turn: int


@dataclass(frozen=True)
class EpisodeResult:
    """A finished episode.

    Fields:
      item_id / held_out: from the item.
      messages: the whole transcript (opening turns, model turns, observations).
      reward: the sum of ``parts``, or 0.0 if the episode was cut.
      parts: the environment's named reward parts (each already weighted), reported even
        when a cut zeroes the reward, so a monitor sees what a cut episode would have earned.
      turns: model turns taken.
      tool_calls / tool_errors: calls made / calls that answered with an error.
      tool_s: seconds spent in tools.
      cuts: every limit that ended it (empty when the model finished by itself).
      wall_s: seconds from start to end (generation included).
    """

    item_id: str
    held_out: bool
    messages: tuple[Message, ...]
    reward: float
    parts: Mapping[str, float]
    turns: int
    tool_calls: int
    tool_errors: int
    tool_s: float
    cuts: tuple[Cut, ...]
    wall_s: float

    @property
    def cut(self) -> bool:
        return bool(self.cuts)

    @property
    def final_text(self) -> str:
        """The model's last turn."""
        return next((m.content for m in reversed(self.messages) if m.role == "assistant"), "")


@dataclass
class EpisodeState:
    """What an environment may read and update while an episode runs (``Episode`` owns it)."""

    item: EpisodeItem
    limits: EpisodeLimits
    messages: list[Message]
    turns: int = 0
    tool_calls: int = 0
    tool_errors: int = 0
    tool_s: float = 0.0
    scratch: dict[str, Any] = field(default_factory=dict)

    @property
    def tool_s_left(self) -> float:
        return max(0.0, self.limits.max_tool_s - self.tool_s)

    def note_tool(self, seconds: float, ok: bool) -> None:
        """Record one tool call (the environment calls this for each)."""
        self.tool_calls += 1
        self.tool_errors += 0 if ok else 1
        self.tool_s += max(0.0, seconds)


@dataclass(frozen=True)
class Step:
    """The answer to one model turn: an observation to continue with, or the result."""

    observation: Message | None = None
    result: EpisodeResult | None = None

    @property
    def done(self) -> bool:
        return self.result is not None


class Environment(ABC):
    """Owns the conversation of an episode; its ``score`` owns the reward."""

    name: str = ""

    @abstractmethod
    def train_items(self, seed: int) -> Iterator[EpisodeItem]:
        """An endless seeded stream; never a held-out item."""

    @abstractmethod
    def eval_items(self) -> list[EpisodeItem]:
        """The fixed held-out split (the same in every process and run)."""

    @abstractmethod
    def respond(self, state: EpisodeState, model_text: str) -> Message | None:
        """The observation answering the model's turn, or ``None``: the turn ends the episode.

        Never raises on any model text; tool errors are observations. ``state.messages``
        already ends with the model's turn.
        """

    @abstractmethod
    def score(self, state: EpisodeState) -> Mapping[str, float]:
        """Named, weighted reward parts of the finished episode (their sum is the reward)."""

    def start(self, item: EpisodeItem, limits: EpisodeLimits | None = None) -> "Episode":
        return Episode(self, item, limits or EpisodeLimits())


class Episode:
    """One running episode: enforces the limits, records cuts, builds the result."""

    def __init__(self, env: Environment, item: EpisodeItem, limits: EpisodeLimits) -> None:
        self.env = env
        self.state = EpisodeState(item=item, limits=limits, messages=list(item.messages))
        self._start = time.monotonic()
        self._result: EpisodeResult | None = None

    @property
    def messages(self) -> tuple[Message, ...]:
        """The context to generate the next model turn from."""
        return tuple(self.state.messages)

    @property
    def result(self) -> EpisodeResult | None:
        return self._result

    def step(self, model_text: str, *, context_tokens: int | None = None, finished: bool = True) -> Step:
        """Take one model turn.

        ``context_tokens``: tokens of the context including this turn, if the driver counts
        them; ``finished``: False if the turn hit its token budget without end-of-turn (a
        ``context_tokens`` cut if the context was full, else an ``unfinished_turn`` cut).
        """
        if self._result is not None:
            raise RuntimeError("the episode is over")
        st, lim = self.state, self.state.limits
        st.messages.append(Message("assistant", model_text))
        st.turns += 1
        if context_tokens is not None and (context_tokens > lim.max_context_tokens or
                                           (not finished and context_tokens >= lim.max_context_tokens)):
            # over the limit, or stopped because the context had no room left
            return self._finish(Cut(CutKind.CONTEXT_TOKENS, lim.max_context_tokens, context_tokens, st.turns))
        if not finished:
            return self._finish(Cut(CutKind.UNFINISHED_TURN, 0, 0, st.turns))
        observation = self.env.respond(st, model_text)
        if st.tool_s >= lim.max_tool_s:  # the budget itself stopped a tool
            return self._finish(Cut(CutKind.TOOL_S, lim.max_tool_s, round(st.tool_s, 3), st.turns))
        if observation is None:
            return self._finish(None)
        st.messages.append(observation)
        if st.turns >= lim.max_turns:
            return self._finish(Cut(CutKind.TURNS, lim.max_turns, st.turns + 1, st.turns))
        return Step(observation=observation)

    def cut_context(self, context_tokens: int) -> EpisodeResult:
        """End the episode before a model turn: its context leaves no room for one token."""
        if self._result is not None:
            raise RuntimeError("the episode is over")
        lim = self.state.limits
        step = self._finish(Cut(CutKind.CONTEXT_TOKENS, lim.max_context_tokens, context_tokens, self.state.turns + 1))
        assert step.result is not None
        return step.result

    def _finish(self, cut: Cut | None) -> Step:
        st = self.state
        parts = {str(k): float(v) for k, v in self.env.score(st).items()}
        cuts = (cut,) if cut is not None else ()
        self._result = EpisodeResult(
            item_id=st.item.item_id, held_out=st.item.held_out, messages=tuple(st.messages),
            reward=0.0 if cuts else sum(parts.values()), parts=parts, turns=st.turns,
            tool_calls=st.tool_calls, tool_errors=st.tool_errors, tool_s=st.tool_s, cuts=cuts,
            wall_s=time.monotonic() - self._start)
        return Step(result=self._result)


def run_episode(env: Environment, item: EpisodeItem, policy: Callable[[Sequence[Message]], str],
                limits: EpisodeLimits | None = None) -> EpisodeResult:
    """Drive one episode with ``policy`` (context -> model text) until it ends."""
    episode = env.start(item, limits)
    while True:
        step = episode.step(policy(episode.messages))
        if step.result is not None:
            return step.result


class TaskEnvironment(Environment):
    """A single-turn ``Task`` as the one-turn case: the prompt is the user turn, one reply ends it.

    The reward is exactly ``task.reward_text(prompt, reply)`` (part ``answer``).
    """

    def __init__(self, task: Task) -> None:
        self.task = task
        self.name = task.name

    def _item(self, prompt: str, answer: str, held_out: bool) -> EpisodeItem:
        return EpisodeItem(item_id=prompt, messages=(Message("user", prompt),), answer=answer, held_out=held_out)

    def train_items(self, seed: int) -> Iterator[EpisodeItem]:
        for ex in self.task.train_stream(seed):
            yield self._item(ex.prompt, ex.answer, False)

    def eval_items(self) -> list[EpisodeItem]:
        return [self._item(ex.prompt, ex.answer, True) for ex in self.task.eval_split()]

    def respond(self, state: EpisodeState, model_text: str) -> Message | None:
        return None

    def score(self, state: EpisodeState) -> Mapping[str, float]:
        reply = state.messages[-1].content if state.messages[-1].role == "assistant" else ""
        return {"answer": self.task.reward_text(state.item.messages[-1].content, reply)}
