"""A message banner across the top of the window: what happened, what to do, and action buttons.

Used for crashes (with Restart and Show log), non-fatal node errors and schedule
notices. Knows nothing about the node; it emits ``action_clicked(name)``.
"""

from __future__ import annotations

from PySide6.QtCore import Qt, Signal
from PySide6.QtWidgets import QFrame, QHBoxLayout, QLabel, QPushButton, QVBoxLayout, QWidget

from app import style

_KIND_COLORS = {"error": (style.BAD, "#FEF2F2"), "warning": (style.WARN, "#FFFBEB"),
                "info": (style.ACCENT, "#EEF2FF")}


class MessageBanner(QFrame):
    action_clicked = Signal(str)

    def __init__(self, parent: QWidget | None = None) -> None:
        super().__init__(parent)
        self.setObjectName("Banner")
        layout = QHBoxLayout(self)
        layout.setContentsMargins(16, 12, 12, 12)
        layout.setSpacing(12)
        self.badge = QLabel()
        self.badge.setFixedSize(26, 26)
        self.badge.setAlignment(Qt.AlignmentFlag.AlignCenter)
        layout.addWidget(self.badge, 0, Qt.AlignmentFlag.AlignTop)
        text = QVBoxLayout()
        text.setSpacing(2)
        self.title_label = QLabel()
        self.title_label.setStyleSheet("font-weight: 700; font-size: 14px;")
        self.detail_label = QLabel()
        self.detail_label.setWordWrap(True)
        self.next_label = QLabel()
        self.next_label.setWordWrap(True)
        text.addWidget(self.title_label)
        text.addWidget(self.detail_label)
        text.addWidget(self.next_label)
        layout.addLayout(text, 1)
        self._buttons_layout = QHBoxLayout()
        layout.addLayout(self._buttons_layout)
        self.buttons: dict[str, QPushButton] = {}
        self.kind = ""
        self.hide()

    def show_message(self, kind: str, title: str, detail: str, next_step: str = "",
                     actions: tuple[tuple[str, str], ...] = (("dismiss", "Dismiss"),)) -> None:
        """Show the banner; ``actions`` are (name, label) pairs, emitted by ``action_clicked``."""
        self.kind = kind
        edge, fill = _KIND_COLORS.get(kind, _KIND_COLORS["info"])
        self.setStyleSheet(f"QFrame#Banner {{ background: {fill}; border: 1px solid {edge}; border-radius: 10px; }}"
                           f" QFrame#Banner QLabel {{ background: transparent; }}")
        self.badge.setText("!" if kind in ("error", "warning") else "i")
        self.badge.setStyleSheet(f"background: {edge}; color: white; border-radius: 13px; font-weight: 800;"
                                 f" font-size: 15px;")
        self.title_label.setText(title)
        self.detail_label.setText(detail)
        self.detail_label.setVisible(bool(detail))
        self.next_label.setText(f"<b>What to do:</b> {next_step}" if next_step else "")
        self.next_label.setVisible(bool(next_step))
        for button in self.buttons.values():
            self._buttons_layout.removeWidget(button)
            button.deleteLater()
        self.buttons = {}
        for name, label in actions:
            button = QPushButton(label)
            button.clicked.connect(lambda _=False, n=name: self.action_clicked.emit(n))
            self._buttons_layout.addWidget(button)
            self.buttons[name] = button
        self.show()

    def clear(self) -> None:
        self.kind = ""
        self.hide()
