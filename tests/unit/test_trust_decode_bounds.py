"""Finding 9 of issue 14: a few payload bytes must not make a node allocate hundreds of MiB."""

from __future__ import annotations

import numpy as np
import pytest

from engine.net.errors import ProtocolViolation, WireFormatError
from engine.net.tensor_codec import decode_tensor, encode_tensor
from engine.swarm.pipeline_hops import MAX_ACTIVATION_ELEMENTS, decode_activation


def _tiny_topk(shape):
    """A real top-k encoding of a tensor with one non-zero entry: a few bytes for any shape."""
    x = np.zeros(shape, np.float32)
    x.flat[0] = 1.0
    return encode_tensor(x, "topk", fraction=1e-9)


def test_a_hundred_byte_top_k_header_claiming_256_mib_is_refused_before_decoding():
    small = _tiny_topk((1, 64, 1024))
    header = {**small.header, "shape": [1, 65536, 1024]}  # 2^26 float32 = 256 MiB
    assert len(small.payload) < 123
    with pytest.raises(WireFormatError, match="cannot honestly decode"):
        decode_tensor(header, small.payload, max_elements=MAX_ACTIVATION_ELEMENTS)
    with pytest.raises(ProtocolViolation):
        decode_activation(header, small.payload, hidden_size=1024)


def test_an_activation_of_the_wrong_hidden_size_is_refused_from_its_header_alone():
    enc = encode_tensor(np.ones((1, 2, 48), np.float32), "fp32")
    with pytest.raises(ProtocolViolation, match="hidden size"):
        decode_activation(enc.header, enc.payload, hidden_size=64)
    assert decode_activation(enc.header, enc.payload, hidden_size=48).shape == (1, 2, 48)


def test_an_honest_sparse_tensor_with_a_known_shape_still_decodes():
    enc = _tiny_topk((256, 1024))
    out = decode_tensor(enc.header, enc.payload, expected_shape=(256, 1024))
    assert out[0, 0] == pytest.approx(1.0, rel=0.01) and np.count_nonzero(out) == 1
    honest = encode_tensor(np.random.default_rng(0).normal(size=(256, 1024)).astype(np.float32), "topk",
                           fraction=0.001)
    assert decode_tensor(honest.header, honest.payload).shape == (256, 1024)  # ~1400x: within the bound
