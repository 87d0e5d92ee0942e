"""``Checkpoint``: an HF-layout checkpoint directory, read lazily tensor by tensor.

A checkpoint is ``config.json`` plus either one ``model.safetensors`` or several
shards listed in ``model.safetensors.index.json``. Opening a ``Checkpoint``
reads the config and the index (or the single file's header) only; a shard's
header is parsed the first time one of its tensors is wanted, and tensor bytes
are read only for the names asked for. So a node holding stage ``k`` of ``S``
touches only the shard files that contain its tensors — the others need not
even be present — and its peak memory is its own tensors, not the model's.

Every problem (missing directory or file, corrupt index or header, truncated
data, a tensor missing or of the wrong shape) raises
:class:`~engine.model.errors.CheckpointError` naming the file. This module knows
the directory layout; the byte format lives in ``safetensors_reader``, the naming
convention in ``tensor_names``.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Iterable, Iterator, Mapping

import numpy as np

from backends.base import StageSpec
from engine.model.config import ModelConfig
from engine.model.errors import CheckpointError
from engine.model.safetensors_reader import SafetensorsFile
from engine.model.shard_plan import check_spec
from engine.model.tensor_names import stage_tensor_shapes

CONFIG_FILE = "config.json"
SINGLE_FILE = "model.safetensors"
INDEX_FILE = "model.safetensors.index.json"
#: largest index file read (real ones are tens of KB)
MAX_INDEX_BYTES = 64 * 1024 * 1024


class Checkpoint:
    """A checkpoint directory. ``read`` returns fp32 numpy arrays by HF name."""

    def __init__(self, path: str | Path) -> None:
        self.path = Path(path)
        if not self.path.is_dir():
            raise CheckpointError(self.path, "checkpoint directory not found")
        self.config = ModelConfig.from_file(self.path / CONFIG_FILE)
        self._files: dict[str, SafetensorsFile] = {}
        self._weight_map = self._load_weight_map()

    # -- what is there -----------------------------------------------------------
    @property
    def tensor_names(self) -> list[str]:
        return sorted(self._weight_map)

    def file_of(self, name: str) -> Path:
        """The shard file that holds tensor ``name``."""
        return self.path / self._weight_map[name]

    @property
    def files_opened(self) -> list[str]:
        """Shard file names whose headers have been read so far."""
        return sorted(self._files)

    @property
    def bytes_read(self) -> int:
        """Tensor bytes read from disk so far, over all shard files."""
        return sum(f.bytes_read for f in self._files.values())

    def stage_tensor_names(self, spec: StageSpec) -> list[str]:
        """HF names of the tensors stage ``spec`` needs (see ``tensor_names``)."""
        return list(self._stage_shapes(spec))

    # -- reading -------------------------------------------------------------
    def read(self, names: Iterable[str]) -> dict[str, np.ndarray]:
        """Read tensors as C-contiguous float32, opening only the shards that hold them."""
        names = list(names)
        by_file: dict[str, list[str]] = {}
        for name in names:
            file_name = self._weight_map.get(name)
            if file_name is None:
                raise CheckpointError(self._map_source(), f"has no tensor named '{name}'")
            by_file.setdefault(file_name, []).append(name)
        out: dict[str, np.ndarray] = {}
        for file_name, file_names in by_file.items():
            out.update(self._file(file_name).read_many(file_names))
        return {name: out[name] for name in names}

    def read_stage(self, spec: StageSpec) -> dict[str, np.ndarray]:
        """Read exactly the tensors of stage ``spec`` (shapes checked against the config first)."""
        return self.read(self.check_stage(spec))

    def stage_weights(self, spec: StageSpec) -> "LazyTensors":
        """Stage ``spec``'s tensors as a mapping that reads each one from disk when it is looked up.

        A backend that copies tensor by tensor then peaks at its own parameters plus
        one tensor. Shapes are checked against the config before anything is read.
        """
        return LazyTensors(self, self.check_stage(spec))

    def check_stage(self, spec: StageSpec) -> list[str]:
        """Names of stage ``spec``'s tensors, after checking each exists with the shape the config implies.

        Reads shard headers only.
        """
        shapes = self._stage_shapes(spec)
        for name in shapes:
            if name not in self._weight_map:
                raise CheckpointError(self._map_source(), f"has no tensor '{name}', which "
                                                          f"{spec.describe(self.config.num_hidden_layers)} needs")
            entry = self._file(self._weight_map[name]).entries.get(name)
            if entry is None:
                raise CheckpointError(self.file_of(name), f"has no tensor named '{name}' "
                                                          f"although {self._map_source().name} says it does")
            if entry.shape != shapes[name]:
                raise CheckpointError(self.file_of(name), f"tensor '{name}' has shape {list(entry.shape)}, "
                                                          f"but config.json implies {list(shapes[name])}")
        return list(shapes)

    def stage_nbytes(self, spec: StageSpec) -> int:
        """Bytes the stage's tensors take as float32 (from the config, without reading)."""
        return sum(4 * int(np.prod(s)) for s in self._stage_shapes(spec).values())

    # -- internals -------------------------------------------------------------
    def _stage_shapes(self, spec: StageSpec) -> dict[str, tuple[int, ...]]:
        try:
            check_spec(spec, self.config.num_hidden_layers)
        except ValueError as exc:
            raise CheckpointError(self.path / CONFIG_FILE, f"stage does not fit this model: {exc}") from None
        return stage_tensor_shapes(self.config, spec)

    def _map_source(self) -> Path:
        index = self.path / INDEX_FILE
        return index if index.exists() else self.path / SINGLE_FILE

    def _file(self, file_name: str) -> SafetensorsFile:
        opened = self._files.get(file_name)
        if opened is None:
            opened = self._files[file_name] = SafetensorsFile(self.path / file_name)
        return opened

    def _load_weight_map(self) -> dict[str, str]:
        index_path = self.path / INDEX_FILE
        if not index_path.exists():
            single = self._file(SINGLE_FILE)  # raises "file not found" naming model.safetensors
            return {name: SINGLE_FILE for name in single.names}
        try:
            size = index_path.stat().st_size
            if size > MAX_INDEX_BYTES:
                raise CheckpointError(index_path, f"is {size} bytes, over the {MAX_INDEX_BYTES}-byte cap")
            index = json.loads(index_path.read_text(encoding="utf-8"))
        except (UnicodeDecodeError, json.JSONDecodeError) as exc:
            raise CheckpointError(index_path, f"not valid JSON ({exc})") from None
        weight_map = index.get("weight_map") if isinstance(index, dict) else None
        if not isinstance(weight_map, dict) or not weight_map:
            raise CheckpointError(index_path, "has no 'weight_map' object mapping tensor names to files")
        for name, file_name in weight_map.items():
            if (not isinstance(file_name, str) or Path(file_name).name != file_name
                    or file_name in ("", ".", "..") or not file_name.endswith(".safetensors")):
                raise CheckpointError(index_path, f"maps '{name}' to {file_name!r}, which is not a "
                                                  f".safetensors file name inside the checkpoint directory")
        return dict(weight_map)


class LazyTensors(Mapping[str, np.ndarray]):
    """Read-only mapping name -> fp32 array; every lookup reads that tensor from disk anew."""

    def __init__(self, checkpoint: Checkpoint, names: list[str]) -> None:
        self._checkpoint = checkpoint
        self._names = list(names)
        self._known = frozenset(self._names)

    def __contains__(self, name: object) -> bool:
        return name in self._known

    def __getitem__(self, name: str) -> np.ndarray:
        if name not in self._known:
            raise KeyError(name)
        return self._checkpoint.read([name])[name]

    def __iter__(self) -> Iterator[str]:
        return iter(self._names)

    def __len__(self) -> int:
        return len(self._names)
