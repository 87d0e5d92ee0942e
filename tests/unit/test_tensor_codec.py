import ml_dtypes
import msgpack
import numpy as np
import pytest

from engine.net.codec_report import realistic_activations, realistic_update
from engine.net.codec_topk import varint_decode, varint_encode
from engine.net.tensor_codec import decode_tensor, encode_tensor


def _roundtrip(array, encoding, **params):
    encoded = encode_tensor(array, encoding, **params)
    header = msgpack.unpackb(msgpack.packb(encoded.header))  # what a peer really receives
    return encoded, decode_tensor(header, encoded.payload)


def _rel(a, b):
    return float(np.linalg.norm(a - b) / np.linalg.norm(a))


@pytest.mark.parametrize("shape", [(), (0,), (7,), (3, 0, 2), (2, 3, 5), (1, 1, 1, 1, 1, 1, 1, 2)])
def test_fp32_round_trip_is_bit_exact_for_any_shape(shape):
    rng = np.random.default_rng(1)
    x = (rng.standard_normal(shape) * 1e3).astype(np.float32)
    _, y = _roundtrip(x, "fp32")
    assert y.shape == x.shape and y.dtype == np.float32
    assert np.array_equal(x.view(np.uint32), y.view(np.uint32))


@pytest.mark.parametrize("dtype", [np.int64, np.int32, np.uint8, np.bool_, np.float64, ml_dtypes.bfloat16])
def test_raw_round_trip_is_exact_for_every_wire_dtype(dtype):
    rng = np.random.default_rng(2)
    x = (rng.standard_normal((4, 5)) * 100).astype(dtype)
    _, y = _roundtrip(x, "raw")
    assert y.dtype == np.dtype(dtype)
    assert np.array_equal(x.view(np.uint8), y.view(np.uint8))


def test_fp16_and_bf16_are_exact_on_values_they_can_represent():
    rng = np.random.default_rng(3)
    x = rng.standard_normal((6, 9)).astype(np.float32)
    as_fp16 = x.astype(np.float16).astype(np.float32)
    as_bf16 = x.astype(ml_dtypes.bfloat16).astype(np.float32)
    assert np.array_equal(_roundtrip(as_fp16, "fp16")[1], as_fp16)
    assert np.array_equal(_roundtrip(as_bf16, "bf16")[1], as_bf16)
    encoded, _ = _roundtrip(x, "bf16")
    assert len(encoded.payload) == 2 * x.size


def test_bf16_rounds_ties_to_even():
    x = np.array([1 + 2 ** -8, 1 + 3 * 2 ** -8, -(1 + 2 ** -8), 1 + 2 ** -8 + 2 ** -20], np.float32)
    _, y = _roundtrip(x, "bf16")
    assert y.tolist() == [1.0, 1 + 2 ** -6, -1.0, 1 + 2 ** -7]


def test_fp16_saturates_instead_of_overflowing_to_inf():
    _, y = _roundtrip(np.array([1e6, -1e6, 3.0], np.float32), "fp16")
    assert y.tolist() == [65504.0, -65504.0, 3.0]


def test_int8_rowwise_keeps_relative_error_under_one_percent_on_activations_with_outlier_channels():
    x = realistic_activations(seed=4)
    encoded, y = _roundtrip(x, "int8_rowwise")
    assert encoded.header["params"]["col_scaled"] is True
    assert _rel(x, y) <= 0.01
    assert encoded.ratio_vs_fp32 >= 3.9


def test_int8_rowwise_without_column_scales_loses_accuracy_on_outlier_channels():
    x = realistic_activations(seed=4)
    _, with_cols = _roundtrip(x, "int8_rowwise")
    _, rows_only = _roundtrip(x, "int8_rowwise", col_scaling=False)
    assert _rel(x, rows_only) > 2 * _rel(x, with_cols)


def test_int8_rowwise_handles_outlier_rows_and_gradients_of_any_scale():
    rng = np.random.default_rng(5)
    for scale in (1e-7, 1.0, 1e5):
        x = rng.standard_normal((4, 16, 64)).astype(np.float32) * np.float32(scale)
        x[:, 3, :] *= 50  # one huge token per sequence
        x[0, 5, :] = 0  # an all-zero row stays exactly zero
        encoded, y = _roundtrip(x, "int8_rowwise")
        assert encoded.header["params"]["col_scaled"] is False
        assert _rel(x, y) <= 0.01
        assert not y[0, 5, :].any()


def test_int8_rowwise_error_per_element_is_at_most_half_a_step_of_its_row():
    rng = np.random.default_rng(6)
    x = rng.standard_normal((32, 48)).astype(np.float32)
    _, y = _roundtrip(x, "int8_rowwise", col_scaling=False)
    step = np.abs(x).max(axis=1, keepdims=True) / 127 * 2 ** (1 / 8)  # scales round up by < 1/8 octave
    assert (np.abs(x - y) <= step / 2 + 1e-7).all()


def test_topk_sends_exactly_the_largest_entries_and_needs_fifty_times_fewer_bytes():
    g = realistic_update(seed=7, numel=200_000)
    encoded, y = _roundtrip(g, "topk", fraction=0.01)
    k = encoded.header["params"]["k"]
    assert k == 2000
    sent = np.flatnonzero(y)
    expected = np.sort(np.argsort(np.abs(g))[-k:])
    assert np.array_equal(sent, expected)
    assert encoded.ratio_vs_fp32 >= 50
    assert _rel(g[sent], y[sent]) <= 0.02


