"""The state of this node and its swarm: a coloured state line, then swarm, peers, stage, role, version.

Swarm, peers, stage and staleness come from the run state's ``RunView`` (so they agree
with the status line); role, coordinator and policy version from the node's ``status``
and ``stats`` events (any field may be missing or odd: it shows "–"). Knows nothing about the process.
"""

from __future__ import annotations

from typing import Any, Mapping
from urllib.parse import urlsplit

from PySide6.QtWidgets import QFrame, QGridLayout, QLabel, QVBoxLayout, QWidget

from app.run_state import RunView

_FIELDS = (("swarm", "Swarm"), ("peers", "Peers"), ("stage", "Your stage"), ("role", "Role"),
           ("version", "Policy version"), ("staleness", "Staleness"))


def _short_url(url: Any) -> str:
    if not isinstance(url, str) or not url:
        return "–"
    parts = urlsplit(url)
    return parts.netloc.rsplit("@", 1)[-1] or url[:40]


class SwarmStatusPanel(QFrame):
    def __init__(self, parent: QWidget | None = None) -> None:
        super().__init__(parent)
        self.setObjectName("Card")
        outer = QVBoxLayout(self)
        outer.setContentsMargins(18, 14, 18, 14)
        outer.setSpacing(8)
        title = QLabel("Swarm")
        title.setObjectName("SectionTitle")
        outer.addWidget(title)
        grid = QGridLayout()
        grid.setHorizontalSpacing(18)
        grid.setVerticalSpacing(6)
        self.values: dict[str, QLabel] = {}
        for row, (key, name) in enumerate(_FIELDS):
            label = QLabel(name)
            label.setObjectName("FieldName")
            value = QLabel("–")
            value.setObjectName("FieldValue")
            grid.addWidget(label, row, 0)
            grid.addWidget(value, row, 1)
            self.values[key] = value
        grid.setColumnStretch(1, 1)
        outer.addLayout(grid)
        outer.addStretch(1)
        self.swarm_mode_words = "–"
        self._coordinator: str | None = None

    def show_view(self, view: RunView) -> None:
        """The fields the run state owns: swarm mode (of the running node), peers, stage, staleness."""
        self.swarm_mode_words = view.swarm_words
        coordinator = self._coordinator if view.running else None
        self.values["swarm"].setText(view.swarm_words if not coordinator
                                     else f"{view.swarm_words} · {_short_url(coordinator)}")
        self.values["peers"].setText(view.peers)
        self.values["stage"].setText(view.stage)
        self.values["staleness"].setText(view.staleness)
        if not view.running:
            self._coordinator = None
            for key in ("role", "version"):
                self.values[key].setText("–")

    def update_status(self, status: Mapping[str, Any]) -> None:
        """The fields only the node's ``status`` event carries: coordinator, role, policy version."""
        coordinator = status.get("coordinator")
        self._coordinator = coordinator if isinstance(coordinator, str) and coordinator else None
        role = status.get("role")
        self.values["role"].setText({"trainer": "Trainer (generates and trains)",
                                     "inference": "Generating only (follows a trainer's weights)"}
                                    .get(role, str(role or "–")))
        self.set_policy(status.get("policy_version"))

    def set_policy(self, version: Any) -> None:
        if isinstance(version, int) and not isinstance(version, bool):
            self.values["version"].setText(f"v{version}")
