"""Charts drawn with pyqtgraph: the swarm's eval accuracy and reward by policy version, and
this node's throughput over time.

Each chart takes plain numbers; neither knows about events or the node.
"""

from __future__ import annotations

import html
import math
import time
from typing import Any, Iterable, Mapping

import pyqtgraph as pg
from PySide6.QtCore import Qt
from PySide6.QtWidgets import QFrame, QLabel, QVBoxLayout, QWidget

from app import style

pg.setConfigOptions(antialias=True, background=style.SURFACE, foreground=style.MUTED)


def _points(items: Any, key: str) -> tuple[list[float], list[float]]:
    xs: list[float] = []
    ys: list[float] = []
    if not isinstance(items, list):
        return xs, ys
    for item in items:
        if not isinstance(item, Mapping):
            continue
        x, y = item.get("version"), item.get(key)
        if all(isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v) for v in (x, y)):
            xs.append(float(x))
            ys.append(float(y))
    order = sorted(range(len(xs)), key=xs.__getitem__)
    return [xs[i] for i in order], [ys[i] for i in order]


def _legend_html(entries: list[tuple[str, str, str]]) -> str:
    return "&nbsp;&nbsp;&nbsp;&nbsp;".join(
        f'<span style="color:{color}">●</span> {html.escape(name)}'
        + (f': <b style="color:{color}">{html.escape(value)}</b>' if value else "")
        for name, color, value in entries)


class _ChartCard(QFrame):
    """A titled card with a plot whose axes start at 0, a legend above the plot that also holds
    each series' latest value (so neither ever covers the data), and an optional caption under it."""

    def __init__(self, title: str, subtitle: str, parent: QWidget | None = None) -> None:
        super().__init__(parent)
        self.setObjectName("Card")
        layout = QVBoxLayout(self)
        layout.setContentsMargins(16, 12, 16, 10)
        layout.setSpacing(2)
        heading = QLabel(title)
        heading.setObjectName("SectionTitle")
        sub = QLabel(subtitle)
        sub.setObjectName("Muted")
        layout.addWidget(heading)
        layout.addWidget(sub)
        self.legend_label = QLabel()
        self.legend_label.setTextFormat(Qt.TextFormat.RichText)
        self.legend_label.hide()
        layout.addWidget(self.legend_label)
        self.plot = pg.PlotWidget()
        self.plot.setMinimumHeight(120)
        self.plot.showGrid(x=True, y=True, alpha=0.15)
        self.plot.setMenuEnabled(False)
        self.plot.setMouseEnabled(x=False, y=False)
        self.plot.hideButtons()
        for axis in ("left", "bottom"):
            self.plot.getAxis(axis).enableAutoSIPrefix(False)
            self.plot.getAxis(axis).setPen(pg.mkPen(style.BORDER))
            self.plot.getAxis(axis).setTextPen(pg.mkPen(style.MUTED))
        layout.addWidget(self.plot, 1)
        self.caption_label = QLabel()
        self.caption_label.setObjectName("Muted")
        self.caption_label.setWordWrap(False)
        self.caption_label.setStyleSheet("font-size: 11px;")
        self.caption_label.hide()
        layout.addWidget(self.caption_label)
        self.placeholder = pg.TextItem("", color=style.MUTED, anchor=(0.5, 0.5))
        self.plot.addItem(self.placeholder, ignoreBounds=True)
        self._latest: list[str] = []

    def set_legend(self, entries: list[tuple[str, str, str]]) -> None:
        """(series name, colour, latest value in words or "") per series."""
        self.legend_label.setText(_legend_html(entries))
        self.legend_label.setVisible(bool(entries))
        self._latest = [value for _, _, value in entries if value]

    def set_caption(self, text: str, tooltip: str = "") -> None:
        self.caption_label.setText(text)
        self.caption_label.setVisible(bool(text))
        self.setToolTip(tooltip or text)

    def set_placeholder(self, text: str, x: float = 0.5, y: float = 0.5) -> None:
        self.placeholder.setText(text)
        self.placeholder.setPos(x, y)

    def fit_from_zero(self, xs: list[float], ys: list[float], y_top: float = 1.0) -> None:
        """Both axes from 0 (the series are non-negative) to the data's maximum, never a range around 0."""
        x_top = max([1.0, *xs])
        top = max([y_top, *ys])
        # a hair below 0, so that the 0 tick is drawn and labelled
        self.plot.setXRange(-0.01 * x_top, x_top * 1.02, padding=0)
        self.plot.setYRange(-0.05 * top, top * 1.06, padding=0)  # room for the 0 label, centred on its tick

    @property
    def latest_labels(self) -> list[str]:
        """The latest values the legend shows, in words."""
        return list(self._latest)


