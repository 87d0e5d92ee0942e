"""Gradients sent back as coefficients in the activations' own basis (``basis_r<k>_gp`` schemes)."""

import numpy as np
import pytest

from engine.net import codec_basis
from engine.net.codec_basis_model import Basis, BasisBook
from engine.net.codec_checks import PayloadReader
from engine.net.errors import WireFormatError
from engine.swarm.boundary_basis import BoundaryCodec


def _rows(seed, n=400, cols=64, rank=6):
    rng = np.random.default_rng(seed)
    mixing = np.random.default_rng(7).standard_normal((rank, cols))
    return (rng.standard_normal((n, rank)) @ mixing + 0.05 * rng.standard_normal((n, cols)) + 3.0).astype(np.float32)


def _decode(params, payload, shape, book):
    return codec_basis.decode(shape, int(np.prod(shape)), params, PayloadReader(memoryview(payload)), book)


def test_an_uncentred_tensor_decodes_to_the_exact_gradient_of_the_rank_k_cut():
    basis = Basis.fit(_rows(0), 6)
    book = BasisBook()
    book.add(basis)
    grad = np.random.default_rng(1).standard_normal((50, 64)).astype(np.float32)
    params, payload = codec_basis.encode(grad, basis, centred=False, outlier_fraction=0.0)
    assert params["centred"] is False and len(payload) < 50 * 64  # ~6 codes a row, not 64 floats
    decoded = _decode(params, payload, grad.shape, book).reshape(grad.shape)
    # the cut is x -> mean + (x - mean) @ P with P = pinv(V) @ V: its input gradient is grad @ P.T
    cut = basis.pinv().astype(np.float64) @ basis.vectors.astype(np.float64)
    exact = grad.astype(np.float64) @ cut.T
    assert np.linalg.norm(decoded - exact) / np.linalg.norm(exact) < 0.02  # int8 rounding only
    assert np.linalg.norm(decoded - grad) / np.linalg.norm(grad) > 0.5  # not the uncut gradient: 6 of 64 dims


def test_an_uncentred_tensor_never_carries_a_basis_inline():
    basis = Basis.fit(_rows(0), 6)
    grad = np.ones((3, 64), np.float32)
    with pytest.raises(ValueError, match="inline"):
        codec_basis.encode(grad, basis, inline=True, centred=False)
    params, payload = codec_basis.encode(grad, basis, inline=True)  # a centred one, relabelled by a peer
    with pytest.raises(WireFormatError, match="inline"):
        _decode({**params, "centred": False}, payload, grad.shape, BasisBook())


def test_gradients_go_back_in_the_basis_the_activations_came_in_and_decode_in_the_senders_own_book():
    upstream, downstream = BoundaryCodec(calibration_rows=300), BoundaryCodec()
    x = _rows(0).reshape(2, 200, 64)
    grad = np.random.default_rng(3).standard_normal(x.shape).astype(np.float32)
    header, payload = downstream.encode("grad", grad, "basis_r128_gp", "up")  # no basis from up yet
    assert header["encoding"] == "subspace"  # the fallback: int8 rows with exact outliers
    for _ in range(2):  # calibrate, then the basis goes inline
        header, payload = upstream.encode("act", x, "basis_r128_gp", "down")
        downstream.decode(header, payload, hidden_size=64, sender="up")
        upstream.sent("down", header)
    basis_id = header["params"]["id"]
    header, payload = downstream.encode("grad", grad, "basis_r128_gp", "up")
    assert header["encoding"] == "basis" and header["params"]["id"] == basis_id
    assert header["params"]["centred"] is False and header["params"]["inline"] is False
    assert len(payload) < grad.size * 1.1  # a byte a coefficient (rank 64 of 64 here) and per-row scales
    back = upstream.decode(header, payload, hidden_size=64, sender="down")
    assert np.linalg.norm(back - grad) / np.linalg.norm(grad) < 0.02  # full rank: the projection is the identity

    b4_header, b4_payload = downstream.encode("grad", grad, "basis_r128_gp_b4", "up")
    assert b4_header["params"]["bits"] == 4 and len(b4_payload) < 0.6 * len(payload)


def test_a_projected_gradient_naming_a_basis_the_receiver_never_fitted_is_refused():
    stranger, downstream, victim = BoundaryCodec(calibration_rows=100), BoundaryCodec(), BoundaryCodec()
    x = _rows(0).reshape(1, 400, 64)
    header, payload = stranger.encode("act", x, "basis_r128_gp", "down")
    downstream.decode(header, payload, hidden_size=64, sender="up")  # the book holds the stranger's basis
    header, payload = downstream.encode("grad", x, "basis_r128_gp", "up")
    assert header["encoding"] == "basis"
    with pytest.raises(WireFormatError, match="not one this node sent"):
        victim.decode(header, payload, hidden_size=64, sender="down")
