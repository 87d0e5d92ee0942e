"""Settings: round-trip through QSettings and the dialog, validation, node arguments, start at login."""

from __future__ import annotations

import sys
from dataclasses import replace

import pytest
from PySide6.QtCore import QSettings

from app import autostart
from app.settings import AppSettings, load_settings, node_arguments, save_settings
from app.settings_dialog import SettingsDialog

CUSTOM = AppSettings(swarm_mode="coordinator", coordinator_url="https://swarm.example.org:8443/",
                     limits={"memory_cap_gb": 6.5, "cpu_threads": 3, "gpu_fraction": 0.6, "upload_mbps": 4.0,
                             "download_mbps": None},
                     run_only_when_idle=True, idle_after_min=12.0, run_only_on_ac_power=True,
                     start_at_login=True, consent_given=True, tray_notice_shown=True, generate_only=True)


def test_settings_round_trip_through_qsettings(store):
    save_settings(store, CUSTOM)
    reopened = QSettings(store.fileName(), QSettings.Format.IniFormat)
    assert load_settings(reopened) == CUSTOM.validated()


def test_fresh_store_gives_defaults_and_corrupt_values_fall_back(store):
    assert load_settings(store) == AppSettings().validated()
    store.setValue("swarm/mode", "carrier-pigeon")
    store.setValue("limits/cpu_threads", "many")
    store.setValue("schedule/only_on_ac_power", "true")
    store.setValue("swarm/generate_only", "sometimes")
    loaded = load_settings(store)
    assert loaded.swarm_mode == "lan" and loaded.limits["cpu_threads"] is None and loaded.run_only_on_ac_power
    assert loaded.generate_only is False


@pytest.mark.parametrize("change, words", [
    ({"swarm_mode": "coordinator", "coordinator_url": ""}, "coordinator URL"),
    ({"swarm_mode": "coordinator", "coordinator_url": "ftp://x.org"}, "must start with"),
    ({"limits": {"cpu_threads": 0}}, "cpu_threads"),
    ({"limits": {"warp_drive": 1}}, "unknown limit"),
])
def test_invalid_settings_are_refused_with_the_reason(store, change, words):
    with pytest.raises(ValueError, match=words):
        save_settings(store, replace(AppSettings(), **change))


def test_node_arguments_carry_swarm_and_limits():
    args = node_arguments(CUSTOM)
    assert args[:2] == ["--coordinator", CUSTOM.coordinator_url]
    assert args[args.index("--cpu-threads") + 1] == "3" and "--download-mbps" not in args
    assert node_arguments(AppSettings(swarm_mode="demo")) == ["--demo", "--cpu-threads", "1"]  # the demo recipe


def test_node_arguments_ask_for_inference_only_only_when_generate_only_is_set():
    assert "--inference-only" in node_arguments(CUSTOM)
    assert "--inference-only" not in node_arguments(replace(CUSTOM, generate_only=False))
    assert node_arguments(AppSettings(swarm_mode="demo", generate_only=True)) == ["--demo", "--inference-only",
                                                                                "--cpu-threads", "1"]


def test_settings_dialog_round_trip(qtbot):
    dialog = SettingsDialog(CUSTOM, hello={"peer_id": "p-1", "fingerprint": "SHA256:abc", "key_storage": "file"},
                            idle_supported=True)
    qtbot.addWidget(dialog)
    assert dialog.result_settings() == CUSTOM.validated()
    dialog.mode_buttons["lan"].setChecked(True)
    dialog.limit_checks["memory_cap_gb"].setChecked(False)
    dialog.limit_checks["download_mbps"].setChecked(True)
    dialog.limit_spins["download_mbps"].setValue(25.0)
    dialog.limit_spins["gpu_fraction"].setValue(45)
    dialog.ac_check.setChecked(False)
    assert dialog.generate_only_check.isChecked()
    dialog.generate_only_check.setChecked(False)
    result = dialog.result_settings()
    assert result.swarm_mode == "lan" and result.limits["memory_cap_gb"] is None
    assert result.limits["download_mbps"] == 25.0 and result.limits["gpu_fraction"] == pytest.approx(0.45)
    assert not result.run_only_on_ac_power and not result.generate_only
    assert "file" in dialog.identity_labels["key_storage"].text().lower()


def test_settings_dialog_stays_open_on_a_bad_url(qtbot):
    dialog = SettingsDialog(AppSettings(), idle_supported=False, idle_reason="no idle here")
    qtbot.addWidget(dialog)
    dialog.show()
    dialog.mode_buttons["coordinator"].setChecked(True)
    dialog.url_edit.setText("not a url")
    dialog.accept()
    assert dialog.isVisible() and dialog.error_label.isVisible()
    assert not dialog.idle_check.isEnabled()


def test_saving_settings_in_the_window_persists_and_writes_the_login_entry(qtbot, make_window, store,
                                                                           isolated_user):
    window = make_window()
    window.open_settings()
    dialog = window.settings_dialog
    dialog.login_check.setChecked(True)
    dialog.mode_buttons["demo"].setChecked(True)
    dialog.generate_only_check.setChecked(True)
    dialog.accept()
    assert load_settings(store).start_at_login and load_settings(store).swarm_mode == "demo"
    assert load_settings(store).generate_only and "--inference-only" in node_arguments(window.settings)
    if sys.platform.startswith("linux"):
        entry = isolated_user / ".config" / "autostart" / "polis.desktop"
        assert entry.is_file() and "--minimized" in entry.read_text()


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="writes the freedesktop autostart entry")
def test_linux_autostart_entry_is_written_and_removed(isolated_user):
    command = ["/opt/Polis Apps/polis", "gui", "--minimized", "--start"]
    autostart.set_start_at_login(True, command)
    entry = isolated_user / ".config" / "autostart" / "polis.desktop"
    text = entry.read_text()
    assert autostart.is_start_at_login_enabled()
    assert 'Exec="/opt/Polis Apps/polis" gui --minimized --start' in text and "Type=Application" in text
    autostart.set_start_at_login(False)
    assert not entry.exists() and not autostart.is_start_at_login_enabled()
