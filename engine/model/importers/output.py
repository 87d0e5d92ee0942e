"""The finished import: one HF-layout directory, made consistent and checked before it is published.

Every importer writes its weights and tokenizer into a staging directory; this
module then makes the directory the same whatever the source was:

* the chat template lives in ``tokenizer_config.json`` (``chat_template``); a
  ``chat_template.jinja`` that newer ``transformers`` writes beside it is folded
  in and removed, so there is one copy to read;
* ``generation_config.json`` exists (derived from ``config.json``'s token ids
  when the source had none);
* ``polis_model.json`` records where the model came from (name, source, kind);

then checks it (``config.json`` describes a model Polis runs, every tensor a
whole-model stage needs is present with the right shape, the tokenizer loads and
the chat template renders) and renames it into place. A failed import leaves no
half-written output. This module knows file names and JSON fields; it does not
know how weights are converted.
"""

from __future__ import annotations

import json
import logging
import os
import shutil
import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from backends.base import StageSpec
from engine.model.chat_template import ChatTemplate, ChatTemplateError
from engine.model.checkpoint import CONFIG_FILE, Checkpoint
from engine.model.errors import CheckpointError
from engine.model.json_file import read_json_object

log = logging.getLogger(__name__)

TOKENIZER_FILE = "tokenizer.json"
TOKENIZER_CONFIG_FILE = "tokenizer_config.json"
CHAT_TEMPLATE_FILE = "chat_template.jinja"
GENERATION_CONFIG_FILE = "generation_config.json"
MANIFEST_FILE = "polis_model.json"
#: largest JSON side file read here (real ones are a few KB; a tokenizer_config with a template, tens of KB)
MAX_JSON_BYTES = 4 * 1024 * 1024
#: model types an import accepts; the ones ``ModelConfig`` runs are checked in full
IMPORTABLE_MODEL_TYPES = ("llama", "qwen2", "qwen3")
#: tokenizer_config.json keys that describe one load, not the tokenizer
_LOAD_TIME_KEYS = ("is_local", "local_files_only", "name_or_path", "_commit_hash")


@dataclass(frozen=True)
class ImportResult:
    """What ``polis import`` made."""

    out_dir: Path  #: the finished HF-layout directory
    name: str  #: the model's name (for people: the window, the model card)
    kind: str  #: ``"hf-dir"``, ``"gguf"`` or ``"smollm2-135m"``
    model_type: str  #: ``config.json``'s model_type
    num_parameters: int | None  #: from the config (tied head counted once); None if Polis cannot run it
    has_chat_template: bool  #: tokenizer_config.json carries a chat template
    runs_in_polis: bool  #: the stage backends can run this architecture
    notes: tuple[str, ...] = ()  #: things the user should know (no chat template, ...)
    #: converted sources: max |logits(saved) - logits(source)| on a fixed batch, fp32; None for byte copies
    max_abs_logit_diff: float | None = None


def read_json(path: Path) -> dict[str, Any]:
    """A JSON object from ``path``; any problem is a CheckpointError naming it."""
    return read_json_object(path, max_bytes=MAX_JSON_BYTES)


def write_json(path: Path, data: dict[str, Any]) -> None:
    path.write_text(json.dumps(data, indent=2, ensure_ascii=False) + "\n", encoding="utf-8")


def staging_dir(out_dir: Path) -> Path:
    """A fresh empty directory beside ``out_dir`` (same filesystem, so publishing is a rename)."""
    out_dir.parent.mkdir(parents=True, exist_ok=True)
    return Path(tempfile.mkdtemp(prefix=f".{out_dir.name}.importing-", dir=out_dir.parent))


def check_out_dir(out_dir: Path, *, overwrite: bool) -> None:
    """Refuse to replace a non-empty ``out_dir`` unless asked to."""
    if out_dir.exists() and (not out_dir.is_dir() or any(out_dir.iterdir())) and not overwrite:
        raise CheckpointError(out_dir, "already exists and is not empty; choose another --out or pass --force")


def finish(staging: Path, out_dir: Path, *, name: str, source: str, kind: str, overwrite: bool) -> ImportResult:
    """Normalise, check and publish ``staging`` as ``out_dir`` (see the module docstring)."""
    try:
        result = _normalise_and_check(staging, out_dir, name=name, source=source, kind=kind)
        check_out_dir(out_dir, overwrite=overwrite)
    except BaseException:
        shutil.rmtree(staging, ignore_errors=True)
        raise
    publish_staged(staging, out_dir)
    return result


def publish_staged(staging: Path, out_dir: Path) -> None:
    """Replace ``out_dir`` with the complete ``staging`` directory (made readable as a plain mkdir
    would be) by one rename; on any failure the staging directory is removed and ``out_dir`` is
    left as it was, or absent. The one publishing step of ``polis import`` and ``polis export``."""
    try:
        if out_dir.exists():
            shutil.rmtree(out_dir) if out_dir.is_dir() else out_dir.unlink()
        _make_readable(staging)
        os.replace(staging, out_dir)
    except BaseException:
        shutil.rmtree(staging, ignore_errors=True)
        raise


