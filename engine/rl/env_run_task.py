"""A run task whose episodes run in an environment (``engine.envs``): turns, tools, loss masks.

:class:`EnvRunTask` is the coordinator's :class:`~engine.rl.run_task.RunTask` over an
``Environment`` and the model's chat codec. Prompt keys are an item's opening messages rendered
through the chat template (as for ``ChatRunTask``), so ``prompt_ids(key)`` needs no other state;
the items behind the keys handed out are held in memory, bounded. ``open_episode`` starts a
``TokenEpisodeRun`` (``engine.envs.token_rollout``, the same stepping the in-process runner
uses): each sampled turn is decoded, stepped through the environment (tools run there) and
answered with the context ids to generate after (the template's tail of the turn, the
observation, the next generation prompt). The finished episode's outcome carries every id after
the prompt with its loss mask (model ids 1) and behaviour log-probs (0.0 on context ids).

Held-out scores of an episode: ``strict`` is its ``answer`` part (0 when a limit cut it),
``content`` the same (an environment states its answer one way).

What it does not know: jobs, routes, nodes, messages, the store.
"""

from __future__ import annotations

import logging
from typing import Iterator, Sequence

from engine.envs.contract import Environment, EpisodeItem, EpisodeLimits
from engine.envs.token_rollout import Generation, TokenEpisode, TokenEpisodeRun
from engine.envs.trajectory import ChatRenderer
from engine.rl.codec import ChatCodec, CodecError
from engine.rl.episode_outcome import EpisodeOutcome, EvalScore
from engine.rl.prompt_keys import PromptKeys
from engine.rl.tasks.answers import stated_answer, tagged_answer

log = logging.getLogger(__name__)


class EnvEpisode:
    """One environment episode as the coordinator's turn driver steps it."""

    runs_tools = True

    def __init__(self, run: TokenEpisodeRun, codec: ChatCodec, stop_ids: frozenset[int]) -> None:
        self._run, self._codec, self._stops = run, codec, stop_ids
        self._outcome: EpisodeOutcome | None = None

    @property
    def context_ids(self) -> tuple[int, ...]:
        return self._run.context_ids

    @property
    def budget(self) -> int:
        return self._run.budget

    @property
    def outcome(self) -> EpisodeOutcome | None:
        return self._outcome

    @property
    def tool_s_left(self) -> float:
        return self._run.episode.state.tool_s_left

    def _decode(self, ids: Sequence[int]) -> str:
        body = list(ids[:-1]) if ids and int(ids[-1]) in self._stops else list(ids)
        text = self._codec.decode(body, skip_special=False)
        return text + self._run.renderer.end_of_turn if len(body) < len(ids) else text

    def step(self, ids: Sequence[int], logprobs: Sequence[float], finished: bool) -> tuple[int, ...] | None:
        gen = Generation(tuple(int(i) for i in ids), tuple(float(x) for x in logprobs), bool(finished))
        added = self._run.step(gen, self._decode)
        if added is None:
            assert self._run.outcome is not None
            self._outcome = self._finish(self._run.outcome)
        return added

    def cut_full(self) -> EpisodeOutcome:
        self._outcome = self._finish(self._run.cut_full())
        return self._outcome

    def _finish(self, done: TokenEpisode) -> EpisodeOutcome:
        result, start = done.result, self._run.prompt_len
        item = self._run.episode.state.item
        final = result.final_text
        given = tagged_answer(final, item.answer) or stated_answer(final, item.answer)
        strict = 0.0 if result.cut else float(result.parts.get("answer", result.reward))
        opening = len(item.messages)
        return EpisodeOutcome(
            completion_ids=done.trajectory.ids[start:], loss_mask=done.trajectory.mask[start:],
            logprobs=done.logprobs[start:], reward=result.reward, parts=dict(result.parts),
            score=EvalScore(strict, strict), gold=item.answer, given=given,
            question=item.messages[-1].content,
            transcript=tuple((m.role, m.content) for m in result.messages[opening:]),
            turns=result.turns, tool_calls=result.tool_calls, tool_errors=result.tool_errors,
            tool_s=result.tool_s, cuts=tuple(c.kind.value for c in result.cuts))


class EnvRunTask:
    """Episodes of ``env`` on a chat model (see the module docstring)."""

    def __init__(self, env: Environment, codec: ChatCodec, limits: EpisodeLimits) -> None:
        if codec.template is None:
            raise CodecError(f"the {env.name} environment needs a model with a chat template; "
                             "use an instruction-tuned model (e.g. polis import smollm2-135m)")
        self.env, self.codec, self.limits = env, codec, limits
        self.name = env.name
        self.pad_id = codec.pad_id
        self.stop_ids = (codec.eos_id, *sorted(codec.stop_ids - {codec.eos_id}))
        end_of_turn = codec.tokenizer.id_to_token(codec.eos_id)
        self.renderer = ChatRenderer(lambda messages, gen: codec.render(messages, add_generation_prompt=gen),
                                     codec.encode, end_of_turn)
        self._prompts: PromptKeys[EpisodeItem] = PromptKeys(self.key, codec.encode)
        self.unknown_prompts = 0  #: episodes asked for keys whose item was no longer held

    def key(self, item: EpisodeItem) -> str:
        return self.renderer.prompt_text(item.messages)

    def train_prompts(self, seed: int) -> Iterator[str]:
        return self._prompts.train(self.env.train_items(seed))

    def eval_prompts(self) -> list[str]:
        return self._prompts.held_out(self.env.eval_items)

    def prompt_ids(self, prompt: str) -> list[int]:
        return self._prompts.ids(prompt)

    def open_episode(self, prompt: str, max_new_tokens: int) -> EnvEpisode:
        item = self._prompts.item(prompt)
        if item is None:
            self.unknown_prompts += 1
            raise KeyError("no environment item for this prompt key (it left the bounded item table)")
        run = TokenEpisodeRun(self.env, item, self.renderer, self.limits, max_new_tokens=max_new_tokens)
        return EnvEpisode(run, self.codec, frozenset(self.codec.stop_ids))
