"""A contribution card: a title, this session's value in large type, the all-time value under it.

Shows text it is given; knows nothing about where the numbers come from.
"""

from __future__ import annotations

from PySide6.QtWidgets import QFrame, QLabel, QVBoxLayout, QWidget


class StatCard(QFrame):
    def __init__(self, title: str, tooltip: str = "", parent: QWidget | None = None) -> None:
        super().__init__(parent)
        self.setObjectName("Card")
        self.setToolTip(tooltip)
        layout = QVBoxLayout(self)
        layout.setContentsMargins(16, 12, 16, 12)
        layout.setSpacing(2)
        self.title_label = QLabel(title.upper())
        self.title_label.setObjectName("CardTitle")
        self.value_label = QLabel("–")
        self.value_label.setObjectName("CardValue")
        self.all_time_label = QLabel("All time: –")
        self.all_time_label.setObjectName("CardSub")
        layout.addWidget(self.title_label)
        layout.addWidget(self.value_label)
        layout.addWidget(self.all_time_label)
        self.setMinimumWidth(150)

    def set_values(self, session: str, all_time: str) -> None:
        self.value_label.setText(session)
        self.all_time_label.setText(f"All time: {all_time}")

    @property
    def session_text(self) -> str:
        return self.value_label.text()

    @property
    def all_time_text(self) -> str:
        return self.all_time_label.text().removeprefix("All time: ")