@pytest.mark.parametrize("bits", [8, 4, 2])
@pytest.mark.parametrize("coding", ["uint32", "varint_delta"])
def test_topk_quantisation_error_is_within_half_a_step_of_each_block(bits, coding):
    rng = np.random.default_rng(8)
    g = rng.standard_normal(5000).astype(np.float32)
    encoded, y = _roundtrip(g, "topk", k=700, value_bits=bits, index_coding=coding, block=64)
    idx = np.sort(np.argsort(np.abs(g))[-700:])
    values, decoded = g[idx], y[idx]
    levels = 127 if bits == 8 else (2 ** bits - 1) / 2
    for start in range(0, 700, 64):
        block = slice(start, start + 64)
        step = np.abs(values[block]).max() / levels
        assert (np.abs(values[block] - decoded[block]) <= step / 2 * (1 + 1e-5)).all()
    assert np.count_nonzero(y[np.setdiff1d(np.arange(5000), idx)]) == 0


@pytest.mark.parametrize("bits", [4, 2, 1])
def test_topk_mse_scales_cut_low_bit_error_on_heavy_tailed_values_and_decode_as_absmax_ones(bits):
    g = np.random.default_rng(3).standard_t(3, 20_000).astype(np.float32)  # a few large values per block
    errors = {}
    for rule in ("absmax", "mse"):
        encoded, y = _roundtrip(g, "topk", k=20_000, value_bits=bits, index_coding="all", scale_rule=rule)
        assert "scale_rule" not in encoded.header["params"]  # nothing new on the wire
        assert len(encoded.payload) == 20_000 * bits // 8 + 4 * 5  # codes and a scale per 4096
        errors[rule] = float(np.square(g - y).sum() / np.square(g).sum())
    assert errors["mse"] < errors["absmax"] / 4
    assert errors["mse"] < {4: 0.2, 2: 0.45, 1: 0.7}[bits]


def test_topk_one_bit_values_are_signs_times_half_the_block_scale():
    x = np.array([-3.0, -0.5, 0.0, 0.25, 2.0, 1.0, -1.0, 4.0], np.float32)
    _, y = _roundtrip(x, "topk", k=8, value_bits=1, index_coding="all", block=8)
    np.testing.assert_array_equal(y, np.where(x >= 0, 4.0, -4.0))  # absmax: the largest magnitude
    _, y = _roundtrip(x, "topk", k=8, value_bits=1, index_coding="all", block=8, scale_rule="mse")
    assert np.all(np.sign(y[x != 0]) == np.sign(x[x != 0])) and 1.0 < float(np.abs(y).max()) < 2.5


def test_topk_mse_scale_keeps_absmax_where_nothing_smaller_is_better():
    x = np.array([-1.5, -0.5, 0.5, 1.5] * 16, np.float32)  # exactly the four 2-bit levels at scale 1
    _, y = _roundtrip(x, "topk", k=64, value_bits=2, index_coding="all", block=64, scale_rule="mse")
    np.testing.assert_array_equal(x, y)


def test_topk_refuses_an_unknown_scale_rule():
    with pytest.raises(ValueError, match="scale_rule"):
        _roundtrip(np.ones(8, np.float32), "topk", k=8, scale_rule="rms")


def test_topk_with_k_zero_and_k_all_round_trips():
    x = np.arange(-5, 5, dtype=np.float32)
    assert not _roundtrip(x, "topk", k=0)[1].any()
    _, y = _roundtrip(x, "topk", k=10)
    assert np.allclose(x, y, atol=5 / 127)


def test_varint_round_trips_gaps_up_to_the_uint32_range():
    values = np.array([0, 1, 127, 128, 16383, 16384, 2 ** 21, 2 ** 28 - 1, 2 ** 32 - 1], np.uint64)
    buf = np.frombuffer(varint_encode(values), np.uint8)
    assert np.array_equal(varint_decode(buf, len(values)), values)
    assert len(buf) == 1 + 1 + 1 + 2 + 2 + 3 + 4 + 4 + 5


def test_lossy_encoders_refuse_nan_instead_of_sending_garbage():
    x = np.array([1.0, np.nan], np.float32)
    for encoding in ("int8_rowwise", "topk"):
        with pytest.raises(ValueError):
            encode_tensor(x, encoding)


def test_decoded_arrays_are_fresh_writable_and_independent_of_the_payload():
    x = np.arange(12, dtype=np.float32).reshape(3, 4)
    encoded = encode_tensor(x, "fp32")
    payload = bytearray(encoded.payload)
    y = decode_tensor(encoded.header, payload)
    payload[:4] = b"\xff\xff\xff\xff"
    y[0, 0] = 42.0
    assert y.flags.writeable and y.flags.c_contiguous and y[0, 1] == 1.0


def test_the_typed_header_names_exactly_the_dtypes_and_encodings_the_codec_has():
    from typing import get_args

    from engine.net import tensor_codec

    assert set(get_args(tensor_codec.DtypeName)) == set(tensor_codec.DTYPES)
    assert set(get_args(tensor_codec.EncodingName)) == set(tensor_codec.ENCODINGS)
