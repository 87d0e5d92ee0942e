"""Coded bases: every coefficient quantised with one step and range-coded (``codec_entropy``,
``codec_basis``; the ``coded_s<k>`` and ``predcoded_s<k>`` activation schemes)."""

import msgpack
import numpy as np
import pytest

from engine.net import codec_entropy
from engine.net.codec_basis_model import Basis, BasisBook
from engine.net.codec_predictor import TokenTable
from engine.net.errors import WireFormatError
from engine.net.tensor_codec import decode_tensor, encode_tensor
from engine.swarm.boundary_basis import BoundaryCodec

COLS = 128


def _rows(seed=0, rows=2048):
    """Rows whose variance spreads over every direction with a power-law fall-off (as a residual
    stream's does: no rank holds them all), plus a mean and one massive entry per 128 rows."""
    rng = np.random.default_rng(seed)
    rotation, _ = np.linalg.qr(np.random.default_rng(99).standard_normal((COLS, COLS)))
    spread = 10.0 / np.arange(1, COLS + 1) ** 0.8
    x = (rng.standard_normal((rows, COLS)) * spread) @ rotation.T + 3.0
    x[::128, 7] = 4096.0
    return x.astype(np.float32)


def _wire(encoded):
    return msgpack.unpackb(msgpack.packb(encoded.header)), encoded.payload


def _rel(a, b):
    return float(np.linalg.norm(a - b) / np.linalg.norm(a))


def test_range_coded_codes_come_back_exactly_within_a_tenth_of_their_entropy():
    rng = np.random.default_rng(0)
    scales = np.array([0.3, 1.0, 4.0, 20.0] * 16)
    codes = np.rint(rng.laplace(0.0, scales, size=(500, 64))).astype(np.int32)
    words = codec_entropy.encode_codes(codes, scales)
    assert len(words) % codec_entropy.WORD_BYTES == 0
    assert np.array_equal(codec_entropy.decode_codes(words, 500, scales), codes)
    entropy_bits = 0.0
    for column in codes.T:
        _, counts = np.unique(column, return_counts=True)
        entropy_bits -= float((counts * np.log2(counts / counts.sum())).sum())
    assert len(words) * 8 < 1.1 * entropy_bits + 64
    assert len(words) < codes.size  # under a byte a code, where int8 would spend one
    with pytest.raises(ValueError, match="within"):
        codec_entropy.encode_codes(np.full((1, 64), codec_entropy.CODE_LIMIT + 1), scales)


def test_words_no_encoder_made_are_refused_or_decode_to_bounded_codes():
    scales = np.full(64, 2.0)
    for seed in range(20):
        words = np.random.default_rng(seed).integers(0, 1 << 32, size=seed % 7, dtype=np.uint32).tobytes()
        try:
            codes = codec_entropy.decode_codes(words, 10, scales)
        except WireFormatError:
            continue
        assert codes.shape == (10, 64) and np.abs(codes).max() <= codec_entropy.CODE_LIMIT
    with pytest.raises(WireFormatError, match="empty"):
        codec_entropy.decode_codes(b"\x00" * 4, 0, scales)


def test_a_coded_basis_beats_a_truncated_one_at_fewer_bytes():
    fit, x = _rows(seed=1), _rows(seed=2)
    coded, plain = Basis.fit(fit, COLS, step=0.3), Basis.fit(fit, 48)
    assert coded.rank == COLS and coded.step is not None and plain.step is None
    coded_out, plain_out = encode_tensor(x, "basis", basis=coded), encode_tensor(x, "basis", basis=plain)
    params = coded_out.header["params"]
    own = COLS if params.get("own_scales") else 0
    assert params["coded"] == len(coded_out.payload) - own - params["index_bytes"] - 2 * params["outliers"]
    books = BasisBook(), BasisBook()
    books[0].add(coded)
    books[1].add(plain)
    y_coded = decode_tensor(*_wire(coded_out), bases=books[0])
    y_plain = decode_tensor(*_wire(plain_out), bases=books[1])
    assert np.all(y_coded[::128, 7] == 4096.0)  # the massive entries still travel exactly
    assert len(coded_out.payload) < len(plain_out.payload)
    assert _rel(x, y_coded) < 0.6 * _rel(x, y_plain)  # measured: ~0.47


