"""The main window driven by the scripted node: consent, Start/Pause, live cards, crash and
restart, limits reaching the node, the schedule, closing to the tray."""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path

from PySide6.QtCore import Qt

from app import formatting
from app.settings import load_settings
from app.widgets.hero import PAUSE_TEXT, START_TEXT


def _click_start(qtbot, window) -> None:
    qtbot.mouseClick(window.hero.button, Qt.MouseButton.LeftButton)


def _wait_contributing(qtbot, window) -> None:
    qtbot.waitUntil(lambda: window.display_state == "contributing", timeout=6000)


def test_first_start_asks_for_consent_and_remembers_it(qtbot, make_window, store):
    window = make_window(consent=False)
    _click_start(qtbot, window)
    assert window.welcome is not None and window.welcome.isVisible()
    assert not window.controller.is_running
    window.welcome.decline_button.click()
    assert not window.controller.is_running and not load_settings(store).consent_given
    _click_start(qtbot, window)
    window.welcome.agree_button.click()
    assert window.controller.is_running
    assert load_settings(store).consent_given
    _wait_contributing(qtbot, window)


def test_start_fills_cards_status_charts_and_pipeline_from_node_events(qtbot, make_window):
    window = make_window()
    stats = []
    window.controller.stats_received.connect(stats.append)
    _click_start(qtbot, window)
    _wait_contributing(qtbot, window)
    qtbot.waitUntil(lambda: bool(window.pipeline.stages) and window.swarm_chart.point_count() > 0, timeout=6000)
    first_tokens = window.ledger.session["tokens_generated"]
    qtbot.waitUntil(lambda: window.ledger.session["tokens_generated"] > first_tokens, timeout=5000)
    last = stats[-1]
    assert window.cards["tokens_generated"].session_text == formatting.count(last["tokens_generated"])
    assert window.cards["bytes_sent"].session_text == formatting.data_size(last["bytes_sent"])
    assert window.cards["points"].all_time_text == formatting.count(last["points"])
    hello = window.controller.hello
    assert hello["device"] in window.device_label.text()
    assert window.swarm_panel.values["stage"].text().startswith("layers")
    assert window.swarm_panel.values["peers"].text() != "–"
    assert sum(stage.mine for stage in window.pipeline.stages) == 1
    assert len(list(window.throughput_chart.samples())) > 0
    assert window.hero.button.text() == PAUSE_TEXT
    # what is being trained, and the newest sample answer first
    samples = window.overview.samples
    assert samples.model_label.text() == "Training smollm2-135m (135 M parameters) on reasoning_gym:chain_sum"
    qtbot.waitUntil(lambda: len(samples.shown_texts()) >= 2, timeout=6000)
    shown = samples.shown_texts()
    versions = [int(text.split(" ", 1)[0][1:]) for text in shown]
    assert versions == sorted(versions, reverse=True) and len(set(versions)) == len(versions)
    assert "Q: What is" in shown[0] and "<answer>" in shown[0] and samples.waiting.isHidden()


def test_pause_stops_the_node_cleanly_and_keeps_the_totals(qtbot, make_window, tmp_path):
    window = make_window()
    _click_start(qtbot, window)
    _wait_contributing(qtbot, window)
    qtbot.waitUntil(lambda: window.ledger.session["tokens_generated"] > 0, timeout=5000)
    with qtbot.waitSignal(window.controller.stopped, timeout=6000):
        _click_start(qtbot, window)  # the same button now reads "Pause"
    assert not window.controller.is_running and window.display_state == "paused"
    assert not window.banner.isVisible()
    tokens = window.ledger.session["tokens_generated"]
    assert tokens > 0 and window.cards["tokens_generated"].session_text == formatting.count(tokens)
    assert (tmp_path / "contribution.json").read_text().count("tokens_generated") == 1
    assert window.hero.button.text() == START_TEXT


