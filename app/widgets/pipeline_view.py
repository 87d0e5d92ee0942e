"""The pipeline at a glance: one box per stage (its layers and how many replicas serve it),
arrows in pipeline order, and the stage this computer serves highlighted.

Paints the ``stages`` list of a ``swarm`` event; knows nothing else.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Mapping

from PySide6.QtCore import QPointF, QRectF, Qt
from PySide6.QtGui import QColor, QFont, QPainter, QPainterPath, QPen
from PySide6.QtWidgets import QFrame, QLabel, QVBoxLayout, QWidget

from app import style

MAX_DOTS = 8


@dataclass(frozen=True)
class StageInfo:
    index: int
    layers: str
    replicas: int
    mine: bool


def parse_stages(items: Any) -> list[StageInfo]:
    """Clean stage entries from a ``swarm`` event; malformed entries are skipped."""
    stages: list[StageInfo] = []
    if not isinstance(items, list):
        return stages
    for item in items[:64]:
        if not isinstance(item, Mapping) or not isinstance(item.get("stage"), int):
            continue
        replicas = item.get("replicas")
        stages.append(StageInfo(index=item["stage"], layers=str(item.get("layers") or "")[:40],
                                replicas=replicas if isinstance(replicas, int) and replicas >= 0 else 0,
                                mine=item.get("mine") is True))
    return sorted(stages, key=lambda s: s.index)


class _PipelineCanvas(QWidget):
    def __init__(self, parent: QWidget | None = None) -> None:
        super().__init__(parent)
        self.stages: list[StageInfo] = []
        self.setMinimumHeight(104)

    def paintEvent(self, event: Any) -> None:  # noqa: N802 - Qt API
        painter = QPainter(self)
        painter.setRenderHint(QPainter.RenderHint.Antialiasing)
        rect = QRectF(self.rect()).adjusted(2, 2, -2, -2)
        if not self.stages:
            painter.setPen(QColor(style.MUTED))
            painter.drawText(rect, Qt.AlignmentFlag.AlignCenter,
                             "The pipeline appears here once your node joins a swarm.")
            return
        n = len(self.stages)
        gap = 34.0
        width = min(220.0, (rect.width() - gap * (n - 1)) / n)
        total = width * n + gap * (n - 1)
        x = rect.left() + (rect.width() - total) / 2
        top, height = rect.top() + 12, rect.height() - 16
        base_font = QFont(self.font())
        for i, stage in enumerate(self.stages):
            box = QRectF(x, top, width, height)
            fill = QColor("#EEF2FF") if stage.mine else QColor(style.BACKGROUND)
            edge = QColor(style.ACCENT) if stage.mine else QColor(style.BORDER)
            painter.setPen(QPen(edge, 2 if stage.mine else 1))
            painter.setBrush(fill)
            painter.drawRoundedRect(box, 10, 10)
            title_font = QFont(base_font)
            title_font.setBold(True)
            painter.setFont(title_font)
            painter.setPen(QColor(style.TEXT))
            painter.drawText(box.adjusted(12, 8, -12, 0), Qt.AlignmentFlag.AlignLeft, f"Stage {stage.index + 1}")
            if stage.mine:
                self._draw_tag(painter, box)
            painter.setFont(base_font)
            painter.setPen(QColor(style.MUTED))
            painter.drawText(box.adjusted(12, 28, -12, 0), Qt.AlignmentFlag.AlignLeft, stage.layers)
            self._draw_replicas(painter, box, stage)
            if i < n - 1:
                self._draw_arrow(painter, box.right() + 6, box.right() + gap - 6, box.center().y())
            x += width + gap
        painter.end()

    @staticmethod
    def _draw_tag(painter: QPainter, box: QRectF) -> None:
        tag = QRectF(box.right() - 48, box.top() + 8, 38, 18)
        painter.setPen(Qt.PenStyle.NoPen)
        painter.setBrush(QColor(style.ACCENT))
        painter.drawRoundedRect(tag, 9, 9)
        painter.setPen(QColor("white"))
        font = QFont(painter.font())
        font.setPointSizeF(max(6.0, font.pointSizeF() * 0.8))
        painter.setFont(font)
        painter.drawText(tag, Qt.AlignmentFlag.AlignCenter, "You")

    @staticmethod
    def _draw_replicas(painter: QPainter, box: QRectF, stage: StageInfo) -> None:
        y = box.bottom() - 16
        painter.setPen(Qt.PenStyle.NoPen)
        color = QColor(style.ACCENT if stage.mine else style.GOOD)
        for k in range(min(stage.replicas, MAX_DOTS)):
            painter.setBrush(color)
            painter.drawEllipse(QPointF(box.left() + 18 + k * 14, y), 4.5, 4.5)
        painter.setPen(QColor(style.MUTED))
        label = f"{stage.replicas} replica{'s' if stage.replicas != 1 else ''}"
        left = box.left() + 18 + min(stage.replicas, MAX_DOTS) * 14
        painter.drawText(QRectF(left, y - 9, box.right() - left - 8, 18),
                         Qt.AlignmentFlag.AlignLeft | Qt.AlignmentFlag.AlignVCenter, label)

    @staticmethod
    def _draw_arrow(painter: QPainter, x0: float, x1: float, y: float) -> None:
        painter.setPen(QPen(QColor(style.IDLE), 1.6))
        painter.drawLine(QPointF(x0, y), QPointF(x1 - 2, y))
        head = QPainterPath(QPointF(x1, y))
        head.lineTo(x1 - 7, y - 4.5)
        head.lineTo(x1 - 7, y + 4.5)
        head.closeSubpath()
        painter.setPen(Qt.PenStyle.NoPen)
        painter.setBrush(QColor(style.IDLE))
        painter.drawPath(head)


class PipelineView(QFrame):
    def __init__(self, parent: QWidget | None = None) -> None:
        super().__init__(parent)
        self.setObjectName("Card")
        layout = QVBoxLayout(self)
        layout.setContentsMargins(16, 12, 16, 12)
        layout.setSpacing(2)
        heading = QLabel("Pipeline")
        heading.setObjectName("SectionTitle")
        sub = QLabel("The model is split into stages; each stage is served by one or more computers.")
        sub.setObjectName("Muted")
        layout.addWidget(heading)
        layout.addWidget(sub)
        self.canvas = _PipelineCanvas()
        layout.addWidget(self.canvas, 1)

    def set_stages(self, items: Any) -> None:
        self.canvas.stages = parse_stages(items)
        self.canvas.update()

    @property
    def stages(self) -> list[StageInfo]:
        return list(self.canvas.stages)