def test_a_coded_basis_travels_once_and_its_id_covers_its_step_and_scales():
    basis, x, book = Basis.fit(_rows(seed=1), COLS, step=0.1), _rows(seed=2, rows=256), BasisBook()
    first, later = encode_tensor(x, "basis", basis=basis, inline=True), encode_tensor(x, "basis", basis=basis)
    assert len(first.payload) - len(later.payload) == basis.nbytes == 4 * COLS + 2 * COLS * COLS + 4 + 4 * COLS
    header, payload = _wire(first)
    forged = bytearray(payload)
    forged[4 * COLS + 2 * COLS * COLS + 4 + 8] ^= 0x01  # one bit of one column's scale
    with pytest.raises(WireFormatError, match="hashes to"):
        decode_tensor(header, bytes(forged), bases=book)
    assert len(book) == 0
    assert Basis.fit(_rows(seed=1), COLS, step=0.2).basis_id != basis.basis_id
    decode_tensor(header, payload, bases=book)
    assert _rel(x, decode_tensor(*_wire(later), bases=book)) < 0.05


def test_coded_and_int8_tensors_cannot_name_each_others_basis():
    fit, x = _rows(seed=1), _rows(seed=2, rows=256)
    coded, plain = Basis.fit(fit, COLS, step=0.1), Basis.fit(fit, COLS)
    book = BasisBook()
    book.add(coded)
    book.add(plain)
    header, payload = _wire(encode_tensor(x, "basis", basis=coded))
    with pytest.raises(WireFormatError, match="not coded"):
        decode_tensor(dict(header, params=dict(header["params"], id=plain.basis_id)), payload, bases=book)
    header, payload = _wire(encode_tensor(x, "basis", basis=plain))
    with pytest.raises(WireFormatError, match="is coded"):
        decode_tensor(dict(header, params=dict(header["params"], id=coded.basis_id)), payload, bases=book)


def test_inconsistent_or_damaged_coded_sections_are_refused_without_a_crash():
    basis, x, book = Basis.fit(_rows(seed=1), COLS, step=0.1), _rows(seed=2, rows=256), BasisBook()
    book.add(basis)
    header, payload = _wire(encode_tensor(x, "basis", basis=basis))
    params = header["params"]
    for change, match in (({"coded": params["coded"] + 4}, "payload has"),
                          ({"coded": params["coded"] - 1}, "basis params"),
                          ({"col_scaled": True}, "no column scales"), ({"bits": 4}, "no column scales"),
                          ({"centred": False}, "no column scales")):
        with pytest.raises(WireFormatError, match=match):
            decode_tensor(dict(header, params=dict(params, **change)), payload, bases=book)
    rng = np.random.default_rng(3)
    for _ in range(10):  # flipped bits inside the codes: refused, or finite values (never a crash)
        damaged = bytearray(payload)
        damaged[int(rng.integers(0, params["coded"]))] ^= 1 << int(rng.integers(0, 8))
        try:
            y = decode_tensor(header, bytes(damaged), bases=book)
        except WireFormatError:
            continue
        assert np.isfinite(y).all()
    huge = Basis.from_arrays(basis.mean, basis.vectors, step=3e38, scales=basis.scales)  # a hostile sender's
    book.add(huge)
    with pytest.raises(WireFormatError, match="NaN or inf|non-finite|finite"):
        decode_tensor(dict(header, params=dict(params, id=huge.basis_id)), payload, bases=book)


