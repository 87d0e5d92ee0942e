"""A multi-turn episode at the token level: one growing context, sampled ids kept, an exact mask,
behaviour log-probs on the model's tokens only, limits cut at the token level."""

from __future__ import annotations

import re

import pytest

from engine.envs.contract import CutKind, EpisodeLimits, run_episode
from engine.envs.token_rollout import Generation, run_token_episode
from engine.envs.tool_env import calculator_environment
from engine.envs.tools import format_tool_call
from engine.envs.trajectory import ChatRenderer
from tests.support.chat_templates import SMOLLM2, render_fn, train_tokenizer
from tests.support.digit_questions import DigitAdditionQuestions


@pytest.fixture(scope="module")
def env():
    return calculator_environment(DigitAdditionQuestions(digits=4, eval_size=6))


@pytest.fixture(scope="module")
def tokenizer(env):
    render = render_fn(SMOLLM2)
    corpus = [render([m.as_dict() for m in item.messages], True) for item in env.eval_items()] * 5
    return train_tokenizer(corpus + ['<tool_call>{"name": "calculator", "arguments": {"expression": "1 + 2"}}'
                                     '</tool_call><answer>3</answer>'])


def _reply(text: str) -> str:
    """The honest calculator policy, read off the rendered context."""
    last = text.rsplit("<|im_start|>", 2)[-2]
    if last.startswith("tool\n"):
        result = last[len("tool\n"):].split("<|im_end|>")[0]
        return f"<answer>{result}</answer>"
    a, b = re.findall(r"What is (\d+) \+ (\d+)\?", text)[-1]
    return format_tool_call("calculator", {"expression": f"{a} + {b}"})


class ScriptedModel:
    """Samples the honest reply; records every context it was given."""

    def __init__(self, tokenizer, finish=True):
        self.tok = tokenizer
        self.finish = finish
        self.contexts, self.turns = [], []

    def __call__(self, context, max_new_tokens):
        self.contexts.append(tuple(context))
        text = self.tok.decode(list(context), skip_special_tokens=False)
        ids = self.tok.encode(_reply(text), add_special_tokens=False).ids
        if self.finish:
            ids = ids + [self.tok.token_to_id("<|im_end|>")]
        finished = self.finish and len(ids) <= max_new_tokens
        ids = ids[:max_new_tokens]
        logprobs = tuple(-0.01 * (len(self.turns) + 1) * (i + 1) for i in range(len(ids)))
        self.turns.append((tuple(ids), logprobs))
        return Generation(tuple(ids), logprobs, finished=finished)


def _run(env, tokenizer, model, limits=None):
    renderer = ChatRenderer(render_fn(SMOLLM2), lambda t: tokenizer.encode(t, add_special_tokens=False).ids,
                            "<|im_end|>")
    decode = lambda ids: tokenizer.decode(list(ids), skip_special_tokens=False)  # noqa: E731
    return run_token_episode(env, env.eval_items()[0], renderer, model, decode, limits=limits or EpisodeLimits())


def test_a_token_episode_ends_like_the_text_episode_with_an_exact_transcript(env, tokenizer):
    model = ScriptedModel(tokenizer)
    out = _run(env, tokenizer, model)
    text_result = run_episode(env, env.eval_items()[0], lambda m: _reply(render_fn(SMOLLM2)(
        [x.as_dict() for x in m], True)))
    assert out.result.parts == text_result.parts == {"answer": 1.0, "format": 0.1, "tool_use": 0.05}
    assert [m.content for m in out.result.messages] == [m.content for m in text_result.messages]
    full = render_fn(SMOLLM2)([m.as_dict() for m in out.result.messages], False)
    assert tokenizer.decode(list(out.trajectory.ids), skip_special_tokens=False) == full


def test_each_context_extends_the_last_so_a_kv_cache_can_be_kept(env, tokenizer):
    model = ScriptedModel(tokenizer)
    out = _run(env, tokenizer, model)
    assert len(model.contexts) == 2
    first, second = model.contexts
    assert second[: len(first)] == first
    assert second[len(first): len(first) + len(model.turns[0][0])] == model.turns[0][0]
    assert out.trajectory.ids[: len(second)] == second


def test_only_sampled_ids_are_trained_and_carry_behaviour_logprobs(env, tokenizer):
    model = ScriptedModel(tokenizer)
    out = _run(env, tokenizer, model)
    spans = out.trajectory.model_spans()
    assert [out.trajectory.ids[s:e] for s, e in spans] == [ids for ids, _ in model.turns]
    assert [out.logprobs[s:e] for s, e in spans] == [lp for _, lp in model.turns]
    assert all(lp == 0.0 for lp, m in zip(out.logprobs, out.trajectory.mask) if not m)
    assert len(out.logprobs) == len(out.trajectory.ids)


def test_a_turn_out_of_tokens_is_an_unfinished_cut(env, tokenizer):
    out = _run(env, tokenizer, ScriptedModel(tokenizer, finish=False))
    assert [c.kind for c in out.result.cuts] == [CutKind.UNFINISHED_TURN]
    assert out.result.reward == 0.0
    assert out.trajectory.mask[-1] == 1  # ends on the model's last sampled token


def test_a_turn_stopped_by_the_context_limit_is_a_context_cut(env, tokenizer):
    probe = ScriptedModel(tokenizer)
    _run(env, tokenizer, probe)
    prompt_len = len(probe.contexts[0])
    model = ScriptedModel(tokenizer)
    out = _run(env, tokenizer, model, EpisodeLimits(max_context_tokens=prompt_len + 5))
    assert len(model.turns) == 1 and len(model.turns[0][0]) == 5  # generation got only the room left
    assert [c.kind for c in out.result.cuts] == [CutKind.CONTEXT_TOKENS]
    assert out.result.cuts[0].reached == prompt_len + 5
    assert out.result.reward == 0.0


def test_a_prompt_with_no_room_left_is_cut_before_any_generation(env, tokenizer):
    probe = ScriptedModel(tokenizer)
    _run(env, tokenizer, probe)
    model = ScriptedModel(tokenizer)
    out = _run(env, tokenizer, model, EpisodeLimits(max_context_tokens=len(probe.contexts[0]) - 1))
    assert model.contexts == []
    assert [c.kind for c in out.result.cuts] == [CutKind.CONTEXT_TOKENS]
    assert out.result.turns == 0 and out.trajectory.trained_tokens == 0
