"""The Log tab: what the node says, for people, newest at the bottom, with export.

Each line has one timestamp and no stream prefix. The node's ``log`` events and the
app's own notes are always shown; the node's stderr goes through
``app.log_lines.classify``: link events reworded, warnings and errors shown, and the
rest (library chatter from aioice/aiortc, the engine's info lines) kept behind the
"Details" switch. Keeps at most ``max_lines`` lines (the full log is in the node log
file). Knows nothing about the node; "Export diagnostics…" is a signal.
"""

from __future__ import annotations

import collections
import html
import time

from PySide6.QtCore import Signal
from PySide6.QtGui import QTextCursor
from PySide6.QtWidgets import QCheckBox, QHBoxLayout, QLabel, QPlainTextEdit, QPushButton, QVBoxLayout, QWidget

from app import style
from app.log_lines import LogLine, classify

_LEVEL_COLORS = {"error": style.BAD, "critical": style.BAD, "warning": style.WARN}
_LEVEL_WORDS = {"error": "Error: ", "critical": "Error: ", "warning": "Warning: "}


class LogView(QWidget):
    export_requested = Signal()

    def __init__(self, max_lines: int = 5000, parent: QWidget | None = None) -> None:
        super().__init__(parent)
        layout = QVBoxLayout(self)
        layout.setContentsMargins(0, 8, 0, 0)
        bar = QHBoxLayout()
        hint = QLabel("What your node is doing. The full log is saved and included in diagnostics.")
        hint.setObjectName("Muted")
        bar.addWidget(hint, 1)
        self.details_box = QCheckBox("Details")
        self.details_box.setToolTip("Also show the technical lines (network libraries, the engine's own notes)")
        self.details_box.toggled.connect(self._rerender)
        self.clear_button = QPushButton("Clear view")
        self.export_button = QPushButton("Export diagnostics…")
        self.clear_button.clicked.connect(self.clear)
        self.export_button.clicked.connect(self.export_requested.emit)
        bar.addWidget(self.details_box)
        bar.addWidget(self.clear_button)
        bar.addWidget(self.export_button)
        layout.addLayout(bar)
        self.text = QPlainTextEdit()
        self.text.setReadOnly(True)
        self.text.setMaximumBlockCount(max_lines)
        layout.addWidget(self.text, 1)
        self._entries: collections.deque[LogLine] = collections.deque(maxlen=max_lines)

    def append(self, level: str, message: str) -> None:
        """A line for people (a node ``log`` event or the app's own note): always shown."""
        self._add(LogLine(time.strftime("%H:%M:%S"), level.lower(), message, detail=False))

    def append_stderr(self, raw: str) -> None:
        """A raw stderr line of the node: reworded, or kept behind Details."""
        if raw.strip():
            line = classify(raw)
            self._add(line if line.clock else LogLine(time.strftime("%H:%M:%S"), line.level, line.message,
                                                      line.detail, line.source))

    def _add(self, line: LogLine) -> None:
        self._entries.append(line)
        if self._visible(line):
            self._show(line)
            self.text.moveCursor(QTextCursor.MoveOperation.End)

    def _visible(self, line: LogLine) -> bool:
        return not line.detail or self.details_box.isChecked()

    def _show(self, line: LogLine) -> None:
        color = _LEVEL_COLORS.get(line.level, style.MUTED if line.detail else style.TEXT)
        words = _LEVEL_WORDS.get(line.level, "")
        source = f"{line.source}: " if line.detail and line.source else ""
        self.text.appendHtml(f'<span style="color:{style.MUTED}">{line.clock}</span>&nbsp; '
                             f'<span style="color:{color}">{html.escape(words + source + line.message)}</span>')

    def _rerender(self) -> None:
        self.text.clear()
        for line in self._entries:
            if self._visible(line):
                self._show(line)
        self.text.moveCursor(QTextCursor.MoveOperation.End)

    def lines(self) -> list[str]:
        """Every line as plain text (details included), for diagnostics."""
        return [f"{line.clock} {_LEVEL_WORDS.get(line.level, '')}{line.source + ': ' if line.source else ''}"
                f"{line.message}" for line in self._entries]

    def shown_lines(self) -> list[str]:
        return self.text.toPlainText().splitlines()

    def clear(self) -> None:
        self._entries.clear()
        self.text.clear()
