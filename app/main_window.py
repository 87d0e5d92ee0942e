"""The main window: wires the node controller, the settings, the schedule and the tray to the widgets.

Start asks for first-run consent, then launches the node with the settings' arguments;
Pause stops it cleanly: the node process ends and the computer is free (in demo mode
the demo swarm's processes end with it). Every user action and node event goes
through one ``app.run_state.RunState``, whose view drives the status line, the button,
the tray and the swarm fields, so they cannot disagree. Events also update the cards,
charts, pipeline and log; a crash, a failed launch or a silent node shows a banner in
plain words with Restart. The schedule (idle / AC power) holds a running node with the
protocol's ``pause`` command (shown as "Waiting", never "Paused") and releases it.
Closing the window hides it to the tray while contributing; Quit stops the
node, then exits. Nothing here blocks: every step is a signal or a timer.
"""

from __future__ import annotations

import logging
import time
from dataclasses import replace
from pathlib import Path
from typing import Any, Callable

from PySide6.QtCore import QSettings, QTimer
from PySide6.QtGui import QCloseEvent
from PySide6.QtWidgets import (
    QApplication,
    QFileDialog,
    QMainWindow,
    QTabWidget,
    QVBoxLayout,
    QWidget,
)

from app import autostart, diagnostics, error_hints
from app.contribution import ContributionLedger
from app.icons import app_icon
from app.model_export import ModelExportAction
from app.node_controller import CrashReport, NodeController
from app.power_policy import IdleDetector, MachineState, battery_state, may_run, read_machine_state
from app.run_state import START_WORDS, RunState, RunView
from app.settings import SWARM_MODE_LABELS, AppSettings, load_settings, node_arguments, save_settings
from app.settings_dialog import SettingsDialog
from app.style import style_sheet
from app.tray import TrayIcon
from app.welcome_dialog import WelcomeDialog
from app.widgets.banner import MessageBanner
from app.widgets.header import Header
from app.widgets.log_view import LogView
from app.widgets.overview import OverviewPage

log = logging.getLogger(__name__)


