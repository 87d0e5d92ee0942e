"""The window's live sample of a multi-turn episode: the model's call, the tool's answer, the final
answer and its reward, with the reward-hacking monitor's line; from the node's ``swarm`` event as
the coordinator's stats become it (``engine.swarm.node_status``)."""

from __future__ import annotations

from app.widgets.samples_view import SamplesPanel
from engine import control_protocol
from engine.swarm.node_status import _monitor, _sample

CALL = '<tool_call>{"name": "calculator", "arguments": {"expression": "4821 + 3907"}}</tool_call>'
STATS_SAMPLE = {"prompt": "What is 4821 + 3907?", "answer": "<answer>8728</answer>", "reward": 1.1, "version": 3,
                "turns": [{"role": "assistant", "text": CALL}, {"role": "tool", "text": "8728"},
                          {"role": "assistant", "text": "<answer>8728</answer>"}],
                "tool_calls": 1, "cuts": []}
STATS_MONITOR = {"episodes": 64, "mean_turns": 2.0, "mean_tool_calls": 1.0, "mean_reward": 0.8,
                 "shortcut": {"commonest_share": 0.05, "gold_share": 0.03},
                 "tool_loops": {"turn_cut_share": 0.02}, "suspicious": []}


def test_a_multi_turn_sample_shows_the_call_the_tool_answer_the_final_answer_and_the_reward(qtbot):
    line = control_protocol.encode_event("swarm", policy_version=3, eval=[], reward=[], stages=[],
                                         samples=[_sample(STATS_SAMPLE)], monitor=_monitor(STATS_MONITOR))
    swarm = control_protocol.parse_event(line)  # what the window is handed, validated
    panel = SamplesPanel()
    qtbot.addWidget(panel)
    panel.show_swarm(swarm)
    shown = panel.shown_texts()[0]
    assert "reward 1.10" in shown and "2 turns, 1 tool call" in shown
    assert "Model: <tool_call>" in shown and "Tool: 8728" in shown and "Model: <answer>8728</answer>" in shown
    assert shown.index("Tool: 8728") < shown.index("Model: <answer>8728")
    assert not panel.monitor.isHidden()
    assert panel.monitor.text().startswith("2.0 turns and 1.0 tool calls per episode")
    assert "no shortcut seen" in panel.monitor.text()


def test_a_suspicious_tell_says_what_to_check(qtbot):
    monitor = dict(STATS_MONITOR, suspicious=["shortcut"], shortcut={"commonest_share": 0.6, "gold_share": 0.05})
    line = control_protocol.encode_event("swarm", policy_version=3, eval=[], reward=[], stages=[],
                                         samples=[], monitor=_monitor(monitor))
    panel = SamplesPanel()
    qtbot.addWidget(panel)
    panel.show_swarm(control_protocol.parse_event(line))
    assert "commonest answer 60% (gold 5%)" in panel.monitor.text()
    assert "check for reward hacking: shortcut" in panel.monitor.text()