def _make_readable(directory: Path) -> None:
    """Give the staged directory and its files the modes a plain mkdir/open would (mkdtemp makes them private)."""
    probe = directory / ".mode-probe"  # a plain mkdir shows the umask without changing it process-wide
    probe.mkdir()
    mode = probe.stat().st_mode & 0o777
    probe.rmdir()
    os.chmod(directory, mode)
    for path in directory.iterdir():
        os.chmod(path, mode & 0o666)


def _normalise_and_check(staging: Path, out_dir: Path, *, name: str, source: str, kind: str) -> ImportResult:
    config = read_json(staging / CONFIG_FILE)
    model_type = config.get("model_type")
    if model_type not in IMPORTABLE_MODEL_TYPES:
        raise CheckpointError(Path(source) / CONFIG_FILE if kind == "hf-dir" else Path(source),
                              f"model_type {model_type!r} cannot be imported "
                              f"(supported: {', '.join(IMPORTABLE_MODEL_TYPES)})")
    notes: list[str] = []
    has_template = _fold_chat_template(staging, config.get("max_position_embeddings"))
    if not has_template:
        notes.append("the tokenizer has no chat template: chat tasks will refuse this model "
                     "(the digit tasks still work)")
    _ensure_generation_config(staging, config)
    runs = model_type != "qwen3"
    parameters = None
    if runs:
        checkpoint = Checkpoint(staging)  # config.json + weight files, strictly
        checkpoint.check_stage(StageSpec(0, 1, 0, checkpoint.config.num_hidden_layers))
        parameters = checkpoint.config.num_parameters
    else:
        notes.append("qwen3 (per-head q/k RMSNorm) loads in transformers, but Polis's stage backends do not "
                     "run it yet: `polis node` will refuse this directory")
    _check_tokenizer(staging)
    write_json(staging / MANIFEST_FILE, {"name": name, "source": source, "kind": kind, "model_type": model_type})
    return ImportResult(out_dir=out_dir, name=name, kind=kind, model_type=model_type, num_parameters=parameters,
                        has_chat_template=has_template, runs_in_polis=runs, notes=tuple(notes))


def _check_tokenizer(staging: Path) -> None:
    """The tokenizer loads with ``tokenizers`` and the chat template (if any) renders a turn."""
    from tokenizers import Tokenizer

    path = staging / TOKENIZER_FILE
    if not path.exists():
        raise CheckpointError(path, "missing: the import produced no tokenizer.json")
    try:
        Tokenizer.from_file(str(path))
    except Exception as exc:  # tokenizers raises a bare Exception for malformed files
        raise CheckpointError(path, f"not a usable tokenizer ({exc})") from None
    try:
        template = ChatTemplate.from_tokenizer_config(read_json(staging / TOKENIZER_CONFIG_FILE))
        if template is not None:
            template.render([{"role": "user", "content": "2 + 2?"}])
    except ChatTemplateError as exc:
        raise CheckpointError(staging / TOKENIZER_CONFIG_FILE, str(exc)) from None


def _fold_chat_template(staging: Path, max_positions: Any = None) -> bool:
    """Move ``chat_template.jinja`` into ``tokenizer_config.json`` and drop load-time keys; True with a template."""
    config_path = staging / TOKENIZER_CONFIG_FILE
    tok_config = read_json(config_path) if config_path.exists() else {"tokenizer_class": "PreTrainedTokenizerFast"}
    jinja = staging / CHAT_TEMPLATE_FILE
    if jinja.exists():
        tok_config["chat_template"] = jinja.read_text(encoding="utf-8")
        jinja.unlink()
    for key in _LOAD_TIME_KEYS:  # what transformers 5 records about how *it* loaded the files
        tok_config.pop(key, None)
    if tok_config.get("tokenizer_class") == "TokenizersBackend":  # transformers 5's name; 4.x knows the alias
        tok_config["tokenizer_class"] = "PreTrainedTokenizerFast"
    limit = tok_config.get("model_max_length")
    if isinstance(limit, (int, float)) and limit > 1e12 and isinstance(max_positions, int):  # "no limit" sentinel
        tok_config["model_max_length"] = max_positions
    write_json(config_path, tok_config)
    return isinstance(tok_config.get("chat_template"), (str, list)) and bool(tok_config["chat_template"])


def _ensure_generation_config(staging: Path, config: dict[str, Any]) -> None:
    path = staging / GENERATION_CONFIG_FILE
    if path.exists():
        read_json(path)  # must at least parse
        return
    write_json(path, {key: config[key] for key in ("bos_token_id", "eos_token_id", "pad_token_id")
                      if config.get(key) is not None})
