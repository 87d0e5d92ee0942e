"""Entry script of the frozen Polis app (PyInstaller): the same dispatcher as the ``polis`` command.

The bundle has one executable that is every ``polis`` command: with no argument
it opens the desktop app, ``polis node ...`` runs a node, ``polis coordinator
...`` a coordinator. The app starts its node child processes by running this
same executable again with a subcommand (``engine.self_command.polis_command``
checks ``sys.frozen``), so nothing here needs a Python interpreter on the
user's machine. ``multiprocessing.freeze_support()`` comes first so that any
library which spawns a multiprocessing worker re-enters the worker, not the app.
It knows nothing about what the commands do.
"""

from __future__ import annotations

import multiprocessing
import sys


def main() -> int:
    multiprocessing.freeze_support()
    from engine.cli import main as polis_main

    return polis_main()


if __name__ == "__main__":
    sys.exit(main())
