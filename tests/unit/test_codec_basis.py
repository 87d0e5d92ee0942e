import msgpack
import numpy as np
import pytest

from engine.net import codec_basis_model
from engine.net.codec_basis_model import Basis, BasisBook
from engine.net.errors import WireFormatError
from engine.net.tensor_codec import decode_tensor, encode_tensor

SINK = 24576.0  # exactly representable in bfloat16


def _residual_stream(seed=0, rows=1024, cols=128, rank=8, noise=0.01, sinks=True):
    """Rows near a rank-``rank`` subspace plus a mean, one massive 'attention sink' entry per sequence."""
    rng = np.random.default_rng(seed)
    mixing = np.random.default_rng(99).standard_normal((rank, cols))  # the same subspace for every seed
    offset = 3.0 * np.random.default_rng(98).standard_normal(cols)
    x = rng.standard_normal((rows, rank)) @ mixing + offset + noise * rng.standard_normal((rows, cols))
    x = x.reshape(8, rows // 8, cols).astype(np.float32)
    if sinks:
        x[:, 0, 5] = SINK
    return x


def _wire(encoded):
    return msgpack.unpackb(msgpack.packb(encoded.header)), encoded.payload  # what a peer really receives


def _rel(a, b):
    return float(np.linalg.norm(a - b) / np.linalg.norm(a))


def _basis(rank=8):
    return Basis.fit(_residual_stream(seed=1).reshape(-1, 128), rank)


def test_rows_in_a_basis_fitted_on_other_rows_come_back_close_with_the_sinks_exact():
    basis, x, book = _basis(), _residual_stream(seed=2), BasisBook()
    y = decode_tensor(*_wire(encode_tensor(x, "basis", basis=basis, inline=True)), bases=book)
    assert np.all(y[:, 0, 5] == SINK)  # the massive entries travel exactly ...
    rest = np.ones(x.shape, bool)
    rest[:, 0, 5] = False
    assert _rel(x[rest], y[rest]) < 0.02  # ... and do not crush everything else


def test_the_basis_travels_once_then_a_tensor_costs_its_coefficients_only():
    basis, x, book = _basis(), _residual_stream(seed=2), BasisBook()
    first = encode_tensor(x, "basis", basis=basis, inline=True)
    later = encode_tensor(x, "basis", basis=basis)
    assert len(first.payload) - len(later.payload) == basis.nbytes == 4 * 128 + 2 * 8 * 128
    decode_tensor(*_wire(first), bases=book)
    y = decode_tensor(*_wire(later), bases=book)
    assert _rel(x, y) < 0.02
    assert later.ratio_vs_fp32 > 40  # 128 float32 against ~9 coefficient bytes a row
    step = x[:, -1:, :]  # one decoding step: a row per sequence, no basis to pay
    assert encode_tensor(step, "basis", basis=basis).ratio_vs_fp32 > 15  # the header is half of it


def test_four_bit_coefficients_halve_a_row_and_say_so_only_when_they_are_four_bits():
    basis, x, book = _basis(), _residual_stream(seed=2), BasisBook()
    decode_tensor(*_wire(encode_tensor(x, "basis", basis=basis, inline=True)), bases=book)
    eight, four = encode_tensor(x, "basis", basis=basis), encode_tensor(x, "basis", basis=basis, code_bits=4)
    assert "bits" not in eight.header["params"] and four.header["params"]["bits"] == 4
    rows = x.size // 128
    index_gap = eight.header["params"]["index_bytes"] - four.header["params"]["index_bytes"]  # other misses
    assert len(eight.payload) - len(four.payload) - index_gap == rows * 8 // 2  # 8 coefficients: 4 bytes fewer
    y8, y4 = (decode_tensor(*_wire(e), bases=book) for e in (eight, four))
    assert np.all(y4[:, 0, 5] == SINK)
    assert _rel(x, y8) < _rel(x, y4) < 0.05  # 15 levels a row instead of 255
    header, payload = _wire(four)
    with pytest.raises(WireFormatError, match="payload has"):  # the params say how long the codes are
        decode_tensor(dict(header, params=dict(header["params"], bits=8)), payload, bases=book)
    with pytest.raises(WireFormatError, match="basis params"):
        decode_tensor(dict(header, params=dict(header["params"], bits=2)), payload, bases=book)
    with pytest.raises(ValueError, match="code_bits"):
        encode_tensor(x, "basis", basis=basis, code_bits=2)


def test_a_basis_is_named_by_its_content_and_the_fit_is_deterministic():
    rows = _residual_stream(seed=1).reshape(-1, 128)
    a, b = Basis.fit(rows, 8), Basis.fit(rows.copy(), 8)
    assert a.basis_id == b.basis_id and len(a.basis_id) == codec_basis_model.BASIS_ID_BYTES
    assert Basis.fit(rows, 7).basis_id != a.basis_id
    assert np.allclose(a.vectors @ a.vectors.T, np.eye(8), atol=0.02)  # orthonormal up to bfloat16


def test_a_tensor_naming_a_basis_never_received_is_refused():
    basis, x = _basis(), _residual_stream(seed=2)
    header, payload = _wire(encode_tensor(x, "basis", basis=basis))
    with pytest.raises(WireFormatError, match="never received"):
        decode_tensor(header, payload, bases=BasisBook())
    with pytest.raises(WireFormatError, match="no basis book"):
        decode_tensor(header, payload)


def test_an_inline_basis_that_does_not_hash_to_its_id_is_refused_and_not_kept():
    basis, x, book = _basis(), _residual_stream(seed=2), BasisBook()
    header, payload = _wire(encode_tensor(x, "basis", basis=basis, inline=True))
    forged = bytearray(payload)
    forged[4 * 128 + 10] ^= 0x01  # one bit of one basis vector
    with pytest.raises(WireFormatError, match="hashes to"):
        decode_tensor(header, bytes(forged), bases=book)
    assert len(book) == 0


def test_the_book_keeps_its_capacity_least_recently_used_out():
    rows = _residual_stream(seed=1).reshape(-1, 128)
    book = BasisBook(capacity=2)
    bases = [Basis.fit(rows, r) for r in (2, 3, 4)]
    book.add(bases[0])
    book.add(bases[1])
    assert book.get(bases[0].basis_id) is bases[0]  # used: the second is now the oldest
    book.add(bases[2])
    assert len(book) == 2 and book.get(bases[1].basis_id) is None and book.get(bases[0].basis_id) is bases[0]


def _valid():
    basis, x, book = _basis(rank=4), _residual_stream(seed=2, rows=64), BasisBook()
    header, payload = _wire(encode_tensor(x, "basis", basis=basis, inline=True))
    return header, payload, book


@pytest.mark.parametrize("change, match", [
    ({"rank": 5}, "payload has"),
    ({"rank": 0}, "basis params"),
    ({"rank": codec_basis_model.MAX_RANK + 1}, "basis params"),
    ({"id": b"short"}, "basis params"),
    ({"outliers": 10 ** 9}, "outliers"),
    ({"index_bytes": 0}, "index_bytes"),
    ({"inline": False}, "payload has"),
    ({"colour": 1}, "basis params"),
])
def test_inconsistent_params_are_refused_before_decoding(change, match):
    header, payload, book = _valid()
    header["params"].update(change)
    with pytest.raises(WireFormatError, match=match):
        decode_tensor(header, payload, bases=book)


def test_truncated_payloads_nan_bases_and_outliers_beyond_the_tensor_are_refused():
    header, payload, book = _valid()
    with pytest.raises(WireFormatError, match="payload has"):
        decode_tensor(header, payload[:-1], bases=book)
    nan_mean = np.full(128, np.nan, "<f4").tobytes() + payload[4 * 128:]
    with pytest.raises(WireFormatError, match="NaN"):
        decode_tensor(header, nan_mean, bases=book)
    n, index_bytes = header["params"]["outliers"], header["params"]["index_bytes"]
    index_start = len(payload) - index_bytes - 2 * n
    gaps = b"\xff\x7f" + b"\x00" * (n - 1)  # a first gap of 16383 entries: past 8 x 8 x 128
    bad = payload[:index_start] + gaps + payload[index_start + index_bytes:]
    with pytest.raises(WireFormatError, match="beyond"):
        decode_tensor(dict(header, params=dict(header["params"], index_bytes=len(gaps))), bad, bases=book)


def test_a_basis_of_other_width_than_the_tensor_is_refused_on_both_ends():
    basis, x = _basis(), _residual_stream(seed=2)
    with pytest.raises(ValueError, match="columns"):
        encode_tensor(x[..., :64], "basis", basis=basis)
    book = BasisBook()
    decode_tensor(*_wire(encode_tensor(x, "basis", basis=basis, inline=True)), bases=book)
    other = Basis.fit(_residual_stream(seed=3, cols=64, sinks=False).reshape(-1, 64)[:, :64], 8)
    header, payload = _wire(encode_tensor(x[..., :64], "basis", basis=other))
    header["params"]["id"] = basis.basis_id  # names the 128-wide basis the receiver holds
    with pytest.raises(WireFormatError, match="payload has|the tensor says"):
        decode_tensor(header, payload, bases=book)


def test_sender_mistakes_are_value_errors():
    basis, x = _basis(), _residual_stream(seed=2)
    with pytest.raises(ValueError, match="NaN"):
        encode_tensor(np.full_like(x, np.nan), "basis", basis=basis)
    with pytest.raises(ValueError, match="needs a Basis"):
        encode_tensor(x, "basis", basis="abc")
    with pytest.raises(ValueError, match="outlier_fraction"):
        encode_tensor(x, "basis", basis=basis, outlier_fraction=2.0)
