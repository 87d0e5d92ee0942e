"""What is being trained and what it writes now: the model, its size, the task, live sample answers.

Fed the node's ``swarm`` event (already parsed and validated by ``engine.control_protocol``):
``model``, ``model_parameters``, ``task`` and ``samples`` (the coordinator's latest scored
completions: question, answer, reward, the policy version that wrote it). Shows a line naming
the model and the task, then up to :data:`MAX_ROWS` samples, newest first, so a contributor sees
what the model says now. A sample of a multi-turn episode (``turns``) shows every turn: the
model's tool call, the tool's answer, the final answer, then its reward. Below, one line of the
reward-hacking monitor (``monitor``: turns and tool calls per episode, the commonest answer's
share against gold's, and any tell that is on). Any field may be missing (an older node): it
shows what it has. It knows nothing about the node process or the coordinator.
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


#: how a turn's writer is named in a multi-turn sample
TURN_NAMES = {"assistant": "Model", "tool": "Tool", "user": "User"}


def describe_sample(sample: Mapping[str, Any]) -> tuple[str, str]:
    """(shown text, full text) of one sample."""
    prompt, answer = str(sample.get("prompt", "")), str(sample.get("answer", ""))
    head = f"v{sample.get('version', '?')} · reward {float(sample.get('reward', 0.0)):.2f}"
    turns = [t for t in (sample.get("turns") or []) if isinstance(t, Mapping)]
    if len(turns) > 1:
        calls = int(sample.get("tool_calls") or 0)
        head += f" · {sum(t.get('role') == 'assistant' for t in turns)} turns, {calls} tool call{'s' * (calls != 1)}"
        lines = [(TURN_NAMES.get(str(t.get("role")), "?"), str(t.get("text", ""))) for t in turns]
        return ("\n".join([head, f"Q: {_short(prompt)}", *(f"{who}: {_short(text)}" for who, text in lines)]),
                "\n".join([head, f"Q: {prompt}", *(f"{who}: {text}" for who, text in lines)]))
    return (f"{head}\nQ: {_short(prompt)}\nA: {_short(answer) or '(nothing)'}",
            f"{head}\nQ: {prompt}\nA: {answer}")


def describe_monitor(monitor: Mapping[str, Any] | None) -> str:
    """One line of the reward-hacking monitor, or "" when there is none yet."""
    if not isinstance(monitor, Mapping) or not monitor.get("episodes"):
        return ""
    text = (f"{float(monitor.get('mean_turns', 0)):.1f} turns and {float(monitor.get('mean_tool_calls', 0)):.1f} "
            f"tool calls per episode · commonest answer {100 * float(monitor.get('commonest_share', 0)):.0f}% "
            f"(gold {100 * float(monitor.get('gold_share', 0)):.0f}%)")
    tells = [str(t) for t in (monitor.get("suspicious") or [])]
    return text + (" · check for reward hacking: " + ", ".join(tells) if tells else " · no shortcut seen")


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
        self.monitor = QLabel("")
        self.monitor.setObjectName("FieldName")
        self.monitor.setWordWrap(True)
        self.monitor.hide()
        outer.addWidget(self.monitor)
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
        line = describe_monitor(swarm.get("monitor"))
        self.monitor.setText(line)
        self.monitor.setVisible(bool(line))

    def shown_texts(self) -> list[str]:
        """The sample rows' texts, newest first (what a person reads)."""
        return [row.text() for row in self.rows if not row.isHidden()]
