"""The top card: the big Start/Pause button, the node's state in words and colour, and a detail line.

Emits ``toggle_clicked``; the window decides what it means. Knows nothing about the node.
"""

from __future__ import annotations

from PySide6.QtCore import Qt, Signal
from PySide6.QtWidgets import QFrame, QHBoxLayout, QLabel, QPushButton, QVBoxLayout, QWidget

from app import style

START_TEXT = "▶  Start contributing"
PAUSE_TEXT = "❚❚  Pause"


class HeroCard(QFrame):
    toggle_clicked = Signal()

    def __init__(self, parent: QWidget | None = None) -> None:
        super().__init__(parent)
        self.setObjectName("Card")
        layout = QHBoxLayout(self)
        layout.setContentsMargins(22, 18, 22, 18)
        layout.setSpacing(22)
        self.button = QPushButton(START_TEXT)
        self.button.setObjectName("PrimaryButton")
        self.button.setMinimumSize(230, 64)
        self.button.setCursor(Qt.CursorShape.PointingHandCursor)
        self.button.clicked.connect(self.toggle_clicked.emit)
        layout.addWidget(self.button, 0, Qt.AlignmentFlag.AlignVCenter)
        text = QVBoxLayout()
        text.setSpacing(4)
        self.state_label = QLabel()
        self.state_label.setTextFormat(Qt.TextFormat.RichText)
        self.state_label.setStyleSheet("font-size: 19px; font-weight: 700;")
        self.detail_label = QLabel()
        self.detail_label.setObjectName("Muted")
        self.detail_label.setWordWrap(True)
        self.summary_label = QLabel()
        self.summary_label.setWordWrap(True)
        text.addStretch(1)
        text.addWidget(self.state_label)
        text.addWidget(self.detail_label)
        text.addWidget(self.summary_label)
        text.addStretch(1)
        layout.addLayout(text, 1)
        self.state = ""
        self.set_state("stopped", "Press Start to lend this computer to the swarm.")

    def set_state(self, state: str, detail: str) -> None:
        self.state = state
        color = style.display_state_color(state)
        self.state_label.setText(f'<span style="color:{color}">●</span>&nbsp; {style.display_state_words(state)}')
        self.detail_label.setText(detail)
        self.detail_label.setVisible(bool(detail))

    def set_running(self, running: bool, enabled: bool = True) -> None:
        self.button.setText(PAUSE_TEXT if running else START_TEXT)
        self.button.setProperty("running", "true" if running else "false")
        self.button.style().unpolish(self.button)
        self.button.style().polish(self.button)
        self.button.setEnabled(enabled)

    def set_summary(self, text: str) -> None:
        self.summary_label.setText(text)
