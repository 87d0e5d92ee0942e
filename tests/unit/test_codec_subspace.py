import msgpack
import numpy as np
import pytest

from engine.net import codec_subspace
from engine.net.errors import WireFormatError
from engine.net.tensor_codec import decode_tensor, encode_tensor


def _roundtrip(array, **params):
    encoded = encode_tensor(array, "subspace", **params)
    header = msgpack.unpackb(msgpack.packb(encoded.header))  # what a peer really receives
    return encoded, decode_tensor(header, encoded.payload)


def _rel(a, b):
    return float(np.linalg.norm(a - b) / np.linalg.norm(a))


def _residual_stream(seed=0, rows=512, cols=128, rank=8, noise=0.01):
    """Rows near a rank-``rank`` subspace plus a mean, with one massive 'attention sink' entry per sequence."""
    rng = np.random.default_rng(seed)
    x = rng.standard_normal((rows, rank)) @ rng.standard_normal((rank, cols)) + 3.0 * rng.standard_normal(cols)
    x += noise * rng.standard_normal((rows, cols))
    x = x.reshape(8, rows // 8, cols).astype(np.float32)
    x[:, 0, 5] = 24576.0  # exactly representable in bfloat16
    return x


def test_low_rank_rows_with_massive_outliers_come_back_close_at_thirty_times_fewer_bytes():
    x = _residual_stream()
    encoded, y = _roundtrip(x, rank=8)
    assert np.all(y[:, 0, 5] == 24576.0)  # the sinks travel exactly ...
    rest = np.ones(x.shape, bool)
    rest[:, 0, 5] = False
    assert _rel(x[rest], y[rest]) < 0.01  # ... and do not crush everything else
    assert encoded.ratio_vs_fp32 > 30


def test_the_column_of_a_massive_entry_survives_where_int8_rows_lose_it():
    x = _residual_stream()[:1]  # one sequence: its first token holds the massive entry
    encoded = encode_tensor(x, "int8_rowwise")
    int8 = decode_tensor(encoded.header, encoded.payload)
    _, sub = _roundtrip(x, rank=8)
    column = x[0, 1:, 5]  # every other token's value in that channel
    assert _rel(column, int8[0, 1:, 5]) > 0.5
    assert _rel(column, sub[0, 1:, 5]) < 0.05


def test_rank_zero_with_residual_is_int8_rows_with_exact_outliers():
    x = _residual_stream(rows=8)[:, :1]  # one decoding step: a row per sequence
    encoded, y = _roundtrip(x, rank=0, residual=True, centred=False)
    assert encoded.header["params"]["rank"] == 0
    assert np.all(y[:, 0, 5] == 24576.0)
    assert _rel(x, y) < 0.01


def test_rank_is_clamped_to_the_rows_and_columns_there_are():
    x = np.random.default_rng(1).standard_normal((3, 16)).astype(np.float32)
    encoded, y = _roundtrip(x, rank=64)
    assert encoded.header["params"]["rank"] == 3
    assert _rel(x, y) < 0.02


def test_payload_length_matches_what_the_params_imply():
    x = _residual_stream(rows=64)
    for params in ({"rank": 4}, {"rank": 4, "residual": True}, {"rank": 0, "residual": True, "centred": False}):
        encoded = encode_tensor(x, "subspace", **params)
        p = encoded.header["params"]
        assert len(encoded.payload) == codec_subspace.payload_nbytes(
            64, 128, p["rank"], centred=p["centred"], coef_col_scaled=p["coef_col_scaled"], residual=p["residual"],
            residual_col_scaled=p["residual_col_scaled"], outliers=p["outliers"],
            outlier_index_bytes=p["outlier_index_bytes"])


def test_sender_mistakes_are_value_errors():
    with pytest.raises(ValueError, match="NaN"):
        encode_tensor(np.array([[np.nan, 1.0]], np.float32), "subspace")
    with pytest.raises(ValueError, match="rank"):
        encode_tensor(np.ones((4, 4), np.float32), "subspace", rank=-1)
    with pytest.raises(ValueError, match="bfloat16"):
        encode_tensor(np.full((2, 2), np.finfo(np.float32).max, np.float32), "subspace")


def _valid(**params):
    encoded = encode_tensor(_residual_stream(rows=64), "subspace", **params)
    return dict(encoded.header, params=dict(encoded.header["params"])), bytes(encoded.payload)


@pytest.mark.parametrize("change, match", [
    ({"rank": 65}, "rank"),  # more basis vectors than rows x cols allow
    ({"outliers": 10 ** 9}, "outliers"),
    ({"outlier_index_bytes": 0}, "outlier_index_bytes"),
    ({"residual_col_scaled": True}, "residual"),
    ({"colour": 1}, "subspace params"),
    ({"rank": 3}, "payload has"),
])
def test_inconsistent_params_are_refused_before_decoding(change, match):
    header, payload = _valid(rank=4)
    header["params"].update(change)
    with pytest.raises(WireFormatError, match=match):
        decode_tensor(header, payload)


def test_coefficients_column_scaled_without_a_basis_are_refused():
    header, payload = _valid(rank=0, residual=True, centred=False)
    header["params"]["coef_col_scaled"] = True
    with pytest.raises(WireFormatError, match="without a basis"):
        decode_tensor(header, payload)


def test_outlier_positions_beyond_the_tensor_and_bad_means_are_refused():
    header, payload = _valid(rank=4)
    n, index_bytes = header["params"]["outliers"], header["params"]["outlier_index_bytes"]
    index_start = len(payload) - index_bytes - 2 * n
    gaps = b"\xff\x7f" + b"\x00" * (n - 1)  # a first gap of 16383 entries: past 64 x 128
    bad = payload[:index_start] + gaps + payload[index_start + index_bytes:]
    with pytest.raises(WireFormatError, match="beyond"):
        decode_tensor(dict(header, params=dict(header["params"], outlier_index_bytes=len(gaps))), bad)
    nan_mean = np.full(128, np.nan, "<f4").tobytes() + payload[4 * 128:]
    with pytest.raises(WireFormatError, match="mean"):
        decode_tensor(header, nan_mean)


def test_four_bit_codes_halve_the_basis_and_coefficients_and_stay_close():
    rng = np.random.default_rng(3)
    x = (rng.standard_normal((300, 16)) @ rng.standard_normal((16, 128))).astype(np.float32)  # rank-16 rows
    eight, y8 = _roundtrip(x, rank=16)
    four, y4 = _roundtrip(x, rank=16, code_bits=4)
    assert four.header["params"]["code_bits"] == 4 and "code_bits" not in eight.header["params"]
    p = four.header["params"]
    assert len(four.payload) == codec_subspace.payload_nbytes(
        300, 128, 16, centred=p["centred"], coef_col_scaled=p["coef_col_scaled"], residual=False,
        residual_col_scaled=False, outliers=p["outliers"], outlier_index_bytes=p["outlier_index_bytes"], code_bits=4)
    codes_8 = 16 * 128 + 300 * 16  # basis and coefficient codes at 8 bits
    assert len(eight.payload) - len(four.payload) == codes_8 // 2
    assert _rel(x, y8) < 0.02 and _rel(x, y4) < 0.15


@pytest.mark.parametrize("true_rank", [0, 1, 3])
def test_a_tensor_of_lower_rank_than_asked_encodes_and_comes_back(true_rank):
    # a gradient of a few directions (or none): at 4 bits some basis vectors quantise to zero
    rng = np.random.default_rng(true_rank)
    x = (rng.standard_normal((300, true_rank)) @ rng.standard_normal((true_rank, 576))).astype(np.float32)
    for bits in (8, 4):
        _, y = _roundtrip(x, rank=64, code_bits=bits)
        assert np.linalg.norm(y.reshape(x.shape) - x) <= 0.2 * np.linalg.norm(x)


@pytest.mark.parametrize("change, match", [({"code_bits": 2}, "subspace params"), ({"code_bits": 8}, "payload has")])
def test_code_bits_that_the_payload_does_not_hold_are_refused(change, match):
    header, payload = _valid(rank=4, code_bits=4)
    header["params"].update(change)
    with pytest.raises(WireFormatError, match=match):
        decode_tensor(header, payload)


def test_a_four_bit_section_with_a_nonzero_pad_nibble_is_refused():
    from engine.net import codec_int8
    from engine.net.codec_checks import PayloadReader

    params, payload = codec_int8.encode(np.ones((3, 3), np.float32), bits=4)  # 9 codes: one pad nibble
    assert len(payload) == codec_int8.payload_nbytes(3, 3, params["col_scaled"], 4)
    tampered = payload[:-1] + bytes([payload[-1] | 0xF0])
    with pytest.raises(WireFormatError, match="padding nibble"):
        codec_int8.decode((3, 3), 9, params, PayloadReader(memoryview(tampered)), 4)
    decoded = codec_int8.decode((3, 3), 9, params, PayloadReader(memoryview(payload)), 4)
    assert np.array_equal(decoded, np.ones(9, np.float32))
