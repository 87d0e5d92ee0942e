"""The system-tray icon: shows the node's state and offers Open, Start/Pause and Quit.

Emits signals for the main window to act on; knows nothing about the node.
Where the desktop has no tray (``available`` is False) it stays hidden.
"""

from __future__ import annotations

from PySide6.QtCore import QObject, Signal
from PySide6.QtGui import QAction
from PySide6.QtWidgets import QMenu, QSystemTrayIcon

from app.icons import tray_icon

_TOOLTIPS = {"idle": "Polis — not contributing", "contributing": "Polis — contributing",
             "waiting": "Polis — waiting for the schedule", "error": "Polis — needs attention"}


class TrayIcon(QObject):
    show_requested = Signal()
    toggle_requested = Signal()
    quit_requested = Signal()

    def __init__(self, parent: QObject | None = None, available: bool | None = None) -> None:
        super().__init__(parent)
        self.available = QSystemTrayIcon.isSystemTrayAvailable() if available is None else available
        self.state = "idle"
        self.icon = QSystemTrayIcon(tray_icon("idle"), self)
        self.menu = QMenu()
        self.status_action = QAction("Not contributing", self.menu)
        self.status_action.setEnabled(False)
        self.open_action = QAction("Open Polis", self.menu)
        self.toggle_action = QAction("Start contributing", self.menu)
        self.quit_action = QAction("Quit Polis", self.menu)
        for action in (self.status_action, None, self.open_action, self.toggle_action, None, self.quit_action):
            if action is None:
                self.menu.addSeparator()
            else:
                self.menu.addAction(action)
        self.open_action.triggered.connect(self.show_requested.emit)
        self.toggle_action.triggered.connect(self.toggle_requested.emit)
        self.quit_action.triggered.connect(self.quit_requested.emit)
        self.icon.setContextMenu(self.menu)
        self.icon.activated.connect(self._on_activated)
        self.icon.setToolTip(_TOOLTIPS["idle"])
        if self.available:
            self.icon.show()

    def _on_activated(self, reason: QSystemTrayIcon.ActivationReason) -> None:
        if reason in (QSystemTrayIcon.ActivationReason.Trigger, QSystemTrayIcon.ActivationReason.DoubleClick):
            self.show_requested.emit()

    def set_state(self, tray_state: str, words: str, running: bool) -> None:
        """``tray_state``: idle / contributing / waiting / error; ``words``: the status line."""
        self.state = tray_state
        self.icon.setIcon(tray_icon(tray_state))
        self.icon.setToolTip(_TOOLTIPS.get(tray_state, "Polis") + ("" if not words else f"\n{words}"))
        self.status_action.setText(words)
        self.toggle_action.setText("Pause" if running else "Start contributing")

    def notify(self, title: str, message: str) -> None:
        if self.available:
            self.icon.showMessage(title, message, QSystemTrayIcon.MessageIcon.Information, 6000)

    def hide(self) -> None:
        self.icon.hide()
