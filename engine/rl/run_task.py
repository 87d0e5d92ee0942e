"""A run's task as training sees it: prompt keys, prompt ids, rewards and eval scores from tokens.

One rollout-and-scoring path for both trainers: the swarm's coordinator schedules and scores
with it, and the in-process ``engine.rl.trainer.Trainer`` samples and scores with the very same
object, so both train on the same prompts, rewards and held-out scores.

The coordinator's schedulers deal in *prompt keys*: plain strings that the replay buffer
(SQLite) stores and that map, without any other state, to the prompt's token ids. A
:class:`RunTask` turns its task into such keys and scores the sampled ids that come back:

* :class:`DigitRunTask` — a character-level digit task on the shipped tiny base
  (``engine.rl.tasks.make_task`` + ``TaskCodec``): the key is the prompt text itself
  (``"rev:1234="``), the reward is ``token_reward``, an eval counts exact matches (strict and
  content-only are the same figure);
* :class:`ChatRunTask` — a chat task (``reasoning_gym:<dataset>``, ``mixture``) on a real model
  (``make_chat_task`` + ``ChatCodec``): the key is the item's prompt rendered through the
  model's chat template (so ids are ``codec.encode(key)``, also after a restart), the reward is
  the task's ``score_tokens`` (strict score + its small format part), an eval records the
  strict score and the content-only score (DESIGN §9: report both, claim a skill from content).
  The items behind the keys handed out (their gold answers and the dataset's entries) are kept
  in memory, bounded; a key whose item is gone scores 0 and is counted.

Both say which ids end a completion (``stop_ids``, the first is the canonical EOS) and which id
pads a batch. :func:`make_run_task` picks one from the task's name and the checkpoint's
tokenizer files (:func:`run_task_for_codec` from an already loaded codec; with an environment named in
the run, ``engine.rl.env_run_task``).

Every rollout is an *episode* (``open_episode``): the scheduler generates a turn after
``context_ids``, hands the sampled ids to ``step`` and either continues after the ids it returns
or, when it returns ``None``, takes the finished ``EpisodeOutcome`` (what is stored, trained
and shown). The two tasks here are the one-turn case: their first turn ends the episode and is
scored as a completion always was. What it does not know: jobs, nodes, messages, the store.
"""

from __future__ import annotations

import logging
from pathlib import Path
from typing import TYPE_CHECKING, Iterator, Protocol, Sequence, cast

from engine.rl.codec import ChatCodec, CodecError, TaskCodec, load_codec
from engine.rl.episode_outcome import (
    EpisodeOutcome,
    EpisodeRun,
    EvalScore,
    OneTurnEpisode,
    one_turn_outcome,
)
from engine.rl.prompt_keys import PromptKeys
from engine.rl.tasks import ChatTask, Task, TaskConfig, TaskItem, is_chat_task_name, make_chat_task, make_task
from engine.rl.tasks.rewards import exact_match, token_reward

if TYPE_CHECKING:
    from engine.envs.settings import EnvSettings
    from engine.envs.tool_env import QuestionSource
    from engine.rl.env_run_task import EnvRunTask

log = logging.getLogger(__name__)



class RunTask(Protocol):
    """What the coordinator's generation, step and eval scheduling need of a task."""

    name: str
    pad_id: int
    stop_ids: tuple[int, ...]  #: ids that end a completion; the first is the canonical EOS

    @property
    def codec(self) -> TaskCodec | ChatCodec:
        """The model's tokenizer path (a chat codec renders chat templates)."""

    def open_episode(self, prompt: str, max_new_tokens: int) -> EpisodeRun:
        """A new episode from a prompt key (train or held-out); turns of at most ``max_new_tokens``."""

    def train_prompts(self, seed: int) -> Iterator[str]:
        """An endless seeded stream of training prompt keys (never a held-out one)."""

    def eval_prompts(self) -> list[str]:
        """The fixed held-out split's prompt keys."""

    def prompt_ids(self, prompt: str) -> list[int]:
        """The token ids the model sees for a prompt key."""

    def reward(self, prompt: str, completion_ids: Sequence[int]) -> float:
        """The training reward of sampled ids; never raises."""

    def eval_score(self, prompt: str, completion_ids: Sequence[int]) -> EvalScore:
        """Scores of a greedy held-out completion; never raises."""

    def sample_text(self, prompt: str, completion_ids: Sequence[int]) -> tuple[str, str]:
        """(question, answer) as a person reads them (for the live samples); never raises."""


