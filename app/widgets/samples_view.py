"""What is being trained and what it writes now: the model, its size, the task, live sample answers.

Fed the node's ``swarm`` event (already parsed and validated by ``engine.control_protocol``):
``model``, ``model_parameters``, ``task`` and ``samples`` (the coordinator's latest scored
completions: question, answer, reward, the policy version that wrote it). Shows a line naming
the model and the task, then up to :data:`MAX_ROWS` samples, newest first, so a contributor sees
what the model says now. Any field may be missing (an older node): it shows what it has. It
knows nothing about the node process or the coordinator.
"""

from __future__ import annotations

from typing import Any, Mapping

from PySide6.QtWidgets import QFrame, QLabel, QVBoxLayout, QWidget

from app import formatting

#: samples shown at once
MAX_ROWS = 3
#: characters of a question / an answer shown (the full text is the label's tooltip)
SHOWN_CHARS = 160

WAITING_TEXT = "Sample answers appear here once the swarm scores its first rollouts."


def _short(text: str) -> str:
    text = " ".join(text.split())
    return text if len(text) <= SHOWN_CHARS else text[: SHOWN_CHARS - 1] + "…"


def describe_model(swarm: Mapping[str, Any]) -> str:
    """``"Training smollm2-135m (135 M parameters) on reasoning_gym:chain_sum"`` from what the event has."""
    model, size, task = swarm.get("model"), swarm.get("model_parameters"), swarm.get("task")
    if not model and not task:
        return "–"
    words = f"Training {model or 'the model'}"
    if isinstance(size, int) and size > 0:
        words += f" ({formatting.count(size)} parameters)"
    return words + (f" on {task}" if task else "")


def describe_sample(sample: Mapping[str, Any]) -> tuple[str, str]:
    """(shown text, full text) of one sample."""
    prompt, answer = str(sample.get("prompt", "")), str(sample.get("answer", ""))
    head = f"v{sample.get('version', '?')} · reward {float(sample.get('reward', 0.0)):.2f}"
    return (f"{head}\nQ: {_short(prompt)}\nA: {_short(answer) or '(nothing)'}",
            f"{head}\nQ: {prompt}\nA: {answer}")


class SamplesPanel(QFrame):
    def __init__(self, parent: QWidget | None = None) -> None:
        super().__init__(parent)
        self.setObjectName("Card")
        outer = QVBoxLayout(self)
        outer.setContentsMargins(18, 14, 18, 14)
        outer.setSpacing(6)
        title = QLabel("What the model writes now")
        title.setObjectName("SectionTitle")
        outer.addWidget(title)
        self.model_label = QLabel("–")
        self.model_label.setObjectName("FieldValue")
        outer.addWidget(self.model_label)
        self.rows: list[QLabel] = []
        for _ in range(MAX_ROWS):
            row = QLabel("")
            row.setWordWrap(True)
            row.setObjectName("FieldName")
            row.hide()
            outer.addWidget(row)
            self.rows.append(row)
        self.waiting = QLabel(WAITING_TEXT)
        self.waiting.setObjectName("FieldName")
        self.waiting.setWordWrap(True)
        outer.addWidget(self.waiting)

    def show_swarm(self, swarm: Mapping[str, Any]) -> None:
        """The model line and the newest samples of one ``swarm`` event."""
        self.model_label.setText(describe_model(swarm))
        samples = [s for s in (swarm.get("samples") or []) if isinstance(s, Mapping)]
        newest = list(reversed(samples))[:MAX_ROWS]
        for row, sample in zip(self.rows, newest):
            shown, full = describe_sample(sample)
            row.setText(shown)
            row.setToolTip(full)
            row.show()
        for row in self.rows[len(newest):]:
            row.hide()
        self.waiting.setVisible(not newest)

    def shown_texts(self) -> list[str]:
        """The sample rows' texts, newest first (what a person reads)."""
        return [row.text() for row in self.rows if not row.isHidden()]
