"""The Log tab: the node's log events and stderr lines, newest at the bottom, with export.

Keeps at most ``max_lines`` lines in view (the full log is in the node log file).
Knows nothing about the node; "Export diagnostics…" is a signal.
"""

from __future__ import annotations

import html
import time

from PySide6.QtCore import Signal
from PySide6.QtGui import QTextCursor
from PySide6.QtWidgets import QHBoxLayout, QLabel, QPlainTextEdit, QPushButton, QVBoxLayout, QWidget

from app import style

_LEVEL_COLORS = {"error": style.BAD, "critical": style.BAD, "warning": style.WARN, "stderr": style.MUTED}


class LogView(QWidget):
    export_requested = Signal()

    def __init__(self, max_lines: int = 5000, parent: QWidget | None = None) -> None:
        super().__init__(parent)
        layout = QVBoxLayout(self)
        layout.setContentsMargins(0, 8, 0, 0)
        bar = QHBoxLayout()
        hint = QLabel("Messages from your node. The full log is saved and included in diagnostics.")
        hint.setObjectName("Muted")
        bar.addWidget(hint, 1)
        self.clear_button = QPushButton("Clear view")
        self.export_button = QPushButton("Export diagnostics…")
        self.clear_button.clicked.connect(self.clear)
        self.export_button.clicked.connect(self.export_requested.emit)
        bar.addWidget(self.clear_button)
        bar.addWidget(self.export_button)
        layout.addLayout(bar)
        self.text = QPlainTextEdit()
        self.text.setReadOnly(True)
        self.text.setMaximumBlockCount(max_lines)
        layout.addWidget(self.text, 1)
        self._lines: list[str] = []
        self._max_lines = max_lines

    def append(self, level: str, message: str) -> None:
        stamp = time.strftime("%H:%M:%S")
        plain = f"{stamp} {level.upper():7} {message}"
        self._lines.append(plain)
        if len(self._lines) > self._max_lines:
            del self._lines[: len(self._lines) - self._max_lines]
        color = _LEVEL_COLORS.get(level.lower(), style.TEXT)
        self.text.appendHtml(f'<span style="color:{style.MUTED}">{stamp}</span> '
                             f'<span style="color:{color}">{html.escape(level.upper())}</span> '
                             f'<span style="color:{color if level.lower() != "stderr" else style.TEXT}">'
                             f'{html.escape(message)}</span>')
        self.text.moveCursor(QTextCursor.MoveOperation.End)

    def lines(self) -> list[str]:
        return list(self._lines)

    def clear(self) -> None:
        self._lines.clear()
        self.text.clear()
