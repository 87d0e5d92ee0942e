"""Token trajectories of multi-turn episodes and their loss masks: train only the model's tokens.

A trajectory is the exact token sequence the model saw and produced, built by appending:
context pieces (the rendered prompt, template tokens, tool and user observations; mask 0)
and model turns (the ids the model sampled, its end-of-turn token included; mask 1).
Model ids are kept as sampled, never re-tokenised from text, so the log-probs recorded at
generation time line up with the trajectory token by token, and the context for turn k+1 is
the context of turn k extended (a generator can keep its KV cache across turns).

``ChatRenderer`` gets the context pieces from a chat template: for each model turn it renders
the conversation before and after and takes the difference, so every template token (the
role header, the end-of-turn, the newline after it) lands on the right side of the mask.
It requires a prefix-stable template (rendering more turns only appends text); a template
that rewrites earlier turns (e.g. one that drops past reasoning) raises ``TemplateError``.

What it does not know: which tokenizer or template (they are passed in as functions),
models, rewards.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Sequence

from engine.envs.contract import Message

Render = Callable[[Sequence[dict], bool], str]  #: (messages as dicts, add_generation_prompt) -> text
Encode = Callable[[str], list[int]]  #: text -> ids, special tokens in the text parsed, none added


class TemplateError(ValueError):
    """The chat template is not prefix-stable, or a transcript does not fit it."""


@dataclass(frozen=True)
class Trajectory:
    """Token ids and their loss mask (1: the model's own token, trained; 0: context)."""

    ids: tuple[int, ...]
    mask: tuple[int, ...]

    def __post_init__(self) -> None:
        if len(self.ids) != len(self.mask):
            raise ValueError("ids and mask differ in length")

    @property
    def trained_tokens(self) -> int:
        return sum(self.mask)

    def model_spans(self) -> list[tuple[int, int]]:
        """``[start, end)`` index ranges of consecutive model tokens."""
        spans, start = [], None
        for i, m in enumerate(self.mask + (0,)):
            if m and start is None:
                start = i
            elif not m and start is not None:
                spans.append((start, i))
                start = None
        return spans


class TrajectoryBuilder:
    """Appends context and model pieces; ``context_ids`` is what the next turn generates after."""

    def __init__(self) -> None:
        self._ids: list[int] = []
        self._mask: list[int] = []

    def add_context(self, ids: Sequence[int]) -> None:
        self._ids.extend(int(i) for i in ids)
        self._mask.extend([0] * len(ids))

    def add_model(self, ids: Sequence[int]) -> None:
        self._ids.extend(int(i) for i in ids)
        self._mask.extend([1] * len(ids))

    @property
    def context_ids(self) -> tuple[int, ...]:
        return tuple(self._ids)

    def build(self) -> Trajectory:
        return Trajectory(tuple(self._ids), tuple(self._mask))


class ChatRenderer:
    """Context pieces of a conversation from a chat template.

    ``end_of_turn`` is the text of the token that closes a model turn (``<|im_end|>``,
    ``<|eot_id|>``): the model generates it, so it is trained; what the template puts after
    it (a newline, the next header) is context.
    """

    def __init__(self, render: Render, encode: Encode, end_of_turn: str) -> None:
        self.render = render
        self.encode = encode
        self.end_of_turn = end_of_turn

    def _text(self, messages: Sequence[Message], generation_prompt: bool) -> str:
        return self.render([m.as_dict() for m in messages], generation_prompt)

    def prompt_text(self, messages: Sequence[Message]) -> str:
        """The text before the first model turn (its generation prompt included)."""
        return self._text(messages, True)

    def turn_texts(self, before: Sequence[Message], reply: Message) -> tuple[str, str]:
        """(what the model wrote: reply + end-of-turn, the template text after it)."""
        prompt = self._text(before, True)
        full = self._text([*before, reply], False)
        model = reply.content + self.end_of_turn
        if not full.startswith(prompt) or not full[len(prompt):].startswith(model):
            raise TemplateError("the template does not render a model turn as generation prompt + "
                                f"content + {self.end_of_turn!r}; it cannot be masked by prefix")
        return model, full[len(prompt) + len(model):]

    def between_texts(self, upto: Sequence[Message], nxt: Sequence[Message], generation_prompt: bool) -> str:
        """The text the template adds after ``upto`` for the messages ``nxt`` (observations)."""
        head = self._text(upto, False)
        full = self._text([*upto, *nxt], generation_prompt)
        if not full.startswith(head):
            raise TemplateError("the template rewrites earlier turns when more are added (not prefix-stable)")
        return full[len(head):]

    def after_turn_text(self, before: Sequence[Message], reply: Message, following: Sequence[Message],
                        generation_prompt: bool) -> str:
        """The context text after a model turn: the template's tail of the turn, the ``following``
        observations and, if asked, the next turn's generation prompt."""
        _, tail = self.turn_texts(before, reply)
        return tail + self.between_texts([*before, reply], following, generation_prompt)

    def trajectory(self, messages: Sequence[Message], model_ids: Sequence[Sequence[int]] | None = None, *,
                   opening: int = 0) -> Trajectory:
        """The trajectory of a transcript; ``model_ids[k]``: the sampled ids of the k-th model turn
        (content and end-of-turn), or encoded from the text when not given. The first ``opening``
        messages are the episode's opening (``EpisodeItem.messages``): context, even an assistant
        turn among them (a worked example)."""
        turns = [i for i, m in enumerate(messages) if m.role == "assistant" and i >= opening]
        if not turns:
            raise TemplateError("a transcript needs at least one model turn")
        if model_ids is not None and len(model_ids) != len(turns):
            raise ValueError(f"{len(turns)} model turns but {len(model_ids)} id lists")
        b = TrajectoryBuilder()
        b.add_context(self.encode(self.prompt_text(messages[: turns[0]])))
        for k, i in enumerate(turns):
            model_text, _ = self.turn_texts(messages[:i], messages[i])
            b.add_model(model_ids[k] if model_ids is not None else self.encode(model_text))
            nxt_end = turns[k + 1] if k + 1 < len(turns) else len(messages)
            # ends with the next turn's generation prompt
            b.add_context(self.encode(self.after_turn_text(messages[:i], messages[i], messages[i + 1: nxt_end],
                                                           k + 1 < len(turns))))
        return b.build()
