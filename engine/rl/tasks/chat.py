"""What a chat task hands out and gets back: prompts as messages, items with gold answers, scores.

A chat task (``reasoning_gym:<dataset>``, ``mixture``) is the real-model counterpart of the
character-level digit tasks. It yields ``TaskItem``s: a ``ChatPrompt`` (system turn, an optional
worked example turn, the question as the user turn) plus the gold answer and the dataset's own
entry. Whoever holds the model renders ``prompt.as_dicts()`` through the model's chat template
(``engine.rl.codec``) and decodes the completion to text; the task scores that text with
``ChatTask.score`` (or the sampled ids with ``ChatTask.score_tokens``) into a ``Score``: the strict
score (answer in tags), the content-only score
(the answer the text states, tags ignored), and the training reward as named parts
(``answer`` + a small ``format`` part). ``summarise`` turns scores into the figures an eval reports.

What it does not know: tokens, chat templates, models, advantages; which datasets exist.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass, field, replace
from typing import Any, Iterator, Mapping, Protocol, Sequence

from engine.rl.tasks.config import TaskConfig

ROLES = ("system", "user", "assistant")
_MAX_MESSAGE_CHARS = 100_000


@dataclass(frozen=True)
class ChatMessage:
    """One turn of a conversation.

    Fields:
      role: ``system``, ``user`` or ``assistant``.
      content: the turn's text (no template tokens).
    """

    role: str
    content: str

    def __post_init__(self) -> None:
        if self.role not in ROLES:
            raise ValueError(f"role must be one of {ROLES}, got {self.role!r}")
        if not isinstance(self.content, str) or len(self.content) > _MAX_MESSAGE_CHARS:
            raise ValueError(f"content must be a string of at most {_MAX_MESSAGE_CHARS} characters")


@dataclass(frozen=True)
class ChatPrompt:
    """The turns before the model's answer: [system], [example user, example assistant], user.

    Fields:
      messages: the turns in order; the last one is the user's question.
    """

    messages: tuple[ChatMessage, ...]

    def __post_init__(self) -> None:
        object.__setattr__(self, "messages", tuple(self.messages))
        if not self.messages or self.messages[-1].role != "user":
            raise ValueError("a chat prompt ends with the user's turn")
        if any(m.role == "system" for m in self.messages[1:]):
            raise ValueError("a system turn may only come first")

    def as_dicts(self) -> list[dict[str, str]]:
        """``[{"role": ..., "content": ...}, ...]`` as chat templates take them."""
        return [{"role": m.role, "content": m.content} for m in self.messages]


@dataclass(frozen=True)
class TaskItem:
    """One question of a chat task.

    Fields:
      item_id: stable name, ``<dataset>/<split>/<index>`` (for logs, dedup and sample display).
      dataset: the reasoning-gym dataset it comes from (scores dispatch on it in a mixture).
      question: the question text (also the user turn of ``prompt``; held-out dedup is on it).
      answer: the gold answer as text.
      prompt: the turns to render through the model's chat template.
      entry: the dataset's own item (question, answer, metadata) for its ``score_answer``;
        stays in the process that made it, never on the wire.
    """

    item_id: str
    dataset: str
    question: str
    answer: str
    prompt: ChatPrompt
    entry: Mapping[str, Any] = field(default_factory=dict, compare=False, repr=False)


@dataclass(frozen=True)
class Score:
    """The scores of one completion.

    Fields:
      strict: the dataset's score of the tagged answer (0 without a tag pair), in [0, 1].
      content: the dataset's score of the stated answer, tags ignored, in [0, 1]; for evals.
      well_formed: one tag pair at the end with an answer of the gold answer's shape.
      parts: the training reward's named parts: ``answer`` (= strict) and ``format``
        (= format_weight if well formed, else 0).
      answer: the tagged answer (``None`` without one).
      stated: the stated answer (``None`` if the text states none).
    """

    strict: float
    content: float
    well_formed: bool
    parts: Mapping[str, float]
    answer: str | None = None
    stated: str | None = None

    @property
    def reward(self) -> float:
        """The training reward: the sum of the parts."""
        return float(sum(self.parts.values()))


class CompletionDecoder(Protocol):
    """What scoring from token ids needs of a tokenizer (``engine.rl.codec.ChatCodec`` has it)."""

    def completion_ids(self, ids: Sequence[int]) -> tuple[list[int], bool]:
        """The ids before the first stop id, and whether a stop id came at all."""

    def decode(self, ids: Sequence[int]) -> str:
        """Text of ``ids``, special tokens dropped."""


def zero_score() -> Score:
    return Score(0.0, 0.0, False, {"answer": 0.0, "format": 0.0})


class ChatTask(ABC):
    """A family of chat questions with a fixed held-out split and a seeded training stream."""

    def __init__(self, config: TaskConfig) -> None:
        self.config = config

    @property
    def name(self) -> str:
        return self.config.name

    @abstractmethod
    def eval_items(self) -> list[TaskItem]:
        """The fixed held-out split: the same items in every process and run."""

    @abstractmethod
    def train_items(self, seed: int) -> Iterator[TaskItem]:
        """An endless seeded stream of training items; never a held-out question."""

    @abstractmethod
    def score(self, item: TaskItem, completion: str) -> Score:
        """Score a decoded completion (template tokens removed) of ``item``; never raises."""

    @abstractmethod
    def is_held_out(self, question: str) -> bool:
        """Whether ``question`` is in the held-out split."""

    def score_tokens(self, item: TaskItem, completion_ids: Sequence[int], codec: CompletionDecoder) -> Score:
        """Score sampled ids as a coordinator does: the text up to the first stop id.

        A turn that never ended (no stop id within the token budget) keeps its answer score but
        not the format part: a well-formed answer ends the turn. Never raises.
        """
        try:
            ids, finished = codec.completion_ids(completion_ids)
            text = codec.decode(ids)
        except (TypeError, ValueError, OverflowError):
            return zero_score()
        score = self.score(item, text)
        if finished:
            return score
        return replace(score, well_formed=False, parts={**score.parts, "format": 0.0})


@dataclass(frozen=True)
class EvalSummary:
    """What an eval of a chat task reports.

    Fields:
      items: how many completions were scored.
      strict: mean strict score (answer in tags).
      content: mean content-only score (claim a skill from this one, DESIGN §9).
      well_formed: share of well-formed completions.
      reward: mean training reward.
      per_dataset: ``{dataset: (items, strict, content)}`` for a mixture.
    """

    items: int
    strict: float
    content: float
    well_formed: float
    reward: float
    per_dataset: Mapping[str, tuple[int, float, float]]


def summarise(items: Sequence[TaskItem], scores: Sequence[Score]) -> EvalSummary:
    """Means of ``scores`` (one per item), overall and per dataset."""
    if len(items) != len(scores):
        raise ValueError(f"{len(items)} items but {len(scores)} scores")
    n = max(len(scores), 1)
    groups: dict[str, list[Score]] = {}
    for item, s in zip(items, scores):
        groups.setdefault(item.dataset, []).append(s)
    return EvalSummary(
        items=len(scores),
        strict=sum(s.strict for s in scores) / n,
        content=sum(s.content for s in scores) / n,
        well_formed=sum(s.well_formed for s in scores) / n,
        reward=sum(s.reward for s in scores) / n,
        per_dataset={d: (len(g), sum(s.strict for s in g) / len(g), sum(s.content for s in g) / len(g))
                     for d, g in sorted(groups.items())})