def test_a_crash_is_reported_in_plain_words_and_restart_recovers(qtbot, make_window, tmp_path):
    trigger = tmp_path / "crash-now"
    window = make_window("--crash-when-file", str(trigger))
    _click_start(qtbot, window)
    _wait_contributing(qtbot, window)
    trigger.touch()
    qtbot.waitUntil(lambda: window.display_state == "error", timeout=6000)
    assert window.banner.isVisible() and window.banner.kind == "error"
    assert "stopped unexpectedly" in window.banner.title_label.text()
    assert "simulated failure" in window.banner.detail_label.text()
    assert any("simulated failure" in line for line in window.log_view.lines())
    trigger.unlink()
    qtbot.mouseClick(window.banner.buttons["restart"], Qt.MouseButton.LeftButton)
    _wait_contributing(qtbot, window)
    assert not window.banner.isVisible()
    assert any("simulated failure" in line for line in window.log_view.lines())  # the log is kept


def test_limits_reach_the_node_at_start_and_while_running(qtbot, make_window):
    window = make_window(limits={"upload_mbps": 3.5, "cpu_threads": 2})
    statuses = []
    window.controller.status_received.connect(statuses.append)
    _click_start(qtbot, window)
    qtbot.waitUntil(lambda: bool(statuses), timeout=6000)
    echoed = statuses[-1]["limits"]
    assert echoed["upload_mbps"] == 3.5 and echoed["cpu_threads"] == 2 and echoed["download_mbps"] is None
    new_limits = {**window.settings.limits, "download_mbps": 12.0, "upload_mbps": None}
    window.apply_settings(replace(window.settings, limits=new_limits))
    qtbot.waitUntil(lambda: statuses[-1]["limits"]["download_mbps"] == 12.0, timeout=5000)
    assert statuses[-1]["limits"]["upload_mbps"] is None and statuses[-1]["limits"]["cpu_threads"] == 2


def test_changing_generate_only_while_running_says_it_applies_at_the_next_start(qtbot, make_window):
    window = make_window()
    _click_start(qtbot, window)
    _wait_contributing(qtbot, window)
    window.apply_settings(replace(window.settings, generate_only=True))
    assert window.banner.isVisible() and "only generate" in window.banner.detail_label.text()
    assert "restart" in window.banner.buttons
    window.swarm_panel.update_status({"role": "inference"})
    assert window.swarm_panel.values["role"].text().startswith("Generating only")


def test_schedule_pauses_on_battery_and_resumes_on_ac_power(qtbot, make_window, fake_machine):
    machine = fake_machine
    window = make_window(machine=machine, run_only_on_ac_power=True)
    _click_start(qtbot, window)
    _wait_contributing(qtbot, window)
    machine.on_battery = True
    qtbot.waitUntil(lambda: window.controller.node_state == "paused", timeout=5000)
    assert window.display_state == "schedule_hold" and "battery" in window.hero.detail_label.text()
    machine.on_battery = False
    qtbot.waitUntil(lambda: window.controller.node_state == "contributing", timeout=5000)
    qtbot.waitUntil(lambda: window.display_state == "contributing", timeout=5000)  # green again once work flows


def test_closing_the_window_while_contributing_hides_it_to_the_tray(qtbot, make_window, store):
    window = make_window(tray_available=True)
    _click_start(qtbot, window)
    _wait_contributing(qtbot, window)
    window.close()
    assert not window.isVisible() and window.controller.is_running
    assert load_settings(store).tray_notice_shown
    assert window.tray.state == "contributing"
    with qtbot.waitSignal(window.controller.stopped, timeout=6000):
        window.tray.quit_action.trigger()
    assert not window.controller.is_running


def test_node_log_file_records_stderr(qtbot, make_window, tmp_path: Path):
    window = make_window()
    _click_start(qtbot, window)
    _wait_contributing(qtbot, window)
    text = (tmp_path / "logs" / "node.log").read_text()
    assert "scripted node: swarm=lan" in text and "starting node" in text