class MainWindow(QMainWindow):
    def __init__(self, store: QSettings, *, controller: NodeController | None = None,
                 ledger: ContributionLedger, log_dir: Path | None = None, tray_available: bool | None = None,
                 idle_detector: IdleDetector | None = None,
                 machine_state: Callable[[], MachineState] | None = None,
                 schedule_interval_s: float = 15.0) -> None:
        super().__init__()
        self.store = store
        self.settings: AppSettings = load_settings(store)
        self.ledger = ledger
        self.log_dir = log_dir
        self.controller = controller or NodeController(log_path=(log_dir / "node.log") if log_dir else None)
        self.controller.setParent(self)
        self.idle_detector = idle_detector
        self._machine_state = machine_state or (lambda: read_machine_state(self.idle_detector))
        self.run = RunState(self.settings.swarm_mode)
        self.schedule_paused = False
        self._quitting = False
        self.welcome: WelcomeDialog | None = None
        self._key_notice_shown = False
        self._last_hello: dict[str, Any] | None = None
        self.settings_dialog: SettingsDialog | None = None
        self._node_mode: str | None = None  # the swarm mode the running node was started with
        self.setWindowTitle("Polis")
        self.setWindowIcon(app_icon())
        self.setStyleSheet(style_sheet())
        self.resize(1180, 900)
        self._build()
        self.tray = TrayIcon(self, available=tray_available)
        self.tray.show_requested.connect(self.bring_to_front)
        self.tray.toggle_requested.connect(self.toggle)
        self.tray.quit_requested.connect(self.quit_app)
        self._connect_controller()
        self._schedule_timer = QTimer(self)
        self._schedule_timer.setInterval(int(schedule_interval_s * 1000))
        self._schedule_timer.timeout.connect(self.apply_schedule)
        self._schedule_timer.start()
        self._tick_timer = QTimer(self)
        self._tick_timer.setInterval(5000)
        self._tick_timer.timeout.connect(self._on_tick)
        self._tick_timer.start()
        self._refresh_cards()
        self._render()

    @property
    def display_state(self) -> str:
        """The run's phase (``app.run_state.PHASES``), e.g. ``contributing`` only while work is done."""
        return self.run.phase

    @property
    def view(self) -> RunView:
        return self.run.view()

    # -- layout ---------------------------------------------------------------------------

    def _build(self) -> None:
        root = QWidget()
        outer = QVBoxLayout(root)
        outer.setContentsMargins(24, 18, 24, 16)
        outer.setSpacing(14)
        self.header = Header()
        self.header.settings_clicked.connect(self.open_settings)
        self.device_label, self.settings_button = self.header.device_label, self.header.settings_button
        outer.addWidget(self.header)
        self.banner = MessageBanner()
        self.banner.action_clicked.connect(self._on_banner_action)
        outer.addWidget(self.banner)
        self.tabs = QTabWidget()
        outer.addWidget(self.tabs, 1)
        self.overview = OverviewPage()
        self.overview.hero.toggle_clicked.connect(self.toggle)
        self.overview.hero.action_clicked.connect(self._on_hero_action)
        # the parts tests and the tray look at directly
        self.hero, self.cards, self.swarm_panel = self.overview.hero, self.overview.cards, self.overview.swarm_panel
        self.swarm_chart, self.throughput_chart = self.overview.swarm_chart, self.overview.throughput_chart
        self.pipeline = self.overview.pipeline
        self.tabs.addTab(self.overview, "Overview")
        self.log_view = LogView()
        self.log_view.export_requested.connect(self._on_export_requested)
        self.tabs.addTab(self.log_view, "Log")
        self.setCentralWidget(root)
        # the owner of a local demo swarm can write its model to a folder (the node does the work)
        self.model_export = ModelExportAction(self, self.controller, lambda: self._node_mode == "demo")
        self.model_export.message.connect(self.log_view.append)
        self.menuBar().addMenu("&Model").addAction(self.model_export.action)

    def _connect_controller(self) -> None:
        c = self.controller
        c.hello_received.connect(self._on_hello)
        c.state_changed.connect(self._on_node_state)
        c.status_received.connect(self._on_status)
        c.stats_received.connect(self._on_stats)
        c.swarm_received.connect(self._on_swarm)
        c.log_received.connect(self.log_view.append)
        c.stderr_line.connect(self.log_view.append_stderr)
        c.error_received.connect(self._on_node_error)
        c.running_changed.connect(self._on_running_changed)
        c.stopped.connect(self._on_stopped)
        c.crashed.connect(self._on_crashed)
        c.start_failed.connect(self._on_start_failed)
        c.unresponsive.connect(self._on_unresponsive)

    # -- user actions ---------------------------------------------------------------------

    def toggle(self) -> None:
        """The big button (and the tray's item): what the run state's view says it does now."""
        action = self.run.view().button_action
        if action == "pause" and self.controller.is_running and not self.controller.is_stopping:
            self.pause_node()
        elif action == "start" and not self.controller.is_running:
            self.request_start()

    def request_start(self) -> None:
        """Start, after first-run consent (the welcome dialog) if it was not given yet."""
        if not self.settings.consent_given:
            if self.welcome is None:
                self.welcome = WelcomeDialog(self)
                self.welcome.accepted.connect(self._on_consent)
                self.welcome.rejected.connect(lambda: self.banner.show_message(
                    "info", "Polis will not use this computer until you agree",
                    "Nothing was started.", "Press Start again when you want to read the explanation again."))
            self.welcome.open()
            return
        self.start_node()

    def _on_consent(self) -> None:
        self._update_settings(replace(self.settings, consent_given=True))
        self.start_node()

    def start_node(self) -> None:
        if not self.settings.consent_given:
            raise RuntimeError("start_node called without the user's consent")
        self.banner.clear()
        self.schedule_paused = False
        self.run.start(self.settings.swarm_mode)
        self._node_mode = self.settings.swarm_mode
        self.log_view.append("info", f"Starting the node: {START_WORDS.get(self.settings.swarm_mode, '')}.")
        self.controller.start(node_arguments(self.settings))
        self._render()

    def pause_node(self) -> None:
        """Pause: the node leaves the swarm and its process ends, so the computer is free."""
        self.run.pause()
        self.controller.stop()
        self._render()

    def restart_node(self) -> None:
        self.banner.clear()
        self.schedule_paused = False
        self.run.restart(self.settings.swarm_mode)
        self._node_mode = self.settings.swarm_mode
        self.controller.restart(node_arguments(self.settings))
        self._render()

    def run_local_demo(self) -> None:
        """The hero's "Run a local demo instead": switch the swarm setting to the demo and (re)start."""
        self._update_settings(replace(self.settings, swarm_mode="demo"))
        self.run.set_settings_mode("demo")
        self.log_view.append("info", "Switching to a local demo swarm on this computer.")
        if self.controller.is_running:
            self.restart_node()
        else:
            self.request_start()

    def bring_to_front(self) -> None:
        self.showNormal()
        self.raise_()
        self.activateWindow()

    def open_settings(self) -> None:
        on_battery, _ = battery_state()
        idle = self.idle_detector
        self.settings_dialog = SettingsDialog(
            self.settings, hello=self.controller.hello or self._last_hello,
            idle_supported=bool(idle and idle.supported),
            idle_reason=idle.unsupported_reason if idle else "Idle detection is not available.",
            has_battery=on_battery, parent=self)
        self.settings_dialog.accepted.connect(lambda: self.apply_settings(self.settings_dialog.result_settings()))
        self.settings_dialog.open()

    def apply_settings(self, new: AppSettings) -> None:
        """Save new settings and apply them: limits to a running node now, login entry, schedule."""
        old = self.settings
        self._update_settings(new)
        self.run.set_settings_mode(self.settings.swarm_mode)
        self._render()
        if self.controller.is_running and new.limits != old.limits:
            self.controller.set_limits(self.settings.limits)
            self.log_view.append("info", "Sent the new limits to the node.")
        if new.start_at_login != old.start_at_login:
            try:
                autostart.set_start_at_login(new.start_at_login)
            except autostart.AutostartError as exc:
                self.banner.show_message("warning", "Start at login could not be changed", str(exc))
        if self.controller.is_running and (new.swarm_mode, new.coordinator_url, new.generate_only) != (
                old.swarm_mode, old.coordinator_url, old.generate_only):
            role = ("" if new.generate_only == old.generate_only
                    else " and only generate (no training)" if new.generate_only else " and train")
            self.banner.show_message("info", "Swarm setting saved",
                                     f"Your node will use “{SWARM_MODE_LABELS[new.swarm_mode]}”{role} "
                                     "from its next start.",
                                     actions=(("restart", "Restart now"), ("dismiss", "Later")))
        self.apply_schedule()

    def _update_settings(self, new: AppSettings) -> None:
        save_settings(self.store, new)
        self.settings = new.validated()

    def export_diagnostics_to(self, path: Path) -> Path:
        files = sorted(self.log_dir.glob("*.log*")) if self.log_dir and self.log_dir.is_dir() else []
        return diagnostics.export_diagnostics(path, settings=self.settings,
                                              hello=self.controller.hello or self._last_hello,
                                              log_lines=self.log_view.lines(), log_files=files)

    def _on_export_requested(self) -> None:
        path, _ = QFileDialog.getSaveFileName(self, "Export diagnostics", str(Path.home() / "polis-diagnostics.zip"),
                                              "Zip archives (*.zip)")
        if not path:
            return
        try:
            written = self.export_diagnostics_to(Path(path))
        except OSError as exc:
            self.banner.show_message("error", "Diagnostics could not be saved", str(exc),
                                     "Choose another folder and try again.")
            return
        self.banner.show_message("info", "Diagnostics saved", f"{written} (no keys or tokens inside).")

    def _on_hero_action(self, name: str) -> None:
        if name == "demo":
            self.run_local_demo()

    def _on_banner_action(self, name: str) -> None:
        if name == "restart":
            self.restart_node()
        elif name == "show_log":
            self.tabs.setCurrentWidget(self.log_view)
        else:
            self.banner.clear()

    # -- schedule -------------------------------------------------------------------------

    def apply_schedule(self) -> None:
        """Pause a running node the schedule does not allow now; resume it when it does again."""
        if not self.controller.is_running or self.controller.is_stopping:
            return
        allowed, reason = may_run(self.settings, self._machine_state())
        if not allowed and not self.schedule_paused:
            self.schedule_paused = True
            self.controller.pause()
            self.run.hold(reason)
            self.log_view.append("info", reason)
            self._render()
        elif allowed and self.schedule_paused:
            self.schedule_paused = False
            self.controller.resume()
            self.run.release()
            self.log_view.append("info", "The schedule allows contributing again; resuming.")
            self._render()

    # -- node events ----------------------------------------------------------------------

    def _on_hello(self, hello: dict) -> None:
        self._last_hello = hello
        self.header.show_hello(hello)
        if hello.get("key_storage") == "file" and not self._key_notice_shown:
            self._key_notice_shown = True
            self.log_view.append("warning", "No usable system keyring: your identity key is kept in a private "
                                            "file in the Polis data folder.")
        self.apply_schedule()

    def _on_node_state(self, state: str, detail: str) -> None:
        if state == "contributing" and self.banner.kind == "warning":
            self.banner.clear()
        self.run.node_event_state(state, detail)
        self._render()
        if state in ("contributing", "loading", "connecting"):
            self.apply_schedule()

    def _on_status(self, status: dict) -> None:
        self.run.node_status(status)
        self.overview.show_status(status)
        self._render()

    def _on_stats(self, stats: dict) -> None:
        self.run.node_stats(stats, time.monotonic())
        # "Time contributing" is the time spent working, as the run state counts it, not the node's uptime
        self.ledger.update({**stats, "uptime_s": self.run.working_s})
        self.overview.show_stats(stats, self.ledger.session, self.ledger.all_time)
        self._render()

    def _on_swarm(self, swarm: dict) -> None:
        self.run.node_swarm(swarm, time.monotonic())
        self.overview.show_swarm(swarm)
        self._render()

    def _on_tick(self) -> None:
        if self.controller.is_running:
            self.run.tick(time.monotonic())
            self._render()

    def _on_node_error(self, event: dict) -> None:
        message, hint = str(event.get("message"))[:500], str(event.get("hint") or "")[:500]
        self.log_view.append("error", message)
        self.banner.show_message("error" if event.get("fatal") else "warning",
                                 "The node reported a problem", message, hint,
                                 actions=(("show_log", "Show log"), ("dismiss", "Dismiss")))

    def _on_running_changed(self, running: bool) -> None:
        if running:
            self.run.process_started()
        else:
            self.ledger.end_run()
            self._refresh_cards()
        self._render()

    def _on_stopped(self) -> None:
        self.schedule_paused = False
        restarting = self.run.phase == "restarting"
        self.run.process_stopped()
        self._render()
        self.log_view.append("info", "The node stopped; starting it again with the new settings." if restarting
                             else "The node stopped; this computer is free.")

    def _on_crashed(self, report: CrashReport) -> None:
        msg = error_hints.explain_crash(report.exit_code, report.killed_by_signal, report.stderr_tail)
        self._show_failure(msg)

    def _on_start_failed(self, error: str) -> None:
        self._show_failure(error_hints.explain_start_failure(error, self.controller.node_command[0]))

    def _on_unresponsive(self, silent_s: float) -> None:
        msg = error_hints.explain_unresponsive(silent_s)
        self.banner.show_message("warning", msg.title, msg.detail, msg.next_step,
                                 actions=(("restart", "Restart"), ("show_log", "Show log"), ("dismiss", "Dismiss")))

    def _show_failure(self, msg: error_hints.UserMessage) -> None:
        self.log_view.append("error", f"{msg.title}: {msg.detail}")
        self.banner.show_message("error", msg.title, msg.detail, msg.next_step,
                                 actions=(("restart", "Restart"), ("show_log", "Show log")))
        self.run.failed(f"{msg.title}. See the message above.")
        self._render()
        self.tray.notify(msg.title, msg.detail)
        if self._quitting:
            QApplication.quit()

    # -- display --------------------------------------------------------------------------

    def _render(self) -> None:
        """Show the run state's view everywhere it appears: hero card, swarm panel, tray."""
        view = self.run.view()
        self.overview.show_view(view)
        tray = getattr(self, "tray", None)
        if tray is not None:
            tray_state = {"good": "contributing", "bad": "error", "warn": "waiting"}.get(view.color, "idle")
            tray.set_state(tray_state, view.headline, view.running)

    def _refresh_cards(self) -> None:
        self.overview.show_totals(self.ledger.session, self.ledger.all_time)

    # -- closing --------------------------------------------------------------------------

    def closeEvent(self, event: QCloseEvent) -> None:  # noqa: N802 - Qt API
        if self._quitting:
            event.accept()
            return
        if self.controller.is_running and self.tray.available:
            event.ignore()
            self.hide()
            if not self.settings.tray_notice_shown:
                self.tray.notify("Polis keeps contributing",
                                 "Polis is still running in the tray. Choose Quit from its menu to stop it.")
                self._update_settings(replace(self.settings, tray_notice_shown=True))
            return
        event.ignore()
        self.quit_app()

    def quit_app(self) -> None:
        """Stop the node cleanly (bounded by the controller's timeouts), then exit the application."""
        self._quitting = True
        self.ledger.save()
        self.hide()
        self.tray.hide()
        if not self.controller.is_running:
            QApplication.quit()
            return
        self.controller.stopped.connect(QApplication.quit)
        self.controller.stop()
        deadline_ms = int((self.controller.stop_timeout_s + self.controller.kill_timeout_s + 2) * 1000)
        QTimer.singleShot(deadline_ms, self._force_quit)

    def _force_quit(self) -> None:
        self.controller.kill_now()
        QApplication.quit()
