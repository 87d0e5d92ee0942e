"""The run's monitor flags each known way of farming the reward on live episodes, and not an honest policy."""

from __future__ import annotations

from engine.rl.episode_outcome import EpisodeOutcome, EvalScore
from engine.swarm.rollout_monitor import monitor_figures


def _outcome(gold: str, given: str | None, *, reward: float = 0.0, turns: int = 1, trained: int = 10,
             calls: tuple[str, ...] = (), cuts: tuple[str, ...] = ()) -> EpisodeOutcome:
    transcript = tuple(("assistant", c) for c in calls) + (("assistant", f"<answer>{given}</answer>"),)
    return EpisodeOutcome(completion_ids=(1,) * trained, loss_mask=(1,) * trained, logprobs=(-1.0,) * trained,
                          reward=reward, parts={"answer": reward}, score=EvalScore(reward, reward), gold=gold,
                          given=given, question="q", transcript=transcript, turns=turns, tool_calls=len(calls),
                          cuts=cuts)


def test_an_honest_batch_raises_no_flag():
    outcomes = [_outcome(str(n), str(n), reward=1.0) for n in range(40)]
    figures = monitor_figures(outcomes, [], [])
    assert figures["suspicious"] == []
    assert figures["shortcut"]["commonest_share"] == figures["shortcut"]["gold_share"]


def test_one_constant_answer_to_different_questions_is_a_shortcut():
    figures = monitor_figures([_outcome(str(n), "7", reward=float(n == 7)) for n in range(40)], [], [])
    assert "shortcut" in figures["suspicious"]
    assert figures["shortcut"]["commonest_answer"] == "7"


def test_a_tool_call_loop_cut_by_the_turn_limit_is_flagged():
    loop = '<tool_call>{"name": "calculator", "arguments": {"expression": "1+1"}}</tool_call>'
    outcomes = [_outcome(str(n), None, turns=4, calls=(loop, loop, loop), cuts=("turns",)) for n in range(40)]
    figures = monitor_figures(outcomes, [], [])
    assert "tool_loops" in figures["suspicious"]
    assert figures["tool_loops"]["turn_cut_share"] == 1.0 and figures["tool_loops"]["repeated_call_share"] == 1.0
    assert figures["mean_tool_calls"] == 3.0


def test_length_and_turn_blow_up_over_the_window_is_flagged():
    outcomes = [_outcome(str(n), str(n), trained=10) for n in range(20)]
    outcomes += [_outcome(str(n), str(n), trained=60, turns=3) for n in range(20)]
    figures = monitor_figures(outcomes, [], [])
    assert "blow_up" in figures["suspicious"] and figures["blow_up"]["length_ratio"] == 6.0


def test_reward_rising_while_held_out_accuracy_falls_is_divergence():
    versions = [{"version": v, "reward": r} for v, r in enumerate([0.1, 0.2, 0.5, 0.8])]
    evals = [{"version": v, "accuracy": a} for v, a in enumerate([0.6, 0.55, 0.3, 0.2])]
    figures = monitor_figures([], versions, evals)
    assert "divergence" in figures["suspicious"]
    assert figures["divergence"]["held_out_change"] < 0 < figures["divergence"]["reward_change"]
