"""The window tells the truth: alone on the network it waits (amber, no time counted) and offers
the local demo; one click runs it; labels agree after a restart; the log reads as words."""

from __future__ import annotations

from PySide6.QtCore import Qt

from app.settings import load_settings
from app.widgets.hero import PAUSE_TEXT


def _start(qtbot, window) -> None:
    qtbot.mouseClick(window.hero.button, Qt.MouseButton.LeftButton)


def test_alone_on_the_lan_waits_for_stage_2_counts_no_time_and_the_demo_is_one_click(qtbot, make_window, store):
    window = make_window("--alone-unless-demo", swarm_mode="lan")
    _start(qtbot, window)
    qtbot.waitUntil(lambda: window.display_state == "waiting_for_peers", timeout=6000)
    qtbot.wait(600)  # several stats events with nothing done
    assert window.display_state == "waiting_for_peers"
    assert window.hero.headline.startswith("Waiting for a computer to serve stage 1")
    assert "none found on your network" in window.hero.headline
    assert window.cards["uptime_s"].session_text == "0 s"
    assert window.tray.state == "waiting"
    assert window.hero.action_button.isVisibleTo(window) and "local demo" in window.hero.action_button.text()
    qtbot.mouseClick(window.hero.action_button, Qt.MouseButton.LeftButton)
    assert load_settings(store).swarm_mode == "demo"
    assert window.display_state == "restarting" and window.hero.button.text() == PAUSE_TEXT
    qtbot.waitUntil(lambda: window.display_state == "contributing", timeout=8000)
    assert window.swarm_panel.values["swarm"].text().startswith("Local demo swarm")
    assert not window.hero.action_button.isVisibleTo(window)
    qtbot.waitUntil(lambda: window.ledger.session["uptime_s"] > 0, timeout=5000)


def test_saving_a_new_swarm_keeps_showing_the_running_one_until_the_restart(qtbot, make_window):
    from dataclasses import replace

    window = make_window(swarm_mode="lan")
    _start(qtbot, window)
    qtbot.waitUntil(lambda: window.display_state == "contributing", timeout=6000)
    window.apply_settings(replace(window.settings, swarm_mode="demo"))
    assert window.swarm_panel.values["swarm"].text().startswith("Local network")
    window.banner.buttons["restart"].click()
    assert window.display_state == "restarting" and window.hero.headline == "Restarting"
    assert window.hero.button.text() == PAUSE_TEXT
    qtbot.waitUntil(lambda: window.display_state == "contributing", timeout=8000)
    assert window.swarm_panel.values["swarm"].text().startswith("Local demo swarm")


def test_peers_agree_with_the_pipeline_and_layers_appear_once(qtbot, make_window):
    window = make_window()
    _start(qtbot, window)
    qtbot.waitUntil(lambda: window.display_state == "contributing" and bool(window.pipeline.stages), timeout=6000)
    replicas = sum(stage.replicas for stage in window.pipeline.stages)
    assert window.swarm_panel.values["peers"].text() == str(replicas - 1)
    hero_text = " ".join([window.hero.detail_label.text(), window.hero.summary_label.text()])
    assert hero_text.count("layers 3–4 of 8") == 1


def test_the_log_has_one_timestamp_no_stream_prefix_and_chatter_only_in_details(qtbot, make_window):
    window = make_window("--chatter")
    _start(qtbot, window)
    qtbot.waitUntil(lambda: any("Connected to computer 3f9a1c2b" in line for line in window.log_view.shown_lines()),
                    timeout=6000)
    shown = window.log_view.shown_lines()
    assert not any("aioice" in line or "STDERR" in line.upper() or "closed (local)" in line for line in shown)
    assert all(line.count(":") >= 2 and not line[9:].lstrip()[:4].isdigit() for line in shown if line)
    window.log_view.details_box.setChecked(True)
    detailed = window.log_view.shown_lines()
    assert any("aioice" in line for line in detailed)
    assert any("Closed an old connection to computer 3f9a1c2b" in line for line in detailed)


def _starts_at_zero(plot) -> bool:
    """Both axes begin at 0 (a hair below it, so that the 0 tick is labelled), never around 0."""
    (x0, x1), (y0, y1) = plot.viewRange()
    return -0.02 * x1 <= x0 <= 0 and -0.06 * y1 <= y0 <= 0


def test_charts_start_at_zero_and_label_the_latest_values(qtbot, make_window):
    window = make_window()
    chart = window.swarm_chart
    assert _starts_at_zero(chart.plot) and chart.plot.viewRange()[1][1] >= 1.0  # before any data too
    _start(qtbot, window)
    qtbot.waitUntil(lambda: chart.point_count() > 1, timeout=6000)
    assert _starts_at_zero(chart.plot)
    labels = chart.latest_labels
    assert len(labels) == 2 and labels[0].split(" at v")[0].endswith("%")
    assert "partial credit" in chart.caption_label.text() and "exact" in chart.toolTip()
    assert _starts_at_zero(window.throughput_chart.plot)
    assert window.throughput_chart.latest_labels[0].endswith(" now")
    assert "tokens per second" in window.throughput_chart.legend_label.text()
