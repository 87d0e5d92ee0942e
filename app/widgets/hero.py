"""The top card: the big Start/Pause button, the run's headline in words and colour, a detail
line, the one action that helps (e.g. "Run a local demo instead") and a summary line.

Shows a ``RunView`` (``app.run_state``) it is given and emits ``toggle_clicked`` and
``action_clicked(name)``; the window decides what they mean. Knows nothing about the node.
"""

from __future__ import annotations

from PySide6.QtCore import Qt, Signal
from PySide6.QtWidgets import QFrame, QHBoxLayout, QLabel, QPushButton, QSizePolicy, QVBoxLayout, QWidget

from app import style
from app.run_state import RunView

START_TEXT = "▶  Start contributing"
PAUSE_TEXT = "❚❚  Pause"


class HeroCard(QFrame):
    toggle_clicked = Signal()
    action_clicked = Signal(str)

    def __init__(self, parent: QWidget | None = None) -> None:
        super().__init__(parent)
        self.setObjectName("Card")
        self.setMinimumHeight(150)
        layout = QHBoxLayout(self)
        layout.setContentsMargins(22, 18, 22, 18)
        layout.setSpacing(22)
        self.button = QPushButton(START_TEXT)
        self.button.setObjectName("PrimaryButton")
        self.button.setMinimumSize(230, 64)
        self.button.setSizePolicy(QSizePolicy.Policy.Fixed, QSizePolicy.Policy.Fixed)
        self.button.setCursor(Qt.CursorShape.PointingHandCursor)
        self.button.clicked.connect(self.toggle_clicked.emit)
        left = QVBoxLayout()
        left.addStretch(1)
        left.addWidget(self.button)
        left.addStretch(1)
        layout.addLayout(left, 0)
        column = QWidget()  # the words take all the width the button leaves
        column.setSizePolicy(QSizePolicy.Policy.Expanding, QSizePolicy.Policy.Preferred)
        text = QVBoxLayout(column)
        text.setContentsMargins(0, 0, 0, 0)
        text.setSpacing(4)
        self.state_label = QLabel()
        self.state_label.setTextFormat(Qt.TextFormat.RichText)
        self.state_label.setWordWrap(True)
        self.state_label.setStyleSheet("font-size: 19px; font-weight: 700;")
        self.detail_label = QLabel()
        self.detail_label.setObjectName("Muted")
        self.detail_label.setWordWrap(True)
        self.action_button = QPushButton()
        self.action_button.setSizePolicy(QSizePolicy.Policy.Maximum, QSizePolicy.Policy.Fixed)
        self.action_button.clicked.connect(lambda: self.action_clicked.emit(self._action))
        self.action_button.hide()
        self.summary_label = QLabel()
        text.addWidget(self.state_label)
        text.addWidget(self.detail_label)
        text.addWidget(self.action_button)
        text.addWidget(self.summary_label)
        text.addStretch(1)
        layout.addWidget(column, 1)
        self._action = ""
        self.headline = ""

    def show_view(self, view: RunView) -> None:
        self.headline = view.headline
        self.state_label.setText(f'<span style="color:{style.run_color(view.color)}">●</span>&nbsp; {view.headline}')
        self.detail_label.setText(view.detail)
        self.detail_label.setVisible(bool(view.detail))
        self._action = view.action[0] if view.action else ""
        self.action_button.setText(view.action[1] if view.action else "")
        self.action_button.setVisible(view.action is not None)
        self.summary_label.setText(view.summary)
        self.summary_label.setVisible(bool(view.summary))
        running = view.button == "pause"
        self.button.setText(PAUSE_TEXT if running else START_TEXT)
        self.button.setProperty("running", "true" if running else "false")
        self.button.style().unpolish(self.button)
        self.button.style().polish(self.button)
        self.button.setEnabled(view.button_enabled)