def test_gradients_projected_into_a_coded_basis_travel_as_int8_codes():
    basis, book = Basis.fit(_rows(seed=1), COLS, step=0.1), BasisBook()
    book.add(basis)
    grad = np.random.default_rng(4).standard_normal((64, COLS)).astype(np.float32)
    encoded = encode_tensor(grad, "basis", basis=basis, centred=False, outlier_fraction=0.0)
    assert "coded" not in encoded.header["params"] and encoded.header["params"]["centred"] is False
    assert _rel(grad, decode_tensor(*_wire(encoded), bases=book)) < 0.02


def test_coded_schemes_calibrate_a_full_rank_basis_and_predcoded_sends_token_ids():
    table = TokenTable(np.random.default_rng(5).standard_normal((300, COLS)).astype(np.float32))
    tokens = np.random.default_rng(6).integers(0, 300, 2048)
    mix = np.random.default_rng(7).standard_normal((COLS, COLS)) / 4
    x = (_rows(seed=3) + table.rows[tokens] @ mix).astype(np.float32).reshape(4, 512, COLS)
    inputs = tokens.reshape(4, 512)
    for scheme, token_bytes in (("coded_s20_gs64_b4", 0), ("predcoded_s20_gs64_b4", 2)):
        sender, receiver = BoundaryCodec(calibration_rows=1024, token_table=table), BoundaryCodec(token_table=table)
        for _ in range(2):  # calibrate, then the coded basis goes inline
            header, payload = sender.forward_encoded(lambda key, ids: x, "job", inputs, scheme, "down")
            y = receiver.decode(header, payload, hidden_size=COLS, sender="up")
            sender.sent("down", header)
        params = header["params"]
        assert header["encoding"] == "basis" and params["rank"] == COLS and "coded" in params
        assert params.get("tokens", 0) == token_bytes
        assert _rel(x, y) < 0.05
        later, _ = sender.forward_encoded(lambda key, ids: x, "job", inputs, scheme, "down")
        assert not later["params"]["inline"]


def test_a_coded_scheme_keeps_its_first_basis_where_a_cut_one_refits():
    drifted = [(_rows(seed=n, rows=512) * (1 + n)).reshape(2, 256, COLS) for n in range(6)]  # they drift
    for scheme, bases in (("coded_s20_gs64_b4", 1), ("basis_r8", 3)):
        sender, receiver = BoundaryCodec(calibration_rows=512, refit_rows=1024), BoundaryCodec()
        ids = []
        for x in drifted:  # fit after the first tensor, a cut basis refits after every 1024 rows
            header, payload = sender.encode("act", x, scheme, "down")
            y = receiver.decode(header, payload, hidden_size=COLS, sender="up")
            sender.sent("down", header)
            ids.append(header["params"].get("id"))
        assert len({i for i in ids if i is not None}) == bases, scheme
        assert _rel(drifted[-1], y) < (0.05 if scheme.startswith("coded") else 1.0)  # nothing cut: still exact


def test_rows_unlike_the_fitted_ones_carry_their_own_scales_when_that_is_fewer_bytes():
    fit = _rows(seed=1)
    basis, book = Basis.fit(fit, COLS, step=0.2), BasisBook()
    book.add(basis)
    like = _rows(seed=2, rows=512)
    unlike = (3.0 + 4.0 * (like - 3.0)).astype(np.float32)  # four times the spread the basis was fitted on
    plain = encode_tensor(like, "basis", basis=basis)
    assert "own_scales" not in plain.header["params"]
    own = encode_tensor(unlike, "basis", basis=basis)
    assert own.header["params"]["own_scales"] is True
    y = decode_tensor(*_wire(own), bases=book)
    assert _rel(unlike, y) < 0.05
    codes = np.rint(((unlike - basis.mean) @ basis.pinv()) / basis.step).astype(np.int32)  # outliers aside
    fitted_bytes = len(codec_entropy.encode_codes(codes, basis.scales))  # what the basis's own model costs
    assert own.header["params"]["coded"] + COLS < fitted_bytes
    header, payload = _wire(own)
    with pytest.raises(WireFormatError, match="payload has"):  # the scales are part of the length
        decode_tensor(dict(header, params=dict(header["params"], own_scales=False)), payload, bases=book)
