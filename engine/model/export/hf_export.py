"""One policy version of a run, written as an ordinary Hugging Face checkpoint directory.

``export_version`` takes every stage's verified checkpoint of the version
(``stage_files.read_stage``; ``engine.swarm.export_fetch`` gets them from a running swarm
instead) and ``write_export`` writes them, into a staging directory that is renamed into
place only when complete:

* one safetensors shard per stage, ``model-0000k-of-0000S.safetensors`` (fp32: exactly the
  values the swarm served), and ``model.safetensors.index.json`` naming each tensor's shard;
* ``config.json`` (the base's, fp32), ``generation_config.json`` and the tokenizer files of
  the base (``tokenizer.json``, ``tokenizer_config.json`` with its chat template,
  ``special_tokens_map.json`` when present), so plain ``transformers`` loads the folder;
* ``polis_model.json``: run id, version and each stage's content hash.

A tied model (``tie_word_embeddings``) is written with one embedding matrix: stage 0 and
the last stage each hold a copy, which must agree (``TIED_MAX_ABS_DIFF``; training keeps
them equal) and only stage 0's is written. A LoRA run's stage files hold adapters only:
by default they are merged into the base weights (``W + (alpha/r) B A``,
``backends.lora.merge``); with ``adapter=True`` the adapters are written in PEFT's format
instead (``peft_adapter``). The base checkpoint is needed for its config and tokenizer (and
a LoRA run's frozen weights); the stage files record where it was.

What it does not know: the database schema (``run_record``), evals, the model card.
"""

from __future__ import annotations

import logging
import shutil
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Mapping

import numpy as np

from backends.base import StageSpec
from backends.stage_layout import EMBED
from engine.model.checkpoint import CONFIG_FILE, INDEX_FILE, Checkpoint
from engine.model.errors import CheckpointError
from engine.model.export.run_record import RunRecord
from engine.model.export.stage_files import StageWeights, latest_common_version, read_stage
from engine.model.importers.output import (
    GENERATION_CONFIG_FILE,
    MANIFEST_FILE,
    TOKENIZER_CONFIG_FILE,
    TOKENIZER_FILE,
    check_out_dir,
    publish_staged,
    read_json,
    staging_dir,
    write_json,
)
from engine.model.shard_plan import plan_stages
from engine.model.tensor_names import stage_tensor_shapes

log = logging.getLogger(__name__)

#: most the two copies of a tied embedding may differ by (fp32; torch and MLX stages step them
#: to within 1e-6 of each other, a single backend bit-identically)
TIED_MAX_ABS_DIFF = 1e-5
#: tokenizer side files copied from the base when it has them
TOKENIZER_SIDE_FILES = ("special_tokens_map.json", "chat_template.jinja")


@dataclass(frozen=True)
class ExportResult:
    """What ``polis export`` wrote."""

    out_dir: Path
    version: int
    run_id: str
    base_dir: Path
    shards: tuple[str, ...]  #: shard file names, stage order (empty for an adapter export)
    stage_sha256: tuple[str, ...]  #: the verified content hash of each stage's checkpoint
    stage_files: tuple[str, ...]  #: the checkpoint file each stage's weights came from
    tied: bool  #: one embedding matrix serves as the head
    tied_max_abs_diff: float | None  #: how far the stages' two copies were apart (None: not tied across stages)
    lora: dict[str, Any] | None  #: the run's adapter settings (None: full fine-tuning)
    adapter_only: bool  #: PEFT adapter files instead of merged weights
    num_parameters: int
    files: tuple[str, ...] = field(default=())


def export_version(run_dir: str | Path, out_dir: str | Path, *, version: int | None = None,
                   base_dir: str | Path | None = None, adapter: bool = False,
                   overwrite: bool = False) -> ExportResult:
    """Write version ``version`` (default: the newest every stage has) of the run at ``run_dir``."""
    record = RunRecord.open(run_dir)
    check_out_dir(Path(out_dir), overwrite=overwrite)
    if version is None:
        version = latest_common_version(record)
    check_trained(record, version)
    stages = [read_stage(record, s, version) for s in range(record.num_stages)]
    return write_export(record, stages, out_dir, base_dir=base_dir, adapter=adapter, overwrite=overwrite)


def check_trained(record: RunRecord, version: int) -> None:
    if version <= 0:
        raise CheckpointError(record.db_path, "version 0 is the base checkpoint itself, not a trained policy: "
                                              "use the base directory as it is, or export a trained version")


