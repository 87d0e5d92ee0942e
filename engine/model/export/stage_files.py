"""Find each stage's checkpoint of one policy version in a run directory, and prove it is that.

For stage ``k`` the candidates are the file its leader last reported to the coordinator
(``RunRecord.stage_checkpoints``) and every ``stages/<run_id>/stage<k>.safetensors`` under
the run directory (each node's data dir: a replica that led the stage earlier may hold an
older version). A candidate counts only if its metadata says it is stage ``k`` of this
many stages, of the wanted version, and the SHA-256 of its tensors equals the content hash
``save_stage`` recorded (``engine.model.content_hash``). A stage with no such file is a
:class:`StageMissing` error that names the stage, lists the versions that are there and
says what to do; nothing is ever filled in from the base checkpoint.

What it does not know: the database, how the export is written.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from engine.model.content_hash import METADATA_KEY, tensors_sha256
from engine.model.errors import CheckpointError
from engine.model.export.run_record import RunRecord
from engine.model.safetensors_reader import SafetensorsFile


class StageMissing(CheckpointError):
    """A stage has no verified checkpoint of the version asked for."""


@dataclass(frozen=True)
class StageWeights:
    """One stage's verified tensors of one version, and where they came from: a checkpoint file
    (``StageFile.read_weights``) or the stage's leader over WebRTC (``engine.swarm.export_fetch``).
    ``hf_export.write_export`` writes either the same way."""

    stage: int
    version: int
    source: str  #: the checkpoint file, or "peer <id> (WebRTC)"
    sha256: str  #: the hash the tensors were checked against (stage file SHA-256, or the swarm's digest)
    lora: dict[str, Any] | None  #: adapter settings when the tensors are LoRA adapters
    base: str | None  #: the base checkpoint the stage was loaded from, when recorded
    layers: tuple[int, int]  #: ``(layer_start, layer_end)`` the tensors hold
    tensors: dict[str, np.ndarray]
    #: what ``sha256`` is: "sha256" (``engine.model.content_hash``) or "blake2b-128" (``weights_digest``)
    hash_kind: str = "sha256"


@dataclass(frozen=True)
class StageFile:
    """One stage checkpoint file, header read (tensors not yet)."""

    path: Path
    stage: int
    num_stages: int
    version: int
    sha256: str | None  #: the recorded content hash (None: saved before hashes existed)
    lora: dict[str, Any] | None  #: adapter settings when the tensors are LoRA adapters
    base: str | None  #: the base checkpoint the stage was loaded from, when recorded
    spec: dict[str, Any]

    @classmethod
    def read_header(cls, path: Path) -> "StageFile":
        meta = SafetensorsFile(path).metadata or {}
        try:
            spec = json.loads(meta["stage"])
            lora = json.loads(meta.get("polis_lora") or "null")
            return cls(path=path, stage=int(spec["stage_index"]), num_stages=int(spec["num_stages"]),
                       version=int(meta["polis_version"]), sha256=meta.get(METADATA_KEY), lora=lora,
                       base=meta.get("polis_base") or None, spec=spec)
        except (KeyError, ValueError, TypeError) as exc:
            raise CheckpointError(path, f"is not a Polis stage checkpoint (metadata: {exc})") from None

    def read_weights(self) -> StageWeights:
        """The verified tensors with what ``write_export`` needs to know about them."""
        tensors = self.read_verified()
        return StageWeights(stage=self.stage, version=self.version, source=str(self.path), sha256=self.sha256 or "",
                            lora=self.lora, base=self.base,
                            layers=(int(self.spec.get("layer_start", -1)), int(self.spec.get("layer_end", -1))),
                            tensors=tensors)

    def read_verified(self) -> dict[str, np.ndarray]:
        """The tensors, after checking their SHA-256 against the recorded one."""
        f = SafetensorsFile(self.path)
        tensors = f.read_many(f.names)
        if self.sha256 is None:
            raise CheckpointError(self.path, "carries no content hash (written by an older Polis), so its weights "
                                             "cannot be verified; let the run write a new stage checkpoint "
                                             "(every checkpoint_every_versions) and export that version")
        found = tensors_sha256(tensors)
        if found != self.sha256:
            raise CheckpointError(self.path, f"its tensors hash to {found[:16]}..., not the {self.sha256[:16]}... "
                                             "recorded when it was saved: the file was altered or damaged")
        return tensors


def candidates(record: RunRecord, stage: int) -> list[StageFile]:
    """Readable checkpoint files of ``stage`` (reported path first), unreadable ones skipped."""
    paths: list[Path] = []
    reported = record.stage_checkpoints.get(stage)
    if reported:
        p = Path(reported)
        paths += [p] if p.is_absolute() else [record.run_dir / p, p]
    paths += sorted(record.run_dir.glob(f"*/stages/{record.run_id}/stage{stage}.safetensors"))
    paths += sorted(record.run_dir.glob(f"stages/{record.run_id}/stage{stage}.safetensors"))
    seen, out = set(), []
    for path in paths:
        key = path.resolve()
        if key in seen or not path.is_file():
            continue
        seen.add(key)
        try:
            found = StageFile.read_header(path)
        except CheckpointError:
            continue
        if found.stage == stage and found.num_stages == record.num_stages:
            out.append(found)
    return out


def latest_common_version(record: RunRecord) -> int:
    """The newest version every stage has a checkpoint of (raises StageMissing when none is shared)."""
    per_stage = [{f.version for f in candidates(record, s)} for s in range(record.num_stages)]
    common = set.intersection(*per_stage) if per_stage else set()
    if not common:
        empty = [s for s, v in enumerate(per_stage) if not v]
        where = (f"stage {empty[0]} has no checkpoint at all under {record.run_dir}" if empty else
                 "the stages hold checkpoints of different versions: " +
                 ", ".join(f"stage {s}: {sorted(v)}" for s, v in enumerate(per_stage)))
        raise StageMissing(record.run_dir, f"no policy version is checkpointed on every stage ({where}); "
                                           "let the run reach its next checkpoint and export again")
    return max(common)


def read_stage(record: RunRecord, stage: int, version: int) -> StageWeights:
    """Stage ``stage``'s verified tensors of ``version`` (and the file they came from).

    Several files may hold that version (the leader's, a former leader's); the first whose
    hash checks out wins. Raises StageMissing when none holds it, CheckpointError when every
    one that does fails its hash."""
    found = candidates(record, stage)
    match = [f for f in found if f.version == version]
    if not match:
        held = sorted({f.version for f in found})
        every = record.run.get("checkpoint_every_versions")
        raise StageMissing(
            record.run_dir,
            f"stage {stage} of {record.num_stages} has no checkpoint of version {version} "
            f"({'it holds versions ' + str(held) if held else 'no checkpoint of it was found'}). "
            f"Export a version every stage holds (omit --version for the newest), or keep the run going "
            f"until it checkpoints (every {every} versions) and export that one")
    failure: CheckpointError | None = None
    for f in match:
        try:
            return f.read_weights()
        except CheckpointError as exc:
            failure = failure or exc
    assert failure is not None
    raise failure
