"""The one exception type for a checkpoint that cannot be used.

``CheckpointError`` is raised for a missing, truncated or corrupt checkpoint file
and for a ``config.json`` that describes a model Polis cannot run. Its message
always names the offending file, so a user can act on it without a traceback.
This module knows nothing about how files are read.
"""

from __future__ import annotations

from pathlib import Path


class CheckpointError(ValueError):
    """A checkpoint file is missing, corrupt, or describes an unsupported model.

    ``path`` is the offending file (also named in the message).
    """

    def __init__(self, path: str | Path, problem: str) -> None:
        self.path = Path(path)
        self.problem = problem
        super().__init__(f"{self.path}: {problem}")
