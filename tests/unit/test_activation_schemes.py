from typing import get_args

import numpy as np
import pytest

from engine.swarm import pipeline_hops
from engine.swarm.boundary_basis import BoundaryCodec
from engine.swarm.pipeline_hops import ACTIVATION_SCHEMES, decode_activation
from engine.swarm.run_config import ACTIVATION_ENCODINGS, ActivationEncoding, RunConfig


def test_every_run_config_activation_encoding_is_a_scheme_and_back():
    assert set(get_args(ActivationEncoding)) == set(ACTIVATION_SCHEMES) == set(ACTIVATION_ENCODINGS)


@pytest.mark.parametrize("name", sorted(ACTIVATION_SCHEMES))
def test_every_scheme_round_trips_activations_and_gradients_through_the_receivers_checks(name):
    rng = np.random.default_rng(0)
    x = rng.standard_normal((4, 40, 64)).astype(np.float32)
    sender, receiver = BoundaryCodec(calibration_rows=100), BoundaryCodec()
    for kind in ("act", "grad"):
        for _ in range(2):  # a basis scheme's first tensor calibrates (fallback), the second uses the basis
            header, payload = sender.encode(kind, x, name, "peer")
            y = receiver.decode(header, payload, hidden_size=64, sender="me")
            sender.sent("peer", header)
            assert y.shape == x.shape and y.dtype == np.float32
            assert float(np.linalg.norm(y - x) / np.linalg.norm(x)) < 0.98  # rank 4 of white noise keeps ~6 %


def test_subspace_sends_a_large_micro_batch_at_low_rank_and_one_decoding_step_as_exact_outliers_plus_int8():
    rng = np.random.default_rng(1)
    basis = rng.standard_normal((16, 576))
    batch = (rng.standard_normal((8 * 150, 16)) @ basis).reshape(8, 150, 576).astype(np.float32)
    codec = BoundaryCodec()
    header, payload = codec.encode("act", batch, "subspace_r32", "peer")
    assert header["params"]["rank"] == 32 and header["params"]["residual"] is False
    assert 4 * batch.size / len(payload) > 16
    step = batch[:, -1:, :]
    header, payload = codec.encode("act", step, "subspace_r32", "peer")
    assert header["params"]["rank"] == 0 and header["params"]["residual"] is True
    y = decode_activation(header, payload, hidden_size=576)
    assert float(np.linalg.norm(y - step) / np.linalg.norm(step)) < 0.01


def test_unknown_scheme_names_are_refused_by_the_run_config_and_the_encoder():
    with pytest.raises(ValueError):
        RunConfig(activation_encoding="subspace_r7")
    with pytest.raises(ValueError, match="unknown activation encoding"):
        pipeline_hops.scheme_of("subspace_r7")
