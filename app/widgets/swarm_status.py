"""The state of this node and its swarm: a coloured state line, then swarm, peers, stage, role, version,
staleness and the credit the coordinator gives this node.

Swarm, peers, stage and staleness come from the run state's ``RunView`` (so they agree
with the status line); role, coordinator and policy version from the node's ``status``
and ``stats`` events; the credit (work the coordinator observed or verified, unlike the
contribution cards, which count what this computer says it did) from its ``swarm`` events
(any field may be missing or odd: it shows "–"). Knows nothing about the process.
"""

from __future__ import annotations

from typing import Any, Mapping
from urllib.parse import urlsplit

from PySide6.QtWidgets import QFrame, QGridLayout, QLabel, QVBoxLayout, QWidget

from app import formatting
from app.run_state import RunView

_FIELDS = (("swarm", "Swarm"), ("peers", "Peers"), ("stage", "Your stage"), ("role", "Role"),
           ("version", "Policy version"), ("staleness", "Staleness"), ("credit", "Credited"))
_CREDIT_TIP = ("Work the coordinator itself saw this computer do in this run: tokens of generation results it "
               "accepted, training micro-batches it saw complete, optimiser steps whose weights the other "
               "replicas confirmed. The cards below count what this computer did by its own account.")


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
            if key == "credit":
                label.setToolTip(_CREDIT_TIP)
                value.setToolTip(_CREDIT_TIP)
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
            for key in ("role", "version", "credit"):
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

    def show_credit(self, credit: Any) -> None:
        """The coordinator's verified credit of this node (a validated ``swarm`` event's ``credit``, numbers;
        None: none yet)."""
        if not isinstance(credit, Mapping):
            self.values["credit"].setText("–")
            return
        tokens, microbatches, steps = (credit.get(k) for k in ("tokens_generated", "microbatches_trained",
                                                               "steps_applied"))
        self.values["credit"].setText(f"{formatting.count(tokens)} tokens · {formatting.count(microbatches)} "
                                      f"micro-batches · {formatting.count(steps)} steps")
