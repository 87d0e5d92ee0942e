"""The state of this node and its swarm: a coloured state line, then swarm, peers, stage, role, version.

Shows the fields of the protocol's ``status``/``stats`` events it is given (any
field may be missing or odd: it shows "–"). Knows nothing about the process.
"""

from __future__ import annotations

from typing import Any, Mapping
from urllib.parse import urlsplit

from PySide6.QtWidgets import QFrame, QGridLayout, QLabel, QVBoxLayout, QWidget


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

    def set_swarm_mode(self, words: str) -> None:
        self.swarm_mode_words = words
        self.values["swarm"].setText(words)

    def update_status(self, status: Mapping[str, Any]) -> None:
        coordinator = status.get("coordinator")
        self.values["swarm"].setText(self.swarm_mode_words if not coordinator
                                     else f"{self.swarm_mode_words} · {_short_url(coordinator)}")
        peers = status.get("peers")
        self.values["peers"].setText(str(peers) if isinstance(peers, int) else "–")
        layers, stage, stages = status.get("layers"), status.get("stage"), status.get("num_stages")
        text = str(layers) if isinstance(layers, str) and layers else "–"
        if isinstance(stage, int) and isinstance(stages, int):
            text += f"  (stage {stage + 1} of {stages})"
        self.values["stage"].setText(text)
        role = status.get("role")
        self.values["role"].setText({"trainer": "Trainer (generates and trains)",
                                     "inference": "Generating only (follows a trainer's weights)"}
                                    .get(role, str(role or "–")))
        self.set_policy(status.get("policy_version"), None)

    def set_policy(self, version: Any, staleness: Any) -> None:
        if isinstance(version, int):
            self.values["version"].setText(f"v{version}")
        if isinstance(staleness, (int, float)) and not isinstance(staleness, bool):
            self.values["staleness"].setText(f"{staleness:.1f} versions behind")

    def clear(self) -> None:
        for key, label in self.values.items():
            label.setText(self.swarm_mode_words if key == "swarm" else "–")
