"""How to start another ``polis`` process from this one (a node, a coordinator).

From a source checkout or an installed package that is ``python -m engine.cli``;
from a frozen bundle (PyInstaller sets ``sys.frozen``) it is the bundle's own
executable, which dispatches its first argument like the ``polis`` command.
It knows nothing about what the child process does.
"""

from __future__ import annotations

import sys


def polis_command(*args: str) -> list[str]:
    """argv that runs ``polis ARGS...`` in a new process."""
    if getattr(sys, "frozen", False):
        return [sys.executable, *args]
    return [sys.executable, "-m", "engine.cli", *args]