class DigitRunTask:
    """A digit task on a character-level base: keys are the prompt texts."""

    def __init__(self, task: Task, codec: TaskCodec) -> None:
        self.task, self.codec = task, codec
        self.name = task.name
        self.pad_id = codec.pad_id
        self.stop_ids = (codec.eos_id,)

    def train_prompts(self, seed: int) -> Iterator[str]:
        return (example.prompt for example in self.task.train_stream(seed))

    def eval_prompts(self) -> list[str]:
        return [example.prompt for example in self.task.eval_split()]

    def prompt_ids(self, prompt: str) -> list[int]:
        return self.codec.encode_prompt(prompt)

    def reward(self, prompt: str, completion_ids: Sequence[int]) -> float:
        return token_reward(self.task, prompt, completion_ids, self.codec)

    def eval_score(self, prompt: str, completion_ids: Sequence[int]) -> EvalScore:
        hit = float(exact_match(self.task, prompt, completion_ids, self.codec))
        return EvalScore(hit, hit)

    def sample_text(self, prompt: str, completion_ids: Sequence[int]) -> tuple[str, str]:
        return prompt, self.codec.decode_lenient(completion_ids)

    def open_episode(self, prompt: str, max_new_tokens: int) -> OneTurnEpisode:
        def score(ids: Sequence[int], logprobs: Sequence[float]) -> EpisodeOutcome:
            text = self.codec.decode_lenient(ids)
            reward = self.reward(prompt, ids)
            return one_turn_outcome(ids, logprobs, reward, self.eval_score(prompt, ids), {"answer": reward},
                                    self.task.solve(prompt) or "", text or None, prompt, text)
        return OneTurnEpisode(self.prompt_ids(prompt), max_new_tokens, score)


class ChatRunTask:
    """A chat task on a model with a chat template: keys are the rendered prompts."""

    def __init__(self, task: ChatTask, codec: ChatCodec) -> None:
        if codec.template is None:
            raise CodecError(f"{task.name} is a chat task and this model has no chat template; "
                             "use an instruction-tuned model (e.g. polis import smollm2-135m)")
        self.task, self.codec = task, codec
        self.name = task.name
        self.pad_id = codec.pad_id
        self.stop_ids = (codec.eos_id, *sorted(codec.stop_ids - {codec.eos_id}))
        self._prompts: PromptKeys[TaskItem] = PromptKeys(self.key, codec.encode)
        self.unknown_prompts = 0  #: completions of keys whose item was no longer held (scored 0)

    def key(self, item: TaskItem) -> str:
        """The prompt key of an item: its turns through the chat template."""
        return self.codec.render(item.prompt.as_dicts(), add_generation_prompt=True)

    def train_prompts(self, seed: int) -> Iterator[str]:
        return self._prompts.train(self.task.train_items(seed))

    def eval_prompts(self) -> list[str]:
        return self._prompts.held_out(self.task.eval_items)

    def prompt_ids(self, prompt: str) -> list[int]:
        return self._prompts.ids(prompt)

    def _item(self, prompt: str) -> TaskItem | None:
        item = self._prompts.item(prompt)
        if item is None:
            self.unknown_prompts += 1
            log.warning("no task item for a returned prompt (%d so far); it scores 0", self.unknown_prompts)
        return item

    def reward(self, prompt: str, completion_ids: Sequence[int]) -> float:
        item = self._item(prompt)
        return 0.0 if item is None else self.task.score_tokens(item, completion_ids, self.codec).reward

    def eval_score(self, prompt: str, completion_ids: Sequence[int]) -> EvalScore:
        item = self._item(prompt)
        if item is None:
            return EvalScore(0.0, 0.0)
        score = self.task.score_tokens(item, completion_ids, self.codec)
        return EvalScore(float(score.strict), float(score.content))

    def sample_text(self, prompt: str, completion_ids: Sequence[int]) -> tuple[str, str]:
        item = self._prompts.item(prompt)
        try:
            answer = self.codec.decode_completion(completion_ids)
        except (TypeError, ValueError, OverflowError):
            answer = ""
        return (item.question if item is not None else prompt), answer

    def open_episode(self, prompt: str, max_new_tokens: int) -> OneTurnEpisode:
        def score(ids: Sequence[int], logprobs: Sequence[float]) -> EpisodeOutcome:
            question, text = self.sample_text(prompt, ids)
            item = self._item(prompt)
            if item is None:
                return one_turn_outcome(ids, logprobs, 0.0, EvalScore(0.0, 0.0), {"answer": 0.0}, "", None,
                                        question, text)
            s = self.task.score_tokens(item, ids, self.codec)
            return one_turn_outcome(ids, logprobs, s.reward, EvalScore(float(s.strict), float(s.content)),
                                    s.parts, item.answer, s.answer, question, text)
        return OneTurnEpisode(self.prompt_ids(prompt), max_new_tokens, score)


