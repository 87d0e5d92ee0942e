"""Import a GGUF file: dequantise it with ``transformers`` + ``gguf`` and save it in HF layout.

``transformers`` reads GGUF (Llama, Qwen2, Qwen3 and others) into an ordinary
model, dequantising every tensor; the tokenizer (with its chat template) comes
from the same file. The model is saved as fp32 safetensors — the dequantised
values are not all representable in bf16, and "the same logits as the source"
is the promise — after clearing the GGUF quantizer state that makes
``save_pretrained`` refuse ("quantized model"). The saved directory is then
reloaded and its logits compared with the in-memory model's on a fixed batch;
the difference is part of the result.

torch, transformers, gguf and accelerate are imported when an import runs (the
``real-model`` extra); a missing one is a :class:`~engine.extras.MissingExtra`
that gives the pip command. This module knows the conversion; ``output``
finishes and checks the directory.
"""

from __future__ import annotations

import dataclasses
import logging
import os
import shutil
from pathlib import Path

from engine.extras import require
from engine.model.errors import CheckpointError
from engine.model.importers.output import ImportResult, check_out_dir, finish, staging_dir

log = logging.getLogger(__name__)

#: packages a GGUF import needs
GGUF_REQUIREMENTS = ("torch", "transformers", "gguf", "accelerate")
#: largest |logit| difference between the saved directory and the dequantised model accepted (fp32)
RELOAD_ATOL = 1e-4
#: the fixed batch the reload check runs (token ids modulo the vocabulary)
_CHECK_TOKENS = [[1, 9, 4, 7, 3, 11, 42, 5, 6, 2, 8, 13]]


def gguf_name(path: Path) -> str:
    """``general.name`` from the GGUF metadata, else the file name without its extension."""
    try:
        import gguf

        field = gguf.GGUFReader(str(path)).fields.get("general.name")
        if field is not None and field.data:
            return bytes(field.parts[field.data[0]]).decode("utf-8", "replace").strip() or path.stem
    except Exception as exc:  # metadata is a nicety; a broken header fails loudly in the import itself
        log.debug("no general.name in %s: %s", path, exc)
    return path.stem


def import_gguf(source: str | Path, out_dir: str | Path, *, overwrite: bool = False, kind: str = "gguf",
                name: str | None = None) -> ImportResult:
    """Dequantise ``source`` (a .gguf file) into a finished Polis base at ``out_dir``."""
    source, out_dir = Path(source), Path(out_dir)
    if not source.is_file():
        raise CheckpointError(source, "GGUF file not found")
    with open(source, "rb") as f:
        if f.read(4) != b"GGUF":
            raise CheckpointError(source, "not a GGUF file (it does not start with the GGUF magic)")
    require("importing a GGUF file", GGUF_REQUIREMENTS)
    check_out_dir(out_dir, overwrite=overwrite)
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer
    from transformers.utils import logging as hf_logging

    hf_logging.disable_progress_bar()
    staging = staging_dir(out_dir)
    try:
        try:
            model = AutoModelForCausalLM.from_pretrained(str(source.parent), gguf_file=source.name,
                                                         dtype=torch.float32, local_files_only=True)
            tokenizer = AutoTokenizer.from_pretrained(str(source.parent), gguf_file=source.name,
                                                      local_files_only=True)
        except (ValueError, KeyError, RuntimeError) as exc:
            raise CheckpointError(source, f"transformers cannot read this GGUF file ({exc})") from None
        model.eval()
        _clear_quantizer(model)
        model.save_pretrained(str(staging), safe_serialization=True)
        tokenizer.save_pretrained(str(staging))
        diff = _reload_diff(model, staging, torch)
        del model
        if diff > RELOAD_ATOL:
            raise CheckpointError(source, f"the saved model's logits differ from the GGUF model's by {diff:.2e} "
                                          f"(accepted: {RELOAD_ATOL:.0e}); this is a bug, please report it")
    except BaseException:
        shutil.rmtree(staging, ignore_errors=True)
        raise
    result = finish(staging, out_dir, name=name or gguf_name(source), source=str(source.resolve()), kind=kind,
                    overwrite=overwrite)
    return dataclasses.replace(result, max_abs_logit_diff=diff)


def _clear_quantizer(model) -> None:
    """Make a dequantised GGUF model an ordinary one, so ``save_pretrained`` writes plain tensors."""
    model.hf_quantizer = None
    if hasattr(model.config, "quantization_config"):
        del model.config.quantization_config
    model.is_quantized = False


def _reload_diff(model, directory: Path, torch) -> float:
    from transformers import AutoModelForCausalLM

    tokens = torch.tensor(_CHECK_TOKENS, dtype=torch.int64) % model.config.vocab_size
    reloaded = AutoModelForCausalLM.from_pretrained(str(directory), dtype=torch.float32, local_files_only=True).eval()
    with torch.no_grad():
        diff = (model(tokens).logits - reloaded(tokens).logits).abs().max().item()
    del reloaded
    return float(diff)
