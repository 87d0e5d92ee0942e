"""Charts drawn with pyqtgraph: the swarm's eval accuracy and reward by policy version, and
this node's throughput over time.

Each chart takes plain numbers; neither knows about events or the node.
"""

from __future__ import annotations

import math
import time
from typing import Any, Iterable, Mapping

import pyqtgraph as pg
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


class _ChartCard(QFrame):
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
        self.plot = pg.PlotWidget()
        self.plot.setMinimumHeight(150)
        self.plot.showGrid(x=True, y=True, alpha=0.15)
        self.plot.setMenuEnabled(False)
        self.plot.setMouseEnabled(x=False, y=False)
        self.plot.hideButtons()
        for axis in ("left", "bottom"):
            self.plot.getAxis(axis).enableAutoSIPrefix(False)
            self.plot.getAxis(axis).setPen(pg.mkPen(style.BORDER))
            self.plot.getAxis(axis).setTextPen(pg.mkPen(style.MUTED))
        layout.addWidget(self.plot, 1)
        self.placeholder = pg.TextItem("", color=style.MUTED, anchor=(0.5, 0.5))
        self.plot.addItem(self.placeholder, ignoreBounds=True)

    def set_placeholder(self, text: str, x: float = 0.5, y: float = 0.5) -> None:
        self.placeholder.setText(text)
        self.placeholder.setPos(x, y)


class SwarmProgressChart(_ChartCard):
    """Eval accuracy (held-out, greedy) and mean reward, per policy version."""

    def __init__(self, parent: QWidget | None = None) -> None:
        super().__init__("Swarm learning", "Held-out accuracy and mean reward by policy version", parent)
        self.plot.setLabel("bottom", "policy version")
        self.plot.setYRange(0, 1, padding=0.06)
        legend = self.plot.addLegend(offset=(-8, -8), labelTextColor=style.MUTED)
        legend.setBrush(pg.mkBrush(255, 255, 255, 200))
        self.accuracy_curve = self.plot.plot([], [], name="eval accuracy", pen=pg.mkPen(style.ACCENT, width=2.5),
                                             symbol="o", symbolSize=5, symbolBrush=style.ACCENT,
                                             symbolPen=None)
        self.reward_curve = self.plot.plot([], [], name="mean reward", pen=pg.mkPen(style.GOOD, width=2),
                                           symbol="o", symbolSize=4, symbolBrush=style.GOOD, symbolPen=None)
        self.plot.setXRange(0, 1)
        self.set_placeholder("Appears after the swarm's first evaluation")

    def set_data(self, eval_points: Any, reward_points: Any) -> None:
        self.accuracy_curve.setData(*_points(eval_points, "accuracy"))
        self.set_placeholder("" if self.point_count() else "Appears after the swarm's first evaluation")
        if self.point_count():
            self.plot.enableAutoRange(axis="x")
        self.reward_curve.setData(*_points(reward_points, "reward"))
        ys = list(self.accuracy_curve.yData if self.accuracy_curve.yData is not None else []) + \
            list(self.reward_curve.yData if self.reward_curve.yData is not None else [])
        top = max([1.0, *ys])
        self.plot.setYRange(min([0.0, *ys]), top, padding=0.06)

    def point_count(self) -> int:
        data = self.accuracy_curve.xData
        return 0 if data is None else len(data)


class ThroughputChart(_ChartCard):
    """This node's generation throughput (tokens per second) over the session."""

    def __init__(self, max_points: int = 1800, parent: QWidget | None = None) -> None:
        super().__init__("Your throughput", "Tokens generated per second, this session", parent)
        self.plot.setLabel("bottom", "seconds")
        self.max_points = max_points
        self._t0: float | None = None
        self._xs: list[float] = []
        self._ys: list[float] = []
        self._unit = "seconds"
        fill = pg.mkBrush(79, 70, 229, 40)
        self.curve = self.plot.plot([], [], pen=pg.mkPen(style.ACCENT, width=2), fillLevel=0, brush=fill)
        self.plot.setXRange(0, 1)
        self.plot.setYRange(0, 1)
        self.set_placeholder("Appears once your node is contributing")

    def add_sample(self, tokens_per_s: float, at: float | None = None) -> None:
        if not isinstance(tokens_per_s, (int, float)) or isinstance(tokens_per_s, bool) \
                or not math.isfinite(tokens_per_s) or tokens_per_s < 0:
            return
        at = time.monotonic() if at is None else at
        if self._t0 is None:
            self._t0 = at
            self.set_placeholder("")
            self.plot.enableAutoRange()
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
        self.curve.setData([x / divisor for x in self._xs], self._ys)

    def samples(self) -> Iterable[float]:
        return list(self._ys)
