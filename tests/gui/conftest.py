"""Fixtures for the GUI tests: offscreen Qt, an isolated user (settings, data, autostart
folders under tmp_path) and main windows wired to the scripted stand-in node."""

from __future__ import annotations

import os

os.environ.setdefault("QT_QPA_PLATFORM", "offscreen")

import importlib.util  # noqa: E402
import sys  # noqa: E402
from dataclasses import replace  # noqa: E402
from pathlib import Path  # noqa: E402
from typing import Callable  # noqa: E402

import pytest  # noqa: E402
from PySide6.QtCore import QSettings  # noqa: E402

from app.contribution import ContributionLedger  # noqa: E402
from app.main_window import MainWindow  # noqa: E402
from app.node_controller import NodeController  # noqa: E402
from app.power_policy import MachineState  # noqa: E402
from app.settings import load_settings, save_settings  # noqa: E402

SCRIPTED_NODE = Path(__file__).with_name("scripted_node.py")


def scripted_command(*options: str) -> list[str]:
    """The scripted node as a node command; ``options`` are its own misbehaviour switches."""
    return [sys.executable, str(SCRIPTED_NODE), *options]


@pytest.fixture
def node_command() -> Callable[..., list[str]]:
    """``node_command(*options)``: the scripted node as a node command."""
    return scripted_command


@pytest.fixture
def planted_secrets() -> list[str]:
    """What the scripted node prints to stderr with ``--leak-secret``: none of it may reach diagnostics."""
    spec = importlib.util.spec_from_file_location("scripted_node_for_secrets", SCRIPTED_NODE)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return [module.FAKE_PRIVATE_KEY.splitlines()[1], module.FAKE_TOKEN, "BEGIN PRIVATE KEY"]


@pytest.fixture
def fake_machine() -> "FakeMachine":
    return FakeMachine()


@pytest.fixture
def controllers(qtbot):
    """Make NodeControllers over the scripted node; any still running at the end are killed."""
    made: list[NodeController] = []

    def factory(*options: str, stop_timeout_s: float = 2.0, **kwargs) -> NodeController:
        controller = NodeController(scripted_command(*options), stop_timeout_s=stop_timeout_s,
                                    kill_timeout_s=1.0, **kwargs)
        made.append(controller)
        return controller

    yield factory
    for controller in made:
        controller.kill_now()


@pytest.fixture(autouse=True)
def isolated_user(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """Every GUI test runs as a fresh user: data dir, config dir and QSettings under tmp_path."""
    home = tmp_path / "home"
    home.mkdir()
    monkeypatch.setenv("HOME", str(home))
    monkeypatch.setenv("XDG_CONFIG_HOME", str(home / ".config"))
    monkeypatch.setenv("POLIS_DATA_DIR", str(tmp_path / "data"))
    monkeypatch.delenv("POLIS_NODE_COMMAND", raising=False)
    QSettings.setPath(QSettings.Format.IniFormat, QSettings.Scope.UserScope, str(home / ".config"))
    return home


@pytest.fixture
def store(tmp_path: Path) -> QSettings:
    return QSettings(str(tmp_path / "settings.ini"), QSettings.Format.IniFormat)


class FakeMachine:
    """What the schedule sees; tests flip these fields."""

    def __init__(self) -> None:
        self.on_battery: bool | None = False
        self.idle_s: float | None = None

    def __call__(self) -> MachineState:
        return MachineState(on_battery=self.on_battery, battery_percent=55.0, idle_s=self.idle_s)


@pytest.fixture
def make_window(qtbot, store: QSettings, tmp_path: Path) -> Callable[..., MainWindow]:
    created: list[MainWindow] = []

    def factory(*node_options: str, consent: bool = True, tray_available: bool = False,
                machine: FakeMachine | None = None, **settings_changes) -> MainWindow:
        settings = replace(load_settings(store), consent_given=consent, **settings_changes)
        save_settings(store, settings)
        controller = NodeController(scripted_command(*node_options), log_path=tmp_path / "logs" / "node.log",
                                    stop_timeout_s=2.0, kill_timeout_s=1.0)
        window = MainWindow(store, controller=controller, ledger=ContributionLedger(tmp_path / "contribution.json"),
                            log_dir=tmp_path / "logs", tray_available=tray_available,
                            machine_state=machine or FakeMachine(), schedule_interval_s=0.1)
        qtbot.addWidget(window)
        window.show()
        created.append(window)
        return window

    yield factory
    for window in created:
        window.controller.kill_now()
