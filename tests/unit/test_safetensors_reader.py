"""The strict safetensors reader: values of real safetensors files, and clear errors for bad bytes."""

from __future__ import annotations

import json
import struct
from pathlib import Path

import ml_dtypes
import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from safetensors.numpy import save_file

from engine.model.errors import CheckpointError
from engine.model.safetensors_reader import MAX_HEADER_BYTES, SafetensorsFile


def _raw_file(path: Path, header: dict, data: bytes) -> Path:
    body = json.dumps(header).encode()
    path.write_bytes(struct.pack("<Q", len(body)) + body + data)
    return path


def _valid_file(path: Path) -> tuple[Path, dict[str, np.ndarray]]:
    rng = np.random.default_rng(0)
    tensors = {"a": rng.standard_normal((3, 4)).astype(np.float32),
               "b": rng.standard_normal((5,)).astype(np.float32)}
    save_file(tensors, str(path))
    return path, tensors


def test_reads_f32_f16_f64_and_bf16_as_float32(tmp_path):
    rng = np.random.default_rng(1)
    base = rng.standard_normal((4, 6)).astype(np.float32)
    tensors = {"f32": base, "f16": base.astype(np.float16), "f64": base.astype(np.float64),
               "bf16": base.astype(ml_dtypes.bfloat16), "empty": np.zeros((0, 3), np.float32)}
    save_file(tensors, str(tmp_path / "m.safetensors"))
    f = SafetensorsFile(tmp_path / "m.safetensors")
    assert sorted(f.names) == sorted(tensors)
    for name, want in tensors.items():
        got = f.read(name)
        assert got.dtype == np.float32 and got.flags.c_contiguous and got.shape == want.shape
        np.testing.assert_array_equal(got, want.astype(np.float32))


def test_bytes_read_counts_only_the_tensors_asked_for(tmp_path):
    path, tensors = _valid_file(tmp_path / "m.safetensors")
    f = SafetensorsFile(path)
    assert f.bytes_read == 0
    np.testing.assert_array_equal(f.read("b"), tensors["b"])
    assert f.bytes_read == tensors["b"].nbytes


def test_integer_tensors_are_validated_but_not_read_as_weights(tmp_path):
    save_file({"ids": np.arange(6, dtype=np.int64)}, str(tmp_path / "i.safetensors"))
    f = SafetensorsFile(tmp_path / "i.safetensors")
    with pytest.raises(CheckpointError, match="not a floating-point weight"):
        f.read("ids")


def _expect_error(path: Path, match: str) -> None:
    with pytest.raises(CheckpointError, match=match) as info:
        SafetensorsFile(path)
    assert path.name in str(info.value) and info.value.path == path


def test_missing_file_and_tiny_file_name_the_file(tmp_path):
    _expect_error(tmp_path / "nope.safetensors", "not found")
    (tmp_path / "tiny.safetensors").write_bytes(b"\x01\x02")
    _expect_error(tmp_path / "tiny.safetensors", "shorter than the 8-byte header")


def test_header_length_beyond_the_file_or_the_cap_is_refused(tmp_path):
    path = tmp_path / "long.safetensors"
    path.write_bytes(struct.pack("<Q", 1000) + b"{}")
    _expect_error(path, "truncated")
    path.write_bytes(struct.pack("<Q", MAX_HEADER_BYTES + 1) + b"{}")
    _expect_error(path, "exceeds")


@pytest.mark.parametrize("header, match", [
    ({"a": {"dtype": "F99", "shape": [1], "data_offsets": [0, 4]}}, "unknown or unsupported dtype"),
    ({"a": {"dtype": "F32", "shape": [2], "data_offsets": [0, 4]}}, "needs 8"),
    ({"a": {"dtype": "F32", "shape": [-1], "data_offsets": [0, 4]}}, "invalid shape"),
    ({"a": {"dtype": "F32", "shape": [1], "data_offsets": [4, 0]}}, "invalid data_offsets"),
    ({"a": {"dtype": "F32", "shape": [1], "data_offsets": "0-4"}}, "invalid data_offsets"),
    ({"a": {"dtype": "F32", "shape": [4], "data_offsets": [0, 16]}}, "truncated"),
    ({"a": {"dtype": "F32", "shape": [2], "data_offsets": [0, 8]},
      "b": {"dtype": "F32", "shape": [1], "data_offsets": [4, 8]}}, "overlap"),
    ({"a": [1, 2]}, "is not an object"),
    ({"__metadata__": [1]}, "__metadata__"),
])
def test_inconsistent_headers_are_refused(tmp_path, header, match):
    _expect_error(_raw_file(tmp_path / "bad.safetensors", header, b"\0" * 8), match)


def test_non_json_header_is_refused(tmp_path):
    path = tmp_path / "garbage.safetensors"
    path.write_bytes(struct.pack("<Q", 6) + b"\xff\xfe{{{{" + b"\0" * 8)
    _expect_error(path, "not valid UTF-8 JSON")


def test_file_truncated_after_opening_fails_on_read(tmp_path):
    path, _ = _valid_file(tmp_path / "m.safetensors")
    f = SafetensorsFile(path)
    path.write_bytes(path.read_bytes()[:-8])
    with pytest.raises(CheckpointError, match="truncated") as info:
        f.read_many(f.names)
    assert "m.safetensors" in str(info.value)


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(data=st.data())
def test_damaged_files_open_and_read_or_raise_checkpoint_error_only(tmp_path, data):
    path, _ = _valid_file(tmp_path / "fuzz.safetensors")
    raw = bytearray(path.read_bytes())
    for _ in range(data.draw(st.integers(1, 4))):
        raw[data.draw(st.integers(0, len(raw) - 1))] = data.draw(st.integers(0, 255))
    raw = raw[: data.draw(st.integers(0, len(raw)))]
    path.write_bytes(bytes(raw))
    try:
        f = SafetensorsFile(path)
        for name in f.names:
            if f.entries[name].dtype in ("F32", "F16", "F64", "BF16"):
                f.read(name)
    except CheckpointError as exc:
        assert "fuzz.safetensors" in str(exc)
