"""Reading a small JSON file of a checkpoint (config.json, tokenizer_config.json, ...) as untrusted input.

``read_json_object(path, max_bytes=...)`` returns the JSON object in ``path`` or raises
:class:`~engine.model.errors.CheckpointError` naming the file and what is wrong: missing,
over the size cap (checked before reading), not UTF-8, not JSON, or not an object.
It knows nothing about what the keys mean.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from engine.model.errors import CheckpointError


def read_json_object(path: str | Path, *, max_bytes: int, missing: str = "file not found") -> dict[str, Any]:
    """The JSON object in ``path`` (at most ``max_bytes``); ``missing`` is the message when absent."""
    path = Path(path)
    try:
        size = path.stat().st_size
        if size > max_bytes:
            raise CheckpointError(path, f"is {size} bytes, over the {max_bytes}-byte cap for this file")
        data = json.loads(path.read_text(encoding="utf-8"))
    except FileNotFoundError:
        raise CheckpointError(path, missing) from None
    except (UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise CheckpointError(path, f"not valid JSON ({exc})") from None
    if not isinstance(data, dict):
        raise CheckpointError(path, "is not a JSON object")
    return data
