"""Diagnostics export: logs, settings and versions go in; keys, tokens and passwords never do."""

from __future__ import annotations

import json
import zipfile
from pathlib import Path

from PySide6.QtCore import Qt

from app.diagnostics import redact

URL_PASSWORD = "hunter2pass"
URL_TOKEN = "qtok77aa88bb"


def test_diagnostics_zip_holds_logs_and_settings_but_no_secret(qtbot, make_window, tmp_path: Path, planted_secrets):
    window = make_window("--leak-secret", swarm_mode="coordinator",
                         coordinator_url=f"https://alice:{URL_PASSWORD}@swarm.example.org/join?token={URL_TOKEN}")
    qtbot.mouseClick(window.hero.button, Qt.MouseButton.LeftButton)
    qtbot.waitUntil(lambda: window.display_state == "contributing", timeout=6000)
    qtbot.waitUntil(lambda: any("auth token" in line for line in window.log_view.lines()), timeout=5000)
    path = window.export_diagnostics_to(tmp_path / "diag")
    with zipfile.ZipFile(path) as archive:
        names = set(archive.namelist())
        contents = {name: archive.read(name).decode("utf-8") for name in names}
    assert {"versions.json", "settings.json", "identity.json", "gui-log.txt", "logs/node.log"} <= names
    everything = "\n".join(contents.values())
    for secret in (*planted_secrets, URL_PASSWORD, URL_TOKEN):
        assert secret not in everything, f"{secret!r} leaked into diagnostics"
    assert "scripted node: swarm=" in contents["logs/node.log"]  # the logs really are there
    assert json.loads(contents["settings.json"])["swarm_mode"] == "coordinator"
    assert "swarm.example.org" in contents["settings.json"]
    assert json.loads(contents["identity.json"])["peer_id"] == window.controller.hello["peer_id"]
    assert json.loads(contents["versions.json"])["packages"]["Qt"]


def test_redact_keeps_ordinary_log_lines():
    line = "INFO stage 2 of 4 ready: 1234 tokens/s, peers=5 at https://swarm.example.org/api"
    assert redact(line) == line
    assert "s3cr3t" not in redact('{"api_key": "s3cr3t", "n": 1}')
    assert "abc.def.ghi-jkl" not in redact("Authorization: Bearer abc.def.ghi-jkl")
