"""Turns the node's stderr log lines into lines a contributor can read.

A stderr line looks like ``2026-12-03 08:50:01,123 INFO engine.net.peer_manager: link
to 3f9a… open``. :func:`classify` strips the stream's own timestamp (the log view
adds exactly one), keeps the level, rewords the events people care about (a link to
another computer opened, dropped or failed) and marks everything else — library
chatter from aioice, aiortc, aiohttp, zeroconf, and the engine's own debug and info
lines — as *detail*, shown only when the user asks for details. Pure functions; knows
the log line format of ``polis node`` and the wording of its link messages, nothing
about Qt.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

_LINE = re.compile(r"^(?:\d{4}-\d\d-\d\d[ T])?(\d\d:\d\d:\d\d)(?:[,.]\d+)?\s+"
                   r"(DEBUG|INFO|WARNING|ERROR|CRITICAL)\s+([\w.\-]+):\s?(.*)$")
_CHATTER = ("aioice", "aiortc", "aiohttp", "zeroconf", "asyncio", "urllib3", "websockets")
_LINK_OPEN = re.compile(r"^link to (\S+) open\b")
_LINK_CLOSED = re.compile(r"^link to (\S+) closed \((\w+)\)")


@dataclass(frozen=True)
class LogLine:
    """One line for the log view."""

    clock: str | None  # "HH:MM:SS" from the stream, or None (the view uses the time it arrived)
    level: str  # debug | info | warning | error
    message: str
    detail: bool  # shown only with "Details" on
    source: str = ""  # logger name, for detail lines


def short_peer(peer_id: str) -> str:
    """A peer id as people can tell them apart: its first 8 characters."""
    return peer_id[:8] + "…" if len(peer_id) > 9 else peer_id


def _link_words(message: str) -> tuple[str, str, bool] | None:
    """(level, words, detail) for the peer-link events, or None when ``message`` is not one."""
    opened = _LINK_OPEN.match(message)
    if opened:
        return "info", f"Connected to computer {short_peer(opened.group(1))} of the swarm.", False
    closed = _LINK_CLOSED.match(message)
    if not closed:
        return None
    peer, reason = short_peer(closed.group(1)), closed.group(2)
    if reason == "local":  # this side closed it: leaving, or a fresh connection replaced it
        return "info", f"Closed an old connection to computer {peer} (normal when a new one replaces it).", True
    if reason == "remote":
        return "info", f"Computer {peer} left or closed its connection.", False
    if reason == "strikes":
        return "warning", f"Disconnected computer {peer}: it sent invalid data too often.", False
    return "warning", f"Lost the connection to computer {peer}; Polis reconnects by itself.", False


def classify(raw: str) -> LogLine:
    """One stderr line of the node as a :class:`LogLine`."""
    text = raw.rstrip()
    match = _LINE.match(text)
    if not match:  # a traceback or a plain print ("polis node: ..."): each repeats an event the window shows
        return LogLine(None, "error" if text.startswith("Traceback") else "info", text, detail=True)
    clock, level, source, message = match.groups()
    level = {"CRITICAL": "error"}.get(level, level.lower())
    worded = _link_words(message)
    if worded is not None and level != "debug":
        link_level, words, detail = worded
        return LogLine(clock, link_level, words, detail=detail, source=source)
    chatter = source.split(".")[0] in _CHATTER
    detail = chatter or level in ("debug", "info")
    return LogLine(clock, level, message, detail=detail, source=source)
