"""Where Polis finds its shipped resources and keeps per-user data.

Knows the on-disk layout only: the ``resources/`` folder (next to the source
tree, or inside a frozen bundle) and the per-user data directory. It does not
read or write any of the files it points to.
"""

from __future__ import annotations

import os
import sys
from pathlib import Path

APP_NAME = "Polis"


def resources_dir() -> Path:
    """The shipped ``resources/`` folder (base checkpoint, tasks, icons, default config)."""
    override = os.environ.get("POLIS_RESOURCES")
    if override:
        return Path(override)
    frozen_root = getattr(sys, "_MEIPASS", None)
    if frozen_root:
        return Path(frozen_root) / "resources"
    return Path(__file__).resolve().parent.parent / "resources"


def base_checkpoint_dir() -> Path:
    """The small base checkpoint shipped with Polis (HF layout)."""
    return resources_dir() / "base-model"


def imported_model_dir(name: str) -> Path:
    """Where ``polis demo --model NAME`` keeps (and a run's ``model: NAME`` finds) an imported base."""
    return user_data_dir() / "models" / name


def user_data_dir() -> Path:
    """Per-user writable directory (settings, identity fallback, stage checkpoints, logs)."""
    override = os.environ.get("POLIS_DATA_DIR")
    if override:
        path = Path(override)
    else:
        import platformdirs

        path = Path(platformdirs.user_data_dir(APP_NAME, appauthor=False))
    path.mkdir(parents=True, exist_ok=True)
    return path
