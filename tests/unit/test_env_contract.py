"""The episode contract: limits cut and are recorded, cuts pay nothing, one-turn tasks fit it."""

from __future__ import annotations

import itertools

import pytest

from engine.envs.contract import (
    CutKind,
    Environment,
    EpisodeItem,
    EpisodeLimits,
    EpisodeState,
    Message,
    TaskEnvironment,
    run_episode,
)
from engine.rl.tasks import RewardKind, TaskConfig, make_task


class _EchoEnv(Environment):
    """Answers every turn that says 'more' with an observation; 'done' ends it. Scores 1 + 0.1."""

    name = "echo"

    def __init__(self, tool_s_per_turn: float = 0.0) -> None:
        self.tool_s_per_turn = tool_s_per_turn

    def train_items(self, seed):
        for i in itertools.count():
            yield EpisodeItem(f"echo/{seed}/{i}", (Message("user", "go"),), "done")

    def eval_items(self):
        return [EpisodeItem("echo/eval/0", (Message("user", "go"),), "done", held_out=True)]

    def respond(self, state: EpisodeState, model_text: str):
        if model_text == "done":
            return None
        state.note_tool(self.tool_s_per_turn, ok=True)
        return Message("tool", f"observation {state.turns}")

    def score(self, state):
        return {"answer": 1.0 if state.messages[-1].content == "done" else 0.0, "format": 0.1}


def _item():
    return next(_EchoEnv().train_items(0))


def test_an_episode_alternates_model_turns_and_observations_until_the_model_finishes():
    replies = iter(["more", "more", "done"])
    result = run_episode(_EchoEnv(), _item(), lambda messages: next(replies), EpisodeLimits(max_turns=4))
    assert [m.role for m in result.messages] == ["user", "assistant", "tool", "assistant", "tool", "assistant"]
    assert result.turns == 3 and result.tool_calls == 2
    assert result.cuts == ()
    assert result.parts == {"answer": 1.0, "format": 0.1}
    assert result.reward == pytest.approx(1.1)
    assert result.final_text == "done"


def test_running_out_of_turns_is_a_recorded_cut_that_pays_nothing():
    result = run_episode(_EchoEnv(), _item(), lambda m: "more", EpisodeLimits(max_turns=3))
    assert result.turns == 3
    assert [c.kind for c in result.cuts] == [CutKind.TURNS]
    assert result.cuts[0].limit == 3 and result.cuts[0].turn == 3
    assert result.reward == 0.0
    assert result.parts["format"] == 0.1  # reported, not paid


def test_too_many_context_tokens_is_a_recorded_cut():
    episode = _EchoEnv().start(_item(), EpisodeLimits(max_context_tokens=100))
    assert not episode.step("more", context_tokens=60).done
    step = episode.step("done", context_tokens=120)
    assert step.done
    assert step.result.cuts[0].kind is CutKind.CONTEXT_TOKENS
    assert step.result.cuts[0].reached == 120
    assert step.result.reward == 0.0


def test_tool_time_past_the_budget_is_a_recorded_cut():
    result = run_episode(_EchoEnv(tool_s_per_turn=4.0), _item(), lambda m: "more",
                         EpisodeLimits(max_turns=10, max_tool_s=10.0))
    assert result.cuts[0].kind is CutKind.TOOL_S
    assert result.turns == 3 and result.tool_s == pytest.approx(12.0)
    assert result.reward == 0.0


def test_a_turn_that_hit_its_token_budget_is_a_recorded_cut():
    episode = _EchoEnv().start(_item())
    step = episode.step("do", finished=False)
    assert step.result.cuts[0].kind is CutKind.UNFINISHED_TURN
    assert step.result.reward == 0.0


def test_a_finished_episode_takes_no_more_turns():
    episode = _EchoEnv().start(_item())
    episode.step("done")
    with pytest.raises(RuntimeError):
        episode.step("more")


def test_limits_are_validated():
    for bad in (dict(max_turns=0), dict(max_context_tokens=1), dict(max_tool_s=0)):
        with pytest.raises(ValueError):
            EpisodeLimits(**bad)


def test_an_item_must_leave_the_next_turn_to_the_model():
    with pytest.raises(ValueError):
        EpisodeItem("x", (Message("assistant", "hi"),), "a")
    with pytest.raises(ValueError):
        Message("robot", "hi")


@pytest.mark.parametrize("name, reward", [("reversal", RewardKind.PER_POSITION), ("addition", RewardKind.EXACT)])
def test_a_single_turn_task_is_the_one_turn_case_with_the_tasks_own_reward(name, reward):
    task = make_task(TaskConfig(name=name, min_digits=3, max_digits=4, reward=reward, eval_size=20))
    env = TaskEnvironment(task)
    items = list(itertools.islice(env.train_items(seed=7), 10)) + env.eval_items()[:5]
    assert [i.item_id for i in items[:10]] == [ex.prompt for ex in itertools.islice(task.train_stream(7), 10)]
    for k, item in enumerate(items):
        for reply in (item.answer, item.answer[::-1], "", "12x"):
            result = run_episode(env, item, lambda messages: reply)
            assert result.turns == 1 and result.cuts == ()
            assert result.reward == task.reward_text(item.messages[-1].content, reply)
        assert item.held_out == (k >= 10)