ACCURACY_CAPTION = "Accuracy counts exact answers only; reward gives partial credit, so it runs higher."
ACCURACY_TOOLTIP = ("Held-out accuracy: the share of prompts the model never trains on that it answers exactly "
                    "right (greedy decoding). Mean reward: the average score of the training samples, where "
                    "nearly-right answers get partial credit, so it sits above accuracy.")


class SwarmProgressChart(_ChartCard):
    """Eval accuracy (held-out, greedy) and mean reward, per policy version."""

    def __init__(self, parent: QWidget | None = None) -> None:
        super().__init__("Swarm learning", "Held-out accuracy and mean reward by policy version", parent)
        self.plot.setLabel("bottom", "policy version")
        self.accuracy_curve = self.plot.plot([], [], name="held-out accuracy", pen=pg.mkPen(style.ACCENT, width=2.5),
                                             symbol="o", symbolSize=5, symbolBrush=style.ACCENT,
                                             symbolPen=None)
        self.reward_curve = self.plot.plot([], [], name="mean reward", pen=pg.mkPen(style.GOOD, width=2),
                                           symbol="o", symbolSize=4, symbolBrush=style.GOOD, symbolPen=None)
        self._legend_values("", "")
        self.set_caption(ACCURACY_CAPTION, ACCURACY_TOOLTIP)
        self.fit_from_zero([], [])
        self.set_placeholder("Appears after the swarm's first evaluation")

    def set_data(self, eval_points: Any, reward_points: Any, task: Any = None) -> None:
        acc_x, acc_y = _points(eval_points, "accuracy")
        rew_x, rew_y = _points(reward_points, "reward")
        self.accuracy_curve.setData(acc_x, acc_y)
        self.reward_curve.setData(rew_x, rew_y)
        self.fit_from_zero(acc_x + rew_x, acc_y + rew_y)
        x_mid = max([1.0, *acc_x, *rew_x]) / 2
        self.set_placeholder("" if acc_x else "Appears after the swarm's first evaluation", x_mid, 0.5)
        self._legend_values(f"{acc_y[-1]:.0%} at v{acc_x[-1]:.0f}" if acc_x else "",
                            f"{rew_y[-1]:.2f} at v{rew_x[-1]:.0f}" if rew_x else "")
        if isinstance(task, str) and task:
            self.set_caption(f"Task: {task[:40]}. {ACCURACY_CAPTION}", ACCURACY_TOOLTIP)

    def _legend_values(self, accuracy: str, reward: str) -> None:
        self.set_legend([("held-out accuracy (exact match)", style.ACCENT, accuracy),
                         ("mean reward (partial credit)", style.GOOD, reward)])

    def point_count(self) -> int:
        data = self.accuracy_curve.xData
        return 0 if data is None else len(data)


class ThroughputChart(_ChartCard):
    """This node's generation throughput (tokens per second) over the session."""

    def __init__(self, max_points: int = 1800, parent: QWidget | None = None) -> None:
        super().__init__("Your throughput", "Tokens your computer helped generate per second, this session", parent)
        self.plot.setLabel("bottom", "seconds")
        self.max_points = max_points
        self._t0: float | None = None
        self._xs: list[float] = []
        self._ys: list[float] = []
        self._unit = "seconds"
        fill = pg.mkBrush(79, 70, 229, 40)
        self.curve = self.plot.plot([], [], pen=pg.mkPen(style.ACCENT, width=2), fillLevel=0, brush=fill)
        self.fit_from_zero([], [])
        self.set_legend([("tokens per second", style.ACCENT, "")])
        self.set_placeholder("Appears once your node is contributing")

    def add_sample(self, tokens_per_s: float, at: float | None = None) -> None:
        if not isinstance(tokens_per_s, (int, float)) or isinstance(tokens_per_s, bool) \
                or not math.isfinite(tokens_per_s) or tokens_per_s < 0:
            return
        at = time.monotonic() if at is None else at
        if self._t0 is None:
            self._t0 = at
            self.set_placeholder("")
        self._xs.append(at - self._t0)
        self._ys.append(float(tokens_per_s))
        if len(self._xs) > self.max_points:
            del self._xs[0], self._ys[0]
        span_s = self._xs[-1]
        if span_s < 180:
            unit, divisor = "seconds", 1.0
        elif span_s < 3 * 3600:
            unit, divisor = "minutes", 60.0
        else:
            unit, divisor = "hours", 3600.0
        if unit != self._unit:
            self._unit = unit
            self.plot.setLabel("bottom", unit)
        xs = [x / divisor for x in self._xs]
        self.curve.setData(xs, self._ys)
        self.fit_from_zero(xs, self._ys)
        self.set_legend([("tokens per second", style.ACCENT, f"{self._ys[-1]:.0f} now")])

    def samples(self) -> Iterable[float]:
        return list(self._ys)
