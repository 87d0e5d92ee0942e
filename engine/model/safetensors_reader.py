"""A small, strict reader for one ``.safetensors`` file, returning fp32 numpy arrays.

Format (https://github.com/huggingface/safetensors): an 8-byte little-endian
header length ``n``, ``n`` bytes of UTF-8 JSON mapping tensor names to
``{"dtype", "shape", "data_offsets": [begin, end]}`` (offsets relative to the
data section that follows the header), an optional ``__metadata__`` entry, then
the raw little-endian tensor bytes.

Why our own reader rather than the ``safetensors`` package: every byte of a
checkpoint is untrusted, and a node must read only its own tensors. Opening a
file parses and validates the header only (size cap, JSON shape, known dtypes,
byte counts matching shapes, offsets inside the file and not overlapping); tensor
bytes are read on demand with plain ``readinto`` into a fresh array, so memory use
is exactly the tensors asked for and no page of the file is mapped. Every problem
raises :class:`~engine.model.errors.CheckpointError` naming the file.

Floating-point tensors (F64, F32, F16, BF16) are returned as C-contiguous
``float32``; BF16 widens exactly by bit shift. Integer tensors are validated but
not readable as weights. This module knows nothing about models or configs.
"""

from __future__ import annotations

import json
import math
import os
import struct
from dataclasses import dataclass
from pathlib import Path
from typing import Iterable

import numpy as np

from engine.model.errors import CheckpointError

#: Largest JSON header accepted (the reference implementation uses the same cap).
MAX_HEADER_BYTES = 100 * 1024 * 1024
#: Most dimensions a tensor may declare.
MAX_RANK = 8

#: safetensors dtype name -> numpy dtype of the stored bytes (little-endian).
_STORED_DTYPES: dict[str, np.dtype] = {
    "F64": np.dtype("<f8"),
    "F32": np.dtype("<f4"),
    "F16": np.dtype("<f2"),
    "BF16": np.dtype("<u2"),  # widened to fp32 by bit shift on read
    "I64": np.dtype("<i8"),
    "I32": np.dtype("<i4"),
    "I16": np.dtype("<i2"),
    "I8": np.dtype("i1"),
    "U64": np.dtype("<u8"),
    "U32": np.dtype("<u4"),
    "U16": np.dtype("<u2"),
    "U8": np.dtype("u1"),
    "BOOL": np.dtype("?"),
}
#: dtypes that :meth:`SafetensorsFile.read` converts to float32.
FLOAT_DTYPES = frozenset({"F64", "F32", "F16", "BF16"})


@dataclass(frozen=True)
class TensorEntry:
    """Where one tensor lives in its file."""

    name: str
    dtype: str  #: safetensors dtype name, e.g. ``"BF16"``
    shape: tuple[int, ...]
    begin: int  #: absolute byte offset in the file
    end: int  #: absolute byte offset one past the last byte

    @property
    def nbytes(self) -> int:
        return self.end - self.begin

    @property
    def fp32_nbytes(self) -> int:
        """Bytes this tensor occupies once read as float32."""
        return 4 * math.prod(self.shape)


class SafetensorsFile:
    """One validated safetensors file. Reads tensors lazily, one ``readinto`` each.

    ``bytes_read`` counts tensor bytes read so far (the header excluded), so
    callers and tests can prove that only the tensors asked for were touched.
    """

    def __init__(self, path: str | Path) -> None:
        self.path = Path(path)
        self.bytes_read = 0
        try:
            with open(self.path, "rb") as f:
                self._file_size = os.fstat(f.fileno()).st_size
                self.entries, self.metadata = _parse_header(self.path, f, self._file_size)
        except FileNotFoundError:
            raise CheckpointError(self.path, "file not found") from None
        except IsADirectoryError:
            raise CheckpointError(self.path, "is a directory, not a safetensors file") from None
        except PermissionError:
            raise CheckpointError(self.path, "permission denied") from None

    @property
    def names(self) -> list[str]:
        return list(self.entries)

    def read(self, name: str) -> np.ndarray:
        """One tensor as C-contiguous float32."""
        return self.read_many([name])[name]

    def read_many(self, names: Iterable[str]) -> dict[str, np.ndarray]:
        """Several tensors as float32, in file order, opening the file once."""
        wanted = []
        for name in names:
            entry = self.entries.get(name)
            if entry is None:
                raise CheckpointError(self.path, f"has no tensor named '{name}'")
            if entry.dtype not in FLOAT_DTYPES:
                raise CheckpointError(self.path, f"tensor '{name}' has dtype {entry.dtype}, "
                                                 f"not a floating-point weight")
            wanted.append(entry)
        wanted.sort(key=lambda e: e.begin)
        out: dict[str, np.ndarray] = {}
        try:
            with open(self.path, "rb") as f:
                for entry in wanted:
                    out[entry.name] = self._read_entry(f, entry)
        except FileNotFoundError:
            raise CheckpointError(self.path, "file not found (removed after its header was read)") from None
        return out

    def _read_entry(self, f, entry: TensorEntry) -> np.ndarray:
        stored = np.empty(entry.shape, dtype=_STORED_DTYPES[entry.dtype])
        f.seek(entry.begin)
        got = f.readinto(memoryview(stored.reshape(-1)).cast("B")) if entry.nbytes else 0
        if got != entry.nbytes:
            raise CheckpointError(self.path, f"truncated: tensor '{entry.name}' needs bytes "
                                             f"{entry.begin}..{entry.end}, file ended after {got} of them")
        self.bytes_read += got
        if entry.dtype == "BF16":
            return (stored.astype(np.uint32) << 16).view(np.float32)
        return np.ascontiguousarray(stored, dtype=np.float32)


