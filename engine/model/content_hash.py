"""A content hash of a set of named tensors: what a stage checkpoint is verified against.

``tensors_sha256`` is the SHA-256 of the tensors as fp32, taken in name order over each
tensor's name, shape and little-endian bytes. It is written into a stage checkpoint's
safetensors metadata when the stage is saved (``engine.swarm.stage_runtime``) and checked
again by whoever reads the file back for export (``engine.model.export``), so a stage file
that was truncated, edited or mixed up with another stage's is refused. It does not depend
on the file's layout (header order, padding), only on the values.

It knows nothing about stages, versions or files.
"""

from __future__ import annotations

import hashlib
import json
from typing import Mapping

import numpy as np

#: the metadata key under which a stage checkpoint carries its content hash
METADATA_KEY = "polis_sha256"


def tensors_sha256(tensors: Mapping[str, np.ndarray]) -> str:
    """Hex SHA-256 of ``tensors`` (name -> array), as fp32, in sorted name order."""
    digest = hashlib.sha256()
    for name in sorted(tensors):
        array = np.ascontiguousarray(tensors[name], dtype="<f4")
        digest.update(json.dumps([name, list(array.shape)]).encode("utf-8"))
        digest.update(array.tobytes())
    return digest.hexdigest()