def make_run_task(config: TaskConfig, checkpoint_dir: str | Path,
                  env: "EnvSettings | None" = None) -> "DigitRunTask | ChatRunTask | EnvRunTask":
    """The run task for ``config`` on the model in ``checkpoint_dir`` (its tokenizer files only),
    in the environment ``env`` names (none: the task's own one-turn episodes).

    Raises ``ValueError`` (``CodecError``) when the task and the model's tokenizer do not fit
    together: a chat task on a character-level base, or a digit task on a BPE model, or an
    environment over a digit task."""
    return run_task_for_codec(config, load_codec(checkpoint_dir), where=str(checkpoint_dir), env=env)


def run_task_for_codec(config: TaskConfig, codec: TaskCodec | ChatCodec, *, where: str = "this model",
                       env: "EnvSettings | None" = None) -> "DigitRunTask | ChatRunTask | EnvRunTask":
    """The run task for ``config`` spoken through ``codec`` (``where`` names the model in errors)."""
    if is_chat_task_name(config.name):
        if not isinstance(codec, ChatCodec):
            raise CodecError(f"{config.name} is a chat task for a real model, but {where} is the "
                             "character-level base; set model (e.g. --set model=smollm2-135m) or --checkpoint")
        if env is not None and env.name:
            from engine.envs.contract import EpisodeLimits
            from engine.envs.registry import make_environment
            from engine.rl.env_run_task import EnvRunTask

            limits = EpisodeLimits(max_turns=env.max_turns, max_context_tokens=env.max_context_tokens,
                                   max_tool_s=env.max_tool_s)
            source = cast("QuestionSource", make_chat_task(config))  # a chat task has the source's shape
            environment = make_environment(env.name, source, tool_use_weight=env.tool_use_weight)
            return EnvRunTask(environment, codec, limits)
        return ChatRunTask(make_chat_task(config), codec)
    if env is not None and env.name:
        raise CodecError(f"the {env.name} environment needs a chat task (e.g. --set task.name=reasoning_gym:"
                         "basic_arithmetic) on a chat model")
    if not isinstance(codec, TaskCodec):
        raise CodecError(f"{config.name} is a digit task for the character-level base, but {where} has a "
                         "BPE tokenizer; choose a chat task (e.g. --set task.name=reasoning_gym:chain_sum)")
    return DigitRunTask(make_task(config), codec)
