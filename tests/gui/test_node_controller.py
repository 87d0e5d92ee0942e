"""The node controller against the scripted node: events become signals, failures are told apart."""

from __future__ import annotations

import sys
from pathlib import Path

from app.node_controller import CrashReport, NodeController, default_node_command

ARGS = ["--lan"]


def test_events_from_the_node_arrive_as_signals_and_stats_rise(qtbot, controllers):
    controller = controllers()
    hellos, states, stats = [], [], []
    controller.hello_received.connect(hellos.append)
    controller.state_changed.connect(lambda s, d: states.append(s))
    controller.stats_received.connect(stats.append)
    controller.start(ARGS)
    qtbot.waitUntil(lambda: len(stats) >= 3, timeout=5000)
    assert hellos and hellos[0]["peer_id"] and controller.hello == hellos[0]
    assert states[-1] == "contributing" and "connecting" in states
    tokens = [s["tokens_generated"] for s in stats]
    assert tokens == sorted(tokens) and tokens[-1] > tokens[0]
    with qtbot.waitSignal(controller.stopped, timeout=5000):
        controller.stop()
    assert not controller.is_running


def test_split_and_invalid_lines_are_skipped_without_breaking_the_stream(qtbot, controllers):
    controller = controllers("--garbage")
    logs, stats = [], []
    controller.log_received.connect(lambda level, msg: logs.append(msg))
    controller.stats_received.connect(stats.append)
    controller.start(ARGS)
    qtbot.waitUntil(lambda: len(stats) >= 2, timeout=5000)
    assert "split line arrived whole" in logs
    assert controller.invalid_lines == 3  # not JSON, a JSON list, an unknown event


def test_a_crash_is_reported_with_exit_code_and_stderr_tail(qtbot, tmp_path: Path, controllers):
    trigger = tmp_path / "crash-now"
    controller = controllers("--crash-when-file", str(trigger))
    stats = []
    controller.stats_received.connect(stats.append)
    controller.start(ARGS)
    qtbot.waitUntil(lambda: len(stats) >= 1, timeout=5000)
    with qtbot.waitSignal(controller.crashed, timeout=5000) as crash:
        trigger.touch()
    report: CrashReport = crash.args[0]
    assert report.exit_code == 1 and not report.killed_by_signal
    assert any("simulated failure" in line for line in report.stderr_tail)
    assert not controller.is_running


def test_a_node_that_ignores_stop_is_terminated_and_counts_as_stopped(qtbot, controllers):
    controller = controllers("--ignore-stop", stop_timeout_s=0.5)
    crashes = []
    controller.crashed.connect(crashes.append)
    stats = []
    controller.stats_received.connect(stats.append)
    controller.start(ARGS)
    qtbot.waitUntil(lambda: len(stats) >= 1, timeout=5000)
    with qtbot.waitSignal(controller.stopped, timeout=5000):
        controller.stop()
    assert not crashes and not controller.is_running


def test_a_missing_node_program_is_reported_as_a_failed_start(qtbot, tmp_path: Path):
    controller = NodeController([str(tmp_path / "no-such-node")])
    with qtbot.waitSignal(controller.start_failed, timeout=5000) as failed:
        controller.start(ARGS)
    assert failed.args[0] and not controller.is_running


def test_a_silent_node_is_reported_unresponsive(qtbot, controllers):
    controller = controllers("--silent", silence_warning_s=0.6)
    with qtbot.waitSignal(controller.unresponsive, timeout=5000) as silent:
        controller.start(ARGS)
    assert silent.args[0] >= 0.6


def test_node_command_comes_from_the_environment_when_set(monkeypatch):
    monkeypatch.setenv("POLIS_NODE_COMMAND", "/opt/polis/bin/polis-node --flag 'two words'")
    assert default_node_command() == ["/opt/polis/bin/polis-node", "--flag", "two words"]
    monkeypatch.delenv("POLIS_NODE_COMMAND")
    assert default_node_command()[:3] == [sys.executable, "-m", "engine.cli"]


def test_a_quiet_paused_node_is_asked_for_status_and_not_reported(qtbot, controllers):
    controller = controllers(silence_warning_s=0.8)
    silent, states = [], []
    controller.unresponsive.connect(silent.append)
    controller.state_changed.connect(lambda s, d: states.append(s))
    controller.start(ARGS)
    qtbot.waitUntil(lambda: "contributing" in states, timeout=5000)
    controller.pause()  # a paused scripted node sends nothing until asked
    qtbot.waitUntil(lambda: states[-1] == "paused", timeout=5000)
    with qtbot.waitSignal(controller.status_received, timeout=5000):
        pass  # the controller's probe gets an answer
    qtbot.wait(1200)
    assert not silent
