import copy
import tracemalloc

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from engine.net.errors import WireFormatError
from engine.net.tensor_codec import decode_tensor, encode_tensor

CAP = 4096


def _valid(encoding, **params):
    rng = np.random.default_rng(0)
    x = rng.standard_normal((4, 8, 16)).astype(np.float32)
    x[..., 3] *= 30
    encoded = encode_tensor(x, encoding, **params)
    return copy.deepcopy(encoded.header), bytes(encoded.payload)


def _refused(header, payload, match, **kwargs):
    with pytest.raises(WireFormatError, match=match):
        decode_tensor(header, payload, max_elements=CAP, **kwargs)


def test_unknown_encoding_dtype_version_and_extra_keys_are_refused():
    header, payload = _valid("fp32")
    _refused({**header, "encoding": "zstd"}, payload, r"\$\.encoding")
    _refused({**header, "dtype": "complex64"}, payload, r"\$\.dtype")
    _refused({**header, "dtype": "int64"}, payload, "cannot carry")
    _refused({**header, "v": 2}, payload, r"\$\.v`")
    _refused({**header, "evil": 1}, payload, "unknown field `evil`")
    _refused("not a dict", payload, "Expected `object`")
    _refused({k: v for k, v in header.items() if k != "shape"}, payload, "missing required field `shape`")


def test_bad_shapes_are_refused_before_anything_is_allocated():
    header, payload = _valid("topk")
    _refused({**header, "shape": [4, -8, 16]}, payload, r">= 0 - at `\$\.shape\[1\]`")
    _refused({**header, "shape": [4, 8.0, 16]}, payload, "Expected `int`")
    _refused({**header, "shape": [True, 8, 16]}, payload, "Expected `int`")
    _refused({**header, "shape": [1] * 9}, payload, "length <= 8")
    tracemalloc.start()
    _refused({**header, "shape": [2 ** 40, 2 ** 40]}, payload, "exceeds")
    peak = tracemalloc.get_traced_memory()[1]
    tracemalloc.stop()
    assert peak < 1 << 20


def test_payload_must_have_exactly_the_implied_length():
    for encoding in ("fp32", "fp16", "bf16", "int8_rowwise", "topk"):
        header, payload = _valid(encoding)
        _refused(header, payload[:-1], "payload")
        _refused(header, payload + b"\0", "payload|trailing")
    _refused(_valid("fp32")[0], "text", "bytes")


def test_expected_shape_and_dtype_are_enforced():
    header, payload = _valid("fp32")
    _refused(header, payload, "shape", expected_shape=(4, 8, 15))
    _refused(header, payload, "dtype", expected_dtype="float16")


def test_non_finite_values_are_refused_unless_allowed():
    encoded = encode_tensor(np.array([1.0, np.inf], np.float32), "fp32")
    _refused(encoded.header, encoded.payload, "NaN or inf")
    assert np.isinf(decode_tensor(encoded.header, encoded.payload, allow_nonfinite=True)[1])


def test_int8_scales_that_are_nan_negative_or_overflowing_are_refused():
    header, payload = _valid("int8_rowwise")
    assert header["params"]["col_scaled"]
    row_ref = 4 + 16  # column reference (float32) and 16 column codes come first
    for offset, bad, reason in ((0, np.nan, "NaN"), (0, -1.0, "negative"), (row_ref, 3e38, "too large"),
                                (row_ref, np.inf, "NaN or inf")):
        corrupt = bytearray(payload)
        corrupt[offset:offset + 4] = np.array([bad], "<f4").tobytes()
        _refused(header, bytes(corrupt), reason)
    both_big = bytearray(payload)
    both_big[0:4] = np.array([1e30], "<f4").tobytes()
    both_big[row_ref:row_ref + 4] = np.array([1e20], "<f4").tobytes()
    _refused(header, bytes(both_big), "overflow")
    _refused({**header, "params": {"col_scaled": 1}}, payload, "col_scaled")


