"""The window's "Export model..." action: the owner of a local demo swarm writes its model to a folder.

The app never loads the model: the action asks for a parent folder, sends the node the control
protocol's ``export`` command with a fresh folder inside it (``polis-model-YYYYmmdd-HHMMSS``),
and the node runs ``polis export`` on its demo's run directory (``engine.swarm.demo_export``).
When the node answers ``exported`` the folder (HF checkpoint + model card) is opened with the
desktop's file manager (``QDesktopServices``); an ``error`` answer shows up as the window's
usual error banner. The action is enabled only while this app runs the local demo swarm and its
node has said hello, and while no export is pending.

The folder chooser and the opener are attributes, so a test can answer them without a dialog.
What it does not know: how a model is exported, the window's layout.
"""

from __future__ import annotations

import logging
import time
from pathlib import Path
from typing import Callable

from PySide6.QtCore import QObject, QUrl, Signal
from PySide6.QtGui import QAction, QDesktopServices
from PySide6.QtWidgets import QFileDialog, QWidget

from app.node_controller import NodeController

log = logging.getLogger(__name__)

ACTION_TEXT = "Export model..."


def _choose_folder(parent: QWidget) -> str | None:
    path = QFileDialog.getExistingDirectory(parent, "Export the demo's model into this folder", str(Path.home()))
    return path or None


def _open_folder(path: str) -> None:
    if not QDesktopServices.openUrl(QUrl.fromLocalFile(path)):
        log.info("no file manager opened %s", path)


class ModelExportAction(QObject):
    """``action`` (a QAction for a menu) and the round trip to the node that exports."""

    #: a line for the window's log: (level, message)
    message = Signal(str, str)

    def __init__(self, parent: QWidget, controller: NodeController, is_demo: Callable[[], bool]) -> None:
        super().__init__(parent)
        self.controller = controller
        self.is_demo = is_demo
        self.choose_folder: Callable[[], str | None] = lambda: _choose_folder(parent)
        self.open_folder: Callable[[str], None] = _open_folder
        self.pending: str | None = None  #: the folder asked for, until the node answers
        self.action = QAction(ACTION_TEXT, parent)
        self.action.setStatusTip("Write the local demo's trained model as a Hugging Face folder with a model card")
        self.action.triggered.connect(self.trigger)
        controller.exported.connect(self._on_exported)
        controller.error_received.connect(self._on_error)
        controller.hello_received.connect(lambda _hello: self.refresh())
        controller.running_changed.connect(lambda _running: self._on_running_changed())
        self.refresh()

    def available(self) -> bool:
        return (self.is_demo() and self.controller.is_running and not self.controller.is_stopping
                and self.controller.hello is not None and self.pending is None)

    def refresh(self) -> None:
        self.action.setEnabled(self.available())

    def trigger(self) -> None:
        if not self.available():
            return
        parent = self.choose_folder()
        if not parent:
            return
        out = str(Path(parent) / time.strftime("polis-model-%Y%m%d-%H%M%S"))
        self.pending = out
        self.controller.export_model(out)
        self.message.emit("info", f"Exporting the demo's model to {out}; the folder opens when it is written.")
        self.refresh()

    def _on_exported(self, event: dict) -> None:
        path = str(event.get("path") or self.pending or "")
        self.pending = None
        self.refresh()
        self.message.emit("info", f"Model (version {event.get('version')}) written to {path}.")
        if path:
            self.open_folder(path)

    def _on_error(self, event: dict) -> None:
        if self.pending is not None and "export" in str(event.get("message", "")).lower():
            self.pending = None
            self.refresh()

    def _on_running_changed(self) -> None:
        if not self.controller.is_running:
            self.pending = None
        self.refresh()
