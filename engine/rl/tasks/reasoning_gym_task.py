"""The ``reasoning_gym:<dataset>`` chat task: a reasoning-gym generator as a Polis task.

reasoning-gym (PyPI ``reasoning-gym``) generates items procedurally from a seed (no downloads;
``tests/unit/test_reasoning_gym_tasks.py`` checks that generating opens no socket). Its import
takes ~2 s and pulls sympy and matplotlib, so it is imported only when such a task is built.

- Held-out split: ``eval_size`` distinct questions from a dataset seeded by the task's name and
  options only (never by a run seed), so every process and run holds out the same items; at most
  half of the distinct questions in ``4 * eval_size + 100`` draws, so a small space keeps questions
  to train on.
- Training stream: seeded chunks of the same generator; any item whose question text is held
  out is skipped (by text, not by seed: generators repeat items across seeds, and a small
  configuration such as 1-digit two-term ``chain_sum`` has only 200 distinct questions). If the
  held-out split covers (nearly) every question, the stream says so instead of spinning.
- Prompt: the config's system turn, one example turn (a question from a third seed that is not
  held out, answered as ``"<expression> = <answer>. <answer>..</answer>"`` where the dataset
  states an expression, else just the tags), then the question.
- Score: the dataset's own ``score_answer`` on the tagged answer (strict) and on the stated answer
  (content), each read by ``answers`` (which passes on only answers of the gold answer's shape),
  plus the format part. Where the gold answer is a number the dataset's score counts only when it
  is 1 (numbers are right or wrong; see ``_dataset_score``). Any error inside the dataset's scorer
  scores 0.

What it does not know: tokens, chat templates, models; other tasks (``mixture`` composes these).
"""

from __future__ import annotations

import dataclasses
import difflib
import json
import logging
import math
import zlib
from typing import Any, Iterator, Mapping

from engine.rl.tasks.answers import is_numeric, stated_answer, tagged_answer, well_formed
from engine.rl.tasks.chat import ChatMessage, ChatPrompt, ChatTask, Score, TaskItem, zero_score
from engine.rl.tasks.config import TaskConfig

log = logging.getLogger(__name__)

#: items per seeded chunk of the training stream (some generators do work per item at construction)
CHUNK_ITEMS = 1000
#: consecutive held-out questions after which the training stream gives up
MAX_CONSECUTIVE_HELD_OUT = 5000
_INSTALL_HINT = "pip install 'reasoning-gym>=0.1.25' (or install Polis with its 'tasks' extra)"


class TaskUnavailable(RuntimeError):
    """The task's library is not installed; the message says what to install."""


def load_reasoning_gym() -> Any:
    """The ``reasoning_gym`` module (imported on first use: it is slow and heavy)."""
    try:
        import reasoning_gym
    except ImportError as exc:
        raise TaskUnavailable(f"reasoning-gym tasks need the reasoning-gym package: {_INSTALL_HINT}") from exc
    return reasoning_gym


def _seed(*parts: object) -> int:
    return zlib.crc32("/".join(str(p) for p in parts).encode())


