"""Token-predicted bases (``codec_predictor``; the ``predicted_r<k>`` activation schemes)."""

import numpy as np
import pytest

from engine.net import codec_basis
from engine.net.codec_basis_model import Basis, BasisBook
from engine.net.codec_checks import PayloadReader
from engine.net.codec_predictor import Predictor, TokenTable
from engine.net.errors import WireFormatError
from engine.swarm.boundary_basis import BoundaryCodec

COLS, VOCAB = 64, 300


def _table(seed=5):
    return TokenTable(np.random.default_rng(seed).standard_normal((VOCAB, COLS)).astype(np.float32))


def _rows(table, n=600, seed=0):
    """Rows as a middle layer makes them: a map of the token's embedding (full rank across tokens)
    plus a rank-4 context part and a little noise."""
    rng = np.random.default_rng(seed)
    tokens = rng.integers(0, VOCAB, n)
    mix = np.random.default_rng(9).standard_normal((COLS, COLS)) / 4
    context = rng.standard_normal((n, 4)) @ np.random.default_rng(8).standard_normal((4, COLS))
    rows = table.rows[tokens] @ mix + context + 0.01 * rng.standard_normal((n, COLS)) + 2.0
    return tokens, rows.astype(np.float32)


def _round_trip(basis, rows, tokens, table, receiver_table=None, inline=True):
    book = BasisBook(table=receiver_table if receiver_table is not None else table)
    params, payload = codec_basis.encode(rows, basis, inline=inline, tokens=tokens, table=table)
    out = codec_basis.decode(rows.shape, rows.size, params, PayloadReader(memoryview(payload)), book)
    return params, payload, out.reshape(rows.shape)


def _rel(a, b):
    return float(np.linalg.norm(a - b) / np.linalg.norm(b))


def test_subtracting_the_token_prediction_leaves_rows_a_low_rank_basis_codes_far_better():
    table = _table()
    tokens, rows = _rows(table)
    test_tokens, test_rows = _rows(table, seed=1)
    plain = Basis.fit(rows, 8)
    predictor = Predictor.fit(table, tokens, rows)
    predicted = Basis.fit(rows, 8, predictor=predictor, table=table, tokens=tokens)
    book = BasisBook()
    book.add(plain)
    params, payload = codec_basis.encode(test_rows, plain)
    plain_out = codec_basis.decode(test_rows.shape, test_rows.size, params, PayloadReader(memoryview(payload)), book)
    params, payload, out = _round_trip(predicted, test_rows, test_tokens, table)
    assert params["tokens"] == 2  # a 300-row table's ids fit 16 bits
    assert _rel(out, test_rows) < 0.01 < 0.2 < _rel(plain_out.reshape(test_rows.shape), test_rows)


def test_an_inline_predicted_basis_is_sent_once_and_its_id_covers_the_predictor():
    table = _table()
    tokens, rows = _rows(table)
    predicted = Basis.fit(rows, 8, predictor=Predictor.fit(table, tokens, rows), table=table, tokens=tokens)
    plain = Basis.from_arrays(predicted.mean, predicted.vectors)
    assert plain.basis_id != predicted.basis_id
    params, payload, _ = _round_trip(predicted, rows, tokens, table)
    named = codec_basis.encode(rows, predicted, inline=False, tokens=tokens, table=table)[1]
    assert len(payload) - len(named) == predicted.nbytes  # the basis and predictor travel once
    tampered = bytearray(payload)
    tampered[4 * COLS + 2 * 8 * COLS + 20] ^= 0xFF  # a predictor weight
    with pytest.raises(WireFormatError, match="hashes"):
        codec_basis.decode(rows.shape, rows.size, params, PayloadReader(memoryview(bytes(tampered))),
                           BasisBook(table=table))


def test_a_receiver_refuses_predicted_rows_it_cannot_rebuild():
    table = _table()
    tokens, rows = _rows(table)
    basis = Basis.fit(rows, 8, predictor=Predictor.fit(table, tokens, rows), table=table, tokens=tokens)
    with pytest.raises(WireFormatError, match="another token table"):
        _round_trip(basis, rows, tokens, table, receiver_table=_table(seed=6))
    params, payload = codec_basis.encode(rows, basis, inline=True, tokens=tokens, table=table)
    with pytest.raises(WireFormatError, match="no token table"):
        codec_basis.decode(rows.shape, rows.size, params, PayloadReader(memoryview(payload)), BasisBook())
    forged = bytearray(payload)
    forged[-2:] = np.array([VOCAB + 7], "<u2").tobytes()  # the last row's token id, past the table
    with pytest.raises(WireFormatError, match="outside the table"):
        codec_basis.decode(rows.shape, rows.size, params, PayloadReader(memoryview(bytes(forged))),
                           BasisBook(table=table))
    book = BasisBook(table=table)
    codec_basis.decode(rows.shape, rows.size, params, PayloadReader(memoryview(payload)), book)  # now held
    params, payload = codec_basis.encode(rows, basis, tokens=tokens, table=table)
    with pytest.raises(WireFormatError, match="token predictor"):  # a predicted basis named without token ids
        codec_basis.decode(rows.shape, rows.size, {**params, "tokens": 0},
                           PayloadReader(memoryview(payload[:-2 * rows.shape[0]])), book)


def test_a_first_stage_sends_its_inputs_as_token_ids_and_later_stages_fit_plain_bases():
    table = _table()
    tokens, rows = _rows(table, n=800)
    sender, receiver = BoundaryCodec(calibration_rows=400, token_table=table), BoundaryCodec(token_table=table)
    inputs, x = tokens.reshape(4, 200), rows.reshape(4, 200, COLS)
    for _ in range(2):  # calibrate, then the predicted basis goes inline
        header, payload = sender.forward_encoded(lambda key, ids: x, "job", inputs, "predicted_r128_gs64_b4", "down")
        y = receiver.decode(header, payload, hidden_size=COLS, sender="up")
        sender.sent("down", header)
    assert header["encoding"] == "basis" and header["params"]["tokens"] == 2
    assert _rel(y, x) < 0.01
    grad = np.random.default_rng(2).standard_normal(x.shape).astype(np.float32)
    header, _ = receiver.encode("grad", grad, "predicted_r128_gs64_b4", "up", stage_index=1)
    assert header["encoding"] == "subspace"  # gradients are not predicted
    middle = BoundaryCodec(calibration_rows=400, token_table=table)
    for _ in range(2):  # a later stage's inputs are activations: no tokens, a plain basis
        header, _ = middle.forward_encoded(lambda key, h: h, "job", x, "predicted_r128_gs64_b4", "down", 1)
    assert header["encoding"] == "basis" and "tokens" not in header["params"]


def test_a_first_stage_without_the_token_table_fits_a_plain_basis():
    table = _table()
    tokens, rows = _rows(table, n=800)
    sender = BoundaryCodec(calibration_rows=400)
    for _ in range(2):
        header, payload = sender.forward_encoded(lambda key, ids: rows.reshape(4, 200, COLS), "job",
                                                 tokens.reshape(4, 200), "predicted_r128_gs64_b4", "down")
    assert header["encoding"] == "basis" and "tokens" not in header["params"]
    assert BoundaryCodec().decode(header, payload, hidden_size=COLS, sender="up").shape == (4, 200, COLS)