def _parse_header(path: Path, f, file_size: int) -> tuple[dict[str, TensorEntry], dict]:
    if file_size < 8:
        raise CheckpointError(path, f"not a safetensors file: {file_size} bytes, shorter than the 8-byte header length")
    (header_len,) = struct.unpack("<Q", f.read(8))
    if header_len > MAX_HEADER_BYTES:
        raise CheckpointError(path, f"corrupt header: declared header length {header_len} bytes "
                                    f"exceeds the {MAX_HEADER_BYTES}-byte cap")
    if 8 + header_len > file_size:
        raise CheckpointError(path, f"truncated: header of {header_len} bytes does not fit in a "
                                    f"{file_size}-byte file")
    raw = f.read(header_len)
    try:
        header = json.loads(raw.decode("utf-8"))
    except (UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise CheckpointError(path, f"corrupt header: not valid UTF-8 JSON ({exc})") from None
    if not isinstance(header, dict):
        raise CheckpointError(path, "corrupt header: JSON is not an object")
    metadata = header.pop("__metadata__", {})
    if not isinstance(metadata, dict):
        raise CheckpointError(path, "corrupt header: __metadata__ is not an object")
    data_start = 8 + header_len
    data_size = file_size - data_start
    entries = {name: _parse_entry(path, name, spec, data_start, data_size) for name, spec in header.items()}
    _check_no_overlap(path, entries.values())
    return entries, metadata


def _parse_entry(path: Path, name: str, spec: object, data_start: int, data_size: int) -> TensorEntry:
    def bad(problem: str) -> CheckpointError:
        return CheckpointError(path, f"corrupt header: tensor '{name}' {problem}")

    if not isinstance(spec, dict):
        raise bad("is not an object")
    dtype, shape, offsets = spec.get("dtype"), spec.get("shape"), spec.get("data_offsets")
    if dtype not in _STORED_DTYPES:
        raise bad(f"has unknown or unsupported dtype {dtype!r} (known: {', '.join(_STORED_DTYPES)})")
    if (not isinstance(shape, list) or len(shape) > MAX_RANK
            or not all(isinstance(d, int) and not isinstance(d, bool) and d >= 0 for d in shape)):
        raise bad(f"has an invalid shape {shape!r}")
    if (not isinstance(offsets, list) or len(offsets) != 2
            or not all(isinstance(o, int) and not isinstance(o, bool) for o in offsets)):
        raise bad(f"has invalid data_offsets {offsets!r}")
    begin, end = offsets
    if not 0 <= begin <= end:
        raise bad(f"has invalid data_offsets [{begin}, {end}]")
    expected = math.prod(shape) * _STORED_DTYPES[dtype].itemsize
    if end - begin != expected:
        raise bad(f"spans {end - begin} bytes but shape {shape} of {dtype} needs {expected}")
    if end > data_size:
        raise CheckpointError(path, f"truncated: tensor '{name}' ends at data byte {end} but the file holds "
                                    f"only {data_size} data bytes")
    return TensorEntry(name, dtype, tuple(shape), data_start + begin, data_start + end)


def _check_no_overlap(path: Path, entries: Iterable[TensorEntry]) -> None:
    previous: TensorEntry | None = None
    for entry in sorted((e for e in entries if e.nbytes), key=lambda e: e.begin):
        if previous is not None and entry.begin < previous.end:
            raise CheckpointError(path, f"corrupt header: tensors '{previous.name}' and '{entry.name}' overlap")
        previous = entry
