"""Plain-words explanations of node failures, each with a next step for the user.

Maps what the supervisor observed (exit code, killed by a signal, the last stderr
lines, a process that would not start) to a title, an explanation and what to do.
Pure functions; no Qt, no knowledge of how the node is run.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Sequence


@dataclass(frozen=True)
class UserMessage:
    """What the window shows: a short title, what happened, what to do next."""

    title: str
    detail: str
    next_step: str


_PATTERNS: list[tuple[re.Pattern[str], str, str]] = [
    (re.compile(r"out of memory|OutOfMemoryError|MemoryError|CUDA error: out of memory|Cannot allocate memory", re.I),
     "The node ran out of memory.",
     "Lower the memory cap in Settings → Limits, close other heavy programs, then press Restart."),
    (re.compile(r"No module named|ImportError|ModuleNotFoundError|DLL load failed", re.I),
     "The node could not load one of its components; the installation looks incomplete.",
     "Reinstall Polis from the official download, then press Restart."),
    (re.compile(r"Connection refused|cannot connect|Name or service not known|getaddrinfo failed|"
                r"coordinator.*(unreachable|not reachable)|timed out", re.I),
     "The node could not reach the swarm's coordinator.",
     "Check your internet connection and the coordinator URL in Settings → Swarm, then press Restart."),
    (re.compile(r"Address already in use", re.I),
     "A network port the node needs is already in use, probably by another Polis node.",
     "Quit other Polis windows or `polis node` processes, then press Restart."),
    (re.compile(r"Permission denied|PermissionError", re.I),
     "The node was not allowed to read or write one of its files.",
     "Check that your user can write to the Polis data folder, then press Restart."),
    (re.compile(r"No space left on device", re.I),
     "The disk is full.",
     "Free some disk space, then press Restart."),
]


def _last_meaningful_line(stderr_tail: Sequence[str]) -> str:
    for line in reversed(stderr_tail):
        line = line.strip()
        if line and not line.startswith(("Traceback", "File ", "^")):
            return line[:300]
    return ""


def explain_crash(exit_code: int | None, killed_by_signal: bool, stderr_tail: Sequence[str]) -> UserMessage:
    """Why the node stopped unexpectedly, from its exit status and its last stderr lines."""
    text = "\n".join(stderr_tail[-60:])
    last = _last_meaningful_line(stderr_tail)
    said = f" Its last message was: “{last}”." if last else ""
    for pattern, detail, step in _PATTERNS:
        if pattern.search(text):
            return UserMessage("The Polis node stopped unexpectedly", detail + said, step)
    if killed_by_signal or exit_code in (-9, 137):
        return UserMessage(
            "The Polis node stopped unexpectedly",
            "The node was killed by the operating system or another program (this often means the "
            "system ran out of memory)." + said,
            "Press Restart. If it keeps happening, lower the memory cap in Settings → Limits.")
    code = f" with exit code {exit_code}" if exit_code is not None else ""
    return UserMessage("The Polis node stopped unexpectedly", f"The node exited{code}." + said,
                       "Press Restart. If it happens again, open the Log tab or use "
                       "“Export diagnostics…” and send the file to the Polis team.")


def explain_start_failure(error_text: str, program: str) -> UserMessage:
    """The node process could not be launched at all."""
    return UserMessage("Polis could not start its node",
                       f"Launching “{program}” failed: {error_text}.",
                       "Reinstall Polis, or check that your antivirus software does not block it.")


def explain_unresponsive(silent_s: float) -> UserMessage:
    """The node has sent nothing for a long time (it may hang)."""
    return UserMessage("The Polis node is not responding",
                       f"The node has not reported anything for {silent_s:.0f} seconds.",
                       "Wait a little longer if your computer is busy, or press Restart.")
