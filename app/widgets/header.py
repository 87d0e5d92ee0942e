"""The window's header: the logo, the app's name, the device line from the node's ``hello`` and
the Settings button.

Shows what it is given; the Settings button is a signal. Knows nothing about the node process.
"""

from __future__ import annotations

from typing import Any, Mapping

from PySide6.QtCore import Signal
from PySide6.QtWidgets import QHBoxLayout, QLabel, QPushButton, QVBoxLayout, QWidget

from app.icons import app_icon


class Header(QWidget):
    settings_clicked = Signal()

    def __init__(self, parent: QWidget | None = None) -> None:
        super().__init__(parent)
        row = QHBoxLayout(self)
        row.setContentsMargins(0, 0, 0, 0)
        row.setSpacing(12)
        logo = QLabel()
        logo.setPixmap(app_icon().pixmap(44, 44))
        row.addWidget(logo)
        titles = QVBoxLayout()
        titles.setSpacing(0)
        title = QLabel("Polis")
        title.setObjectName("AppTitle")
        self.device_label = QLabel("This computer: detected when the node starts")
        self.device_label.setObjectName("Subtitle")
        titles.addWidget(title)
        titles.addWidget(self.device_label)
        row.addLayout(titles, 1)
        self.settings_button = QPushButton("Settings")
        self.settings_button.clicked.connect(self.settings_clicked.emit)
        row.addWidget(self.settings_button)

    def show_hello(self, hello: Mapping[str, Any]) -> None:
        """The device line: ``This computer: <device> · <memory> GB · backend <name>``."""
        memory = hello.get("memory_gb")
        memory_words = f" · {memory:g} GB" if isinstance(memory, (int, float)) and not isinstance(memory, bool) else ""
        self.device_label.setText(f"This computer: {str(hello.get('device') or 'unknown device')[:80]}{memory_words}"
                                  f" · backend {str(hello.get('backend') or '?')[:30]}")