class ReasoningGymTask(ChatTask):
    """One reasoning-gym dataset with the options of ``config`` (``reasoning_gym:<dataset>``)."""

    def __init__(self, config: TaskConfig) -> None:
        super().__init__(config)
        self.dataset = config.dataset
        if not self.dataset:
            raise ValueError(f"{config.name!r} is not a reasoning_gym:<dataset> task")
        self._rg = load_reasoning_gym()
        self._options = self._checked_options(config.options)
        self._key = json.dumps(config.options, sort_keys=True)
        self._scorer = self._generator(seed=0, size=1)
        self._eval_entries: list[tuple[int, dict[str, Any]]] | None = None
        self._eval: list[TaskItem] | None = None
        self._held_out: frozenset[str] = frozenset()
        self._example: tuple[ChatMessage, ...] | None = None

    # -- dataset access ------------------------------------------------------------
    def _checked_options(self, options: Mapping[str, Any]) -> dict[str, Any]:
        datasets = self._rg.factory.DATASETS
        if self.dataset not in datasets:
            near = difflib.get_close_matches(self.dataset, list(datasets), n=3)
            hint = f" (did you mean {', '.join(near)}?)" if near else ""
            raise ValueError(f"reasoning-gym has no dataset {self.dataset!r}{hint}")
        config_cls = datasets[self.dataset][1]
        defaults = {f.name: f.default for f in dataclasses.fields(config_cls)}
        unknown = sorted(set(options) - set(defaults))
        if unknown:
            known = sorted(set(defaults) - {"seed", "size"})
            raise ValueError(f"{self.dataset}: unknown options {unknown}; its options are {known}")
        out: dict[str, Any] = {}
        for key, value in options.items():
            default = defaults[key]
            if isinstance(default, tuple) and isinstance(value, list):
                value = tuple(value)
            elif isinstance(default, bool) and not isinstance(value, bool):
                raise ValueError(f"{self.dataset}.{key} must be true or false, got {value!r}")
            elif isinstance(default, int) and not isinstance(default, bool) and \
                    (isinstance(value, bool) or not isinstance(value, int)):
                raise ValueError(f"{self.dataset}.{key} must be an integer, got {value!r}")
            out[key] = value
        return out

    def _generator(self, *, seed: int, size: int) -> Any:
        try:
            return self._rg.create_dataset(self.dataset, **self._options, seed=seed, size=size)
        except (AssertionError, TypeError, ValueError) as exc:
            raise ValueError(f"{self.dataset} options {self._key}: {exc or type(exc).__name__}") from None

    def _entry(self, generator: Any, index: int) -> dict[str, Any] | None:
        try:
            entry = generator[index]
        except Exception:  # third-party generator code: a failing item is skipped, like a malformed one
            log.debug("%s item %d raised; skipped", self.dataset, index, exc_info=True)
            return None
        if not isinstance(entry, dict) or not isinstance(entry.get("question"), str) \
                or not isinstance(entry.get("answer"), str) or not entry["question"]:
            log.debug("%s item %d is malformed; skipped", self.dataset, index)
            return None
        return entry

    def _item(self, entry: Mapping[str, Any], split: str, index: int) -> TaskItem:
        messages = []
        if self.config.system_prompt:
            messages.append(ChatMessage("system", self.config.system_prompt))
        messages.extend(self.example_turns())
        messages.append(ChatMessage("user", entry["question"]))
        return TaskItem(item_id=f"{self.dataset}/{split}/{index}", dataset=self.dataset,
                        question=entry["question"], answer=entry["answer"],
                        prompt=ChatPrompt(tuple(messages)), entry=entry)

    # -- the example turn ------------------------------------------------------------
    def example_turns(self) -> tuple[ChatMessage, ...]:
        """The worked example (user question, assistant answer), or nothing if ``example='none'``."""
        if self.config.example == "none":
            return ()
        if self._example is None:
            self._held_out_entries()
            generator = self._generator(seed=_seed("polis-example", self.dataset, self._key), size=256)
            for index in range(256):
                entry = self._entry(generator, index)
                if entry is not None and entry["question"] not in self._held_out:
                    break
            else:
                raise ValueError(f"{self.dataset}: no question outside the held-out split for the example turn; "
                                 "lower eval_size or widen the options")
            answer = entry["answer"]
            expression = entry.get("metadata", {}).get("expression")
            if self.config.example == "worked" and isinstance(expression, str) and expression:
                reply = f"{expression} = {answer}. <answer>{answer}</answer>"
            else:
                reply = f"<answer>{answer}</answer>"
            self._example = (ChatMessage("user", entry["question"]), ChatMessage("assistant", reply))
        return self._example

    # -- splits ---------------------------------------------------------------------
    def _held_out_entries(self) -> list[tuple[int, dict[str, Any]]]:
        """The held-out (index, entry) pairs, drawn once; also fills the held-out question set."""
        if self._eval_entries is None:
            size = self.config.eval_size
            draws = 4 * size + 100
            generator = self._generator(seed=_seed("polis-eval", self.dataset, self._key), size=draws)
            entries: dict[str, tuple[int, dict[str, Any]]] = {}
            for index in range(draws):
                entry = self._entry(generator, index)
                if entry is not None:
                    entries.setdefault(entry["question"], (index, entry))
            # never hold out more than half of the distinct questions seen: a small task space
            # must leave questions to train on (and one for the example turn)
            keep = min(size, len(entries) // 2)
            if keep < size:
                log.warning("%s: %d held-out questions instead of %d: only %d distinct ones in %d draws "
                            "(a small task space; half are left for training)", self.dataset, keep, size,
                            len(entries), draws)
            entries = dict(list(entries.items())[:keep])
            self._held_out = frozenset(entries)
            self._eval_entries = list(entries.values())
        return self._eval_entries

    def eval_items(self) -> list[TaskItem]:
        if self._eval is None:
            self._eval = [self._item(entry, "eval", index) for index, entry in self._held_out_entries()]
        return list(self._eval)

    def is_held_out(self, question: str) -> bool:
        self._held_out_entries()
        return question in self._held_out

    def train_items(self, seed: int) -> Iterator[TaskItem]:
        self._held_out_entries()
        count = skipped = chunk = 0
        while True:
            generator = self._generator(seed=_seed("polis-train", self.dataset, self._key, seed, chunk),
                                        size=CHUNK_ITEMS)
            for index in range(CHUNK_ITEMS):
                entry = self._entry(generator, index)
                if entry is None or entry["question"] in self._held_out:
                    skipped += 1
                    if skipped > MAX_CONSECUTIVE_HELD_OUT:
                        raise ValueError(f"{self.dataset}: the held-out split covers (nearly) every question of "
                                         f"options {self._key}; lower eval_size or widen the options")
                    continue
                skipped = 0
                yield self._item(entry, f"train-{seed}", count)
                count += 1
            chunk += 1

    # -- scoring ----------------------------------------------------------------------
    def _dataset_score(self, answer: str | None, item: TaskItem) -> float:
        if answer is None:
            return 0.0
        try:
            value = float(self._scorer.score_answer(answer, dict(item.entry)))
        except Exception:  # the dataset's scorer is third-party code; a crash there scores 0
            log.debug("%s score_answer raised on %r", self.dataset, answer[:80], exc_info=True)
            return 0.0
        if not math.isfinite(value):
            return 0.0
        if is_numeric(item.answer):
            # a number is right or wrong: reasoning-gym's substring partial credit would pay 0.5
            # for "17" against "7" and a floor for any digit spray
            return 1.0 if value >= 1.0 else 0.0
        return min(max(value, 0.0), 1.0)

    def score(self, item: TaskItem, completion: str) -> Score:
        if item.dataset != self.dataset or not isinstance(completion, str):
            log.warning("%s cannot score an item of %r", self.dataset, item.dataset)
            return zero_score()
        gold = item.answer
        answer, stated = tagged_answer(completion, gold), stated_answer(completion, gold)
        strict = self._dataset_score(answer, item)
        formed = well_formed(completion, gold)
        return Score(strict=strict, content=self._dataset_score(stated, item), well_formed=formed,
                     parts={"answer": strict, "format": self.config.format_weight if formed else 0.0},
                     answer=answer, stated=stated)
