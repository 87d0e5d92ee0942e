"""Import a local Hugging Face checkpoint directory (Llama, Qwen2, Qwen3) by copying its files.

The source is what ``save_pretrained`` writes or a hub snapshot holds:
``config.json``, one ``model.safetensors`` or shards listed in
``model.safetensors.index.json``, ``tokenizer.json`` with its
``tokenizer_config.json`` (and maybe ``chat_template.jinja``,
``special_tokens_map.json``, ``generation_config.json``). The weight files are
copied byte for byte, so the imported model's logits are the source's exactly;
nothing is converted and torch is not needed. Everything else a source might hold
(``pytorch_model.bin``, ``tokenizer.model``, READMEs, optimizer states) is left
behind — and a source that has *only* such files is refused with a message that
says how to convert it.

This module knows the source layout; ``output`` finishes and checks the result.
"""

from __future__ import annotations

import logging
import shutil
from pathlib import Path

from engine.model.checkpoint import CONFIG_FILE, INDEX_FILE, SINGLE_FILE
from engine.model.errors import CheckpointError
from engine.model.importers.output import (
    CHAT_TEMPLATE_FILE,
    GENERATION_CONFIG_FILE,
    TOKENIZER_CONFIG_FILE,
    TOKENIZER_FILE,
    ImportResult,
    check_out_dir,
    finish,
    read_json,
    staging_dir,
)

log = logging.getLogger(__name__)

#: side files copied when present
OPTIONAL_FILES = (TOKENIZER_CONFIG_FILE, CHAT_TEMPLATE_FILE, "special_tokens_map.json", GENERATION_CONFIG_FILE)


def weight_files(source: Path) -> list[str]:
    """The safetensors file names of a source directory (the index's, or the single file)."""
    index_path = source / INDEX_FILE
    if index_path.exists():
        index = read_json(index_path)
        weight_map = index.get("weight_map")
        if not isinstance(weight_map, dict) or not weight_map:
            raise CheckpointError(index_path, "has no 'weight_map' object mapping tensor names to files")
        names = sorted(set(weight_map.values()))
        for name in names:
            if not isinstance(name, str) or Path(name).name != name or not name.endswith(".safetensors"):
                raise CheckpointError(index_path, f"lists {name!r}, which is not a .safetensors file in the directory")
            if not (source / name).is_file():
                raise CheckpointError(source / name, f"missing, although {INDEX_FILE} lists it; "
                                                     f"copy the complete set of shards")
        return names
    if (source / SINGLE_FILE).is_file():
        return [SINGLE_FILE]
    if any(source.glob("*.bin")) or any(source.glob("*.pt")):
        raise CheckpointError(source / SINGLE_FILE, "not found: this checkpoint is in PyTorch .bin format; "
                                                    "convert it to safetensors first (load it with transformers and "
                                                    "save_pretrained(dir, safe_serialization=True))")
    raise CheckpointError(source / SINGLE_FILE, f"not found (and no {INDEX_FILE}): the directory holds no weights")


def import_hf_dir(source: str | Path, out_dir: str | Path, *, overwrite: bool = False) -> ImportResult:
    """Copy the checkpoint in ``source`` into a finished Polis base at ``out_dir``."""
    source, out_dir = Path(source), Path(out_dir)
    if not source.is_dir():
        raise CheckpointError(source, "not a directory (give a Hugging Face checkpoint directory, a .gguf file "
                                      "or smollm2-135m)")
    if source.resolve() == out_dir.resolve():
        raise CheckpointError(out_dir, "is the source directory itself; choose another --out")
    config = read_json(source / CONFIG_FILE)
    if not (source / TOKENIZER_FILE).is_file():
        hint = ""
        if (source / "tokenizer.model").exists():
            hint = (" (only a sentencepiece tokenizer.model is there: load the directory once with transformers' "
                    "AutoTokenizer and save_pretrained it to write tokenizer.json)")
        raise CheckpointError(source / TOKENIZER_FILE, f"not found{hint}")
    files = [CONFIG_FILE, TOKENIZER_FILE, *weight_files(source)]
    if (source / INDEX_FILE).exists():
        files.append(INDEX_FILE)
    files += [name for name in OPTIONAL_FILES if (source / name).is_file()]
    check_out_dir(out_dir, overwrite=overwrite)
    staging = staging_dir(out_dir)
    try:
        for name in files:
            shutil.copyfile(source / name, staging / name)
    except BaseException:
        shutil.rmtree(staging, ignore_errors=True)
        raise
    name = str(config.get("_name_or_path") or source.name)
    log.info("copied %d files from %s", len(files), source)
    return finish(staging, out_dir, name=Path(name).name or source.name, source=str(source.resolve()),
                  kind="hf-dir", overwrite=overwrite)