def write_export(record: RunRecord, stages: list[StageWeights], out_dir: str | Path, *,
                 base_dir: str | Path | None = None, adapter: bool = False, overwrite: bool = False) -> ExportResult:
    """Write ``stages`` (every stage's verified weights of one version, stage order) as the export.

    The one writer behind both ``polis export --run-dir`` and ``--coordinator``."""
    out_dir = Path(out_dir)
    check_out_dir(out_dir, overwrite=overwrite)
    if [w.stage for w in stages] != list(range(record.num_stages)) or len({w.version for w in stages}) != 1:
        raise CheckpointError(out_dir, "the stages' weights are not one version of every stage "
                                       f"({[(w.stage, w.version) for w in stages]})")
    version = stages[0].version
    check_trained(record, version)
    base = _base_checkpoint(record, stages, base_dir)
    specs = plan_stages(base.config.num_hidden_layers, record.num_stages)
    lora = _one_lora(stages)
    if adapter and lora is None:
        raise CheckpointError(Path(stages[0].source), "this run trained every weight (no LoRA adapters); "
                                                      "export it without --adapter")
    staging = staging_dir(out_dir)
    try:
        if adapter and lora is not None:  # (adapter without lora was refused above)
            from engine.model.export.peft_adapter import write_adapter

            files = write_adapter(staging, [w.tensors for w in stages], lora, base.path)
            shards: tuple[str, ...] = ()
            tied_diff = None
        else:
            weights = [_stage_weights(base, spec, w, lora) for spec, w in zip(specs, stages)]
            tied_diff = _drop_tied_copy(base.config, weights, Path(stages[-1].source))
            shards = _write_shards(staging, weights)
            files = shards + (INDEX_FILE,)
        _write_side_files(staging, base.path, record, version, stages, lora, adapter)
        if not adapter:
            Checkpoint(staging).check_stage(StageSpec(0, 1, 0, base.config.num_hidden_layers))
    except BaseException:
        shutil.rmtree(staging, ignore_errors=True)
        raise
    publish_staged(staging, out_dir)
    log.info("exported version %d of run %s to %s", version, record.run_id, out_dir)
    return ExportResult(out_dir=out_dir, version=version, run_id=record.run_id, base_dir=base.path, shards=shards,
                        stage_sha256=tuple(w.sha256 for w in stages),
                        stage_files=tuple(w.source for w in stages),
                        tied=bool(base.config.tie_word_embeddings), tied_max_abs_diff=tied_diff, lora=lora,
                        adapter_only=adapter, num_parameters=int(base.config.num_parameters), files=tuple(files))


def _base_checkpoint(record: RunRecord, stages: list[StageWeights], base_dir: str | Path | None) -> Checkpoint:
    recorded = next((w.base for w in stages if w.base), None)
    chosen = base_dir or record.base_checkpoint or recorded
    if chosen is None:
        raise CheckpointError(record.db_path, "the run does not say which base checkpoint it was cut from; "
                              "pass --base DIR (the coordinator's --checkpoint)")
    if not Path(chosen).is_dir():
        raise CheckpointError(Path(chosen), "base checkpoint directory not found; pass --base DIR "
                                            "(the coordinator's --checkpoint)")
    return Checkpoint(chosen)


def _one_lora(stages: list[StageWeights]) -> dict[str, Any] | None:
    settings = [w.lora for w in stages]
    if any(s != settings[0] for s in settings):
        raise CheckpointError(Path(stages[0].source), "the stages disagree on LoRA settings "
                                                      f"({settings}); they are not from one run")
    return settings[0]


def _stage_weights(base: Checkpoint, spec: StageSpec, w: StageWeights,
                   lora: Mapping[str, Any] | None) -> dict[str, np.ndarray]:
    """The stage's plain HF parameters (adapters merged in), checked against the base's shapes."""
    where, tensors = Path(w.source), w.tensors
    if w.layers != (spec.layer_start, spec.layer_end):
        raise CheckpointError(where, f"holds layers {w.layers[0]}-{w.layers[1]}, but "
                                     f"stage {spec.stage_index} of this base is layers "
                                     f"{spec.layer_start}-{spec.layer_end}; pass the run's own --base")
    if lora is not None:
        from backends.base import LoraConfig
        from backends.lora import merge

        config = LoraConfig(enabled=True, rank=int(lora["rank"]), alpha=float(lora["alpha"]),
                            target_modules=tuple(lora["target_modules"]), init_seed=int(lora.get("init_seed", 0)))
        tensors = merge(base.read_stage(spec), tensors, config)
    expected = stage_tensor_shapes(base.config, spec)
    extra = sorted(set(tensors) - set(expected))
    missing = sorted(set(expected) - set(tensors))
    wrong = sorted(n for n in expected if n in tensors and tuple(tensors[n].shape) != expected[n])
    if extra or missing or wrong:
        raise CheckpointError(where, f"does not fit the base {base.path} (missing {missing[:3]}, unexpected "
                                     f"{extra[:3]}, other shapes {wrong[:3]}); pass the run's own --base")
    return {name: np.ascontiguousarray(tensors[name], dtype=np.float32) for name in expected}


