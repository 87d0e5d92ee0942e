"""Numbers as people read them: counts, bytes, durations, rates.

Pure functions, no Qt. Knows nothing about where the numbers come from.
"""

from __future__ import annotations

import math


def count(value: float | int | None) -> str:
    """``1234567`` -> ``"1.23 M"``; small numbers stay exact (``"742"``)."""
    if value is None or not math.isfinite(float(value)):
        return "–"
    value = float(value)
    for threshold, suffix in ((1e12, " T"), (1e9, " B"), (1e6, " M"), (1e3, " k")):
        if abs(value) >= threshold:
            return f"{value / threshold:.3g}{suffix}"
    return f"{value:.0f}" if value == int(value) else f"{value:.1f}"


def data_size(num_bytes: float | int | None) -> str:
    """Bytes in decimal units: ``1_500_000`` -> ``"1.5 MB"``."""
    if num_bytes is None or not math.isfinite(float(num_bytes)):
        return "–"
    value = float(num_bytes)
    for unit in ("B", "kB", "MB", "GB", "TB"):
        if abs(value) < 1000 or unit == "TB":
            return f"{value:.0f} {unit}" if unit == "B" else f"{value:.3g} {unit}"
        value /= 1000
    return f"{value:.3g} TB"  # pragma: no cover - loop always returns


def duration(seconds: float | int | None) -> str:
    """``3725`` -> ``"1 h 02 min"``; ``42`` -> ``"42 s"``; days for long totals."""
    if seconds is None or not math.isfinite(float(seconds)) or seconds < 0:
        return "–"
    seconds = int(seconds)
    if seconds < 60:
        return f"{seconds} s"
    minutes, secs = divmod(seconds, 60)
    if minutes < 60:
        return f"{minutes} min {secs:02d} s"
    hours, minutes = divmod(minutes, 60)
    if hours < 24:
        return f"{hours} h {minutes:02d} min"
    days, hours = divmod(hours, 24)
    return f"{days} d {hours:02d} h"


def rate(per_second: float | None, unit: str) -> str:
    """``"1.2 k tokens/s"``."""
    if per_second is None or not math.isfinite(float(per_second)):
        return "–"
    value = float(per_second)
    text = count(value) if abs(value) >= 1000 else f"{value:.0f}" if abs(value) >= 10 else f"{value:.2g}"
    return f"{text} {unit}/s"
