"""Icons drawn with QPainter: the app mark and one tray icon per state (idle / contributing / error).

Drawn at run time so they are crisp at every size and need no files. The mark is
a small pipeline: three linked nodes, the middle one in the state's colour.
Knows nothing about the node or the window.
"""

from __future__ import annotations

from PySide6.QtCore import QPointF, QRectF, Qt
from PySide6.QtGui import QColor, QIcon, QPainter, QPen, QPixmap

from app import style

TRAY_STATE_COLORS = {"idle": style.IDLE, "contributing": style.GOOD, "error": style.BAD,
                     "waiting": style.WARN}


def _draw_mark(size: int, accent: str, badge: str | None) -> QPixmap:
    pixmap = QPixmap(size, size)
    pixmap.fill(Qt.GlobalColor.transparent)
    painter = QPainter(pixmap)
    painter.setRenderHint(QPainter.RenderHint.Antialiasing)
    s = float(size)
    painter.setPen(Qt.PenStyle.NoPen)
    painter.setBrush(QColor(style.ACCENT))
    painter.drawRoundedRect(QRectF(0.04 * s, 0.04 * s, 0.92 * s, 0.92 * s), 0.22 * s, 0.22 * s)
    centers = [QPointF(0.26 * s, 0.62 * s), QPointF(0.5 * s, 0.36 * s), QPointF(0.74 * s, 0.62 * s)]
    painter.setPen(QPen(QColor(255, 255, 255, 200), max(1.0, 0.06 * s), Qt.PenStyle.SolidLine,
                        Qt.PenCapStyle.RoundCap))
    painter.drawLine(centers[0], centers[1])
    painter.drawLine(centers[1], centers[2])
    painter.setPen(Qt.PenStyle.NoPen)
    radius = 0.11 * s
    for i, center in enumerate(centers):
        painter.setBrush(QColor(accent) if i == 1 else QColor("white"))
        painter.drawEllipse(center, radius, radius)
    if badge:
        painter.setBrush(QColor(badge))
        painter.setPen(QPen(QColor("white"), max(1.0, 0.05 * s)))
        painter.drawEllipse(QPointF(0.8 * s, 0.2 * s), 0.17 * s, 0.17 * s)
    painter.end()
    return pixmap


def app_icon() -> QIcon:
    icon = QIcon()
    for size in (16, 24, 32, 48, 64, 128, 256):
        icon.addPixmap(_draw_mark(size, "#A5B4FC", None))
    return icon


def tray_icon(state: str) -> QIcon:
    """The tray icon for ``state`` (one of TRAY_STATE_COLORS; unknown states look idle)."""
    color = TRAY_STATE_COLORS.get(state, style.IDLE)
    icon = QIcon()
    for size in (16, 22, 24, 32, 48, 64):
        icon.addPixmap(_draw_mark(size, "#FFFFFF", color))
    return icon