def _drop_tied_copy(config: Any, weights: list[dict[str, np.ndarray]], last_path: Path) -> float | None:
    """Keep one embedding matrix for a tied model cut into stages; returns how far the copies were apart."""
    if not config.tie_word_embeddings or len(weights) < 2:
        return None
    first, last = weights[0][EMBED], weights[-1][EMBED]
    diff = float(np.max(np.abs(first.astype(np.float64) - last.astype(np.float64))))
    if not diff <= TIED_MAX_ABS_DIFF:
        raise CheckpointError(last_path, f"its copy of the tied embedding differs from stage 0's by {diff:.3g} "
                                         f"(more than {TIED_MAX_ABS_DIFF}): the run did not keep them tied, so "
                                         "no single matrix is the model it served")
    del weights[-1][EMBED]
    return diff


def _write_shards(staging: Path, weights: list[dict[str, np.ndarray]]) -> tuple[str, ...]:
    from safetensors.numpy import save_file

    total, weight_map, names = 0, {}, []
    for i, tensors in enumerate(weights):
        name = f"model-{i + 1:05d}-of-{len(weights):05d}.safetensors"
        save_file(tensors, str(staging / name), metadata={"format": "pt"})
        names.append(name)
        for tensor_name, array in tensors.items():
            weight_map[tensor_name] = name
            total += array.nbytes
    write_json(staging / INDEX_FILE, {"metadata": {"total_size": total},
                                      "weight_map": dict(sorted(weight_map.items()))})
    return tuple(names)


def _write_side_files(staging: Path, base_dir: Path, record: RunRecord, version: int, stages: list[StageWeights],
                      lora: Mapping[str, Any] | None, adapter: bool) -> None:
    config = read_json(base_dir / CONFIG_FILE)
    config["torch_dtype"] = "float32"
    config.pop("dtype", None)
    if not adapter:
        write_json(staging / CONFIG_FILE, config)
    generation = base_dir / GENERATION_CONFIG_FILE
    if generation.exists():
        write_json(staging / GENERATION_CONFIG_FILE, read_json(generation))
    else:
        ids = ("bos_token_id", "eos_token_id", "pad_token_id")
        write_json(staging / GENERATION_CONFIG_FILE, {k: config[k] for k in ids if config.get(k) is not None})
    for name in (TOKENIZER_FILE, TOKENIZER_CONFIG_FILE, *TOKENIZER_SIDE_FILES):
        if (base_dir / name).exists():
            shutil.copyfile(base_dir / name, staging / name)
    if not (staging / TOKENIZER_FILE).exists():
        raise CheckpointError(base_dir / TOKENIZER_FILE, "missing: the export would have no tokenizer")
    base_manifest = base_dir / MANIFEST_FILE
    base_info = read_json(base_manifest) if base_manifest.exists() else {}
    base_name = base_info.get("name") or base_dir.name
    write_json(staging / MANIFEST_FILE, {
        "name": f"{base_name}-polis-{record.run_id}-v{version}", "kind": "export", "source": record.source,
        "base": str(base_dir), "base_name": base_name,
        "base_kind": base_info.get("kind"), "base_source": base_info.get("source"), "run_id": record.run_id,
        "version": version,
        "lora": lora, "adapter_only": adapter,
        "stages": [{"stage": w.stage, "file": w.source, "sha256": w.sha256, "hash": w.hash_kind} for w in stages]})


def stage_json(result: ExportResult) -> dict[str, Any]:
    """The export's summary for ``--json`` and logs."""
    return {"out_dir": str(result.out_dir), "version": result.version, "run_id": result.run_id,
            "base": str(result.base_dir), "shards": list(result.shards), "stage_sha256": list(result.stage_sha256),
            "stage_files": list(result.stage_files),
            "tied": result.tied, "tied_max_abs_diff": result.tied_max_abs_diff, "lora": result.lora,
            "adapter_only": result.adapter_only, "num_parameters": result.num_parameters,
            "files": list(result.files)}