def test_topk_indices_counts_and_scales_are_validated():
    header, payload = _valid("topk", k=20, index_coding="uint32")
    params = header["params"]
    indices = np.frombuffer(payload[:80], "<u4").copy()
    for bad_indices, reason in ((np.r_[indices[:-1], 4 * 8 * 16], "out of range"),
                                (np.r_[indices[:1], indices[:-1]], "increasing")):
        _refused(header, bad_indices.astype("<u4").tobytes() + payload[80:], reason)
    _refused({**header, "params": {**params, "k": 4 * 8 * 16 + 1}}, payload, "outside")
    _refused({**header, "params": {**params, "value_bits": 3}}, payload, "value_bits")
    _refused({**header, "params": {**params, "index_bytes": 79}}, payload, "index_bytes")
    _refused({**header, "params": {**params, "block": 0}}, payload, "block")
    nan_scale = payload[:80] + np.array([np.nan], "<f4").tobytes() + payload[84:]
    _refused(header, nan_scale, "NaN")


def test_topk_varint_sections_must_be_canonical_and_inside_the_tensor():
    header, payload = _valid("topk", k=3, index_coding="varint_delta")
    n = header["params"]["index_bytes"]
    rest = payload[n:]
    overlong = bytes([0x80, 0x00, 0x01, 0x01])
    _refused({**header, "params": {**header["params"], "index_bytes": 4}}, overlong + rest, "canonical")
    too_far = bytes([0x00, 0x00, 0xFF, 0x7F])  # third index far beyond 512 elements
    _refused({**header, "params": {**header["params"], "index_bytes": 4}}, too_far + rest, "beyond")
    unterminated = bytes([0x00, 0x00, 0x81])
    _refused({**header, "params": {**header["params"], "index_bytes": 3}}, unterminated + rest, "varint")


def test_bool_payload_bytes_other_than_zero_and_one_are_refused():
    encoded = encode_tensor(np.array([True, False]), "raw")
    _refused(encoded.header, b"\x01\x02", "bool")


# ------------------------------------------------------------------------ fuzzing

_json_like = st.recursive(
    st.none() | st.booleans() | st.integers(-2 ** 70, 2 ** 70) | st.floats() | st.text(max_size=12)
    | st.binary(max_size=12),
    lambda children: st.lists(children, max_size=4) | st.dictionaries(st.text(max_size=8), children, max_size=4),
    max_leaves=12)

_VALID = [_valid("fp32"), _valid("fp16"), _valid("bf16"), _valid("raw"), _valid("int8_rowwise"),
          _valid("int8_rowwise", col_scaling=False), _valid("topk", k=40, index_coding="uint32"),
          _valid("topk", k=40, value_bits=4, block=16), _valid("topk", k=40, value_bits=2),
          _valid("subspace", rank=4), _valid("subspace", rank=3, residual=True, outlier_fraction=0.01),
          _valid("subspace", rank=0, residual=True, centred=False)]


def _decode_or_refuse(header, payload):
    try:
        out = decode_tensor(header, payload, max_elements=CAP)
    except WireFormatError:
        return
    assert isinstance(out, np.ndarray) and out.size <= CAP


@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(header=_json_like, payload=st.binary(max_size=600))
def test_random_headers_and_payloads_only_ever_raise_wire_format_error(header, payload):
    _decode_or_refuse(header, payload)


@st.composite
def _mutated(draw):
    header, payload = copy.deepcopy(draw(st.sampled_from(_VALID)))
    for _ in range(draw(st.integers(1, 3))):
        target = draw(st.sampled_from(["field", "param", "shape", "flip", "cut", "grow"]))
        if target == "field":
            header[draw(st.sampled_from(sorted(header)))] = draw(_json_like)
        elif target == "param" and isinstance(header.get("params"), dict) and header["params"]:
            key = draw(st.sampled_from(sorted(header["params"])))
            header["params"][key] = draw(st.integers(-2 ** 33, 2 ** 33) | _json_like)
        elif target == "shape":
            header["shape"] = draw(st.lists(st.integers(-3, 2 ** 34), max_size=9))
        elif target == "flip" and payload:
            pos = draw(st.integers(0, len(payload) - 1))
            payload = payload[:pos] + bytes([draw(st.integers(0, 255))]) + payload[pos + 1:]
        elif target == "cut":
            payload = payload[:draw(st.integers(0, len(payload)))]
        elif target == "grow":
            payload = payload + draw(st.binary(min_size=1, max_size=64))
    return header, payload


@settings(max_examples=600, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(case=_mutated())
def test_mutated_valid_tensors_only_ever_raise_wire_format_error(case):
    header, payload = case
    tracemalloc.start()
    try:
        _decode_or_refuse(header, payload)
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    assert peak < 64 * CAP * 4 + 8 * len(payload) + (1 << 16)
