import msgpack
import numpy as np
import pytest

from engine.net.codec_report import error_feedback_figures, update_stream
from engine.net.error_feedback import ErrorFeedback
from engine.net.errors import WireFormatError
from engine.net.shadow_delta import DeltaReceiver, DeltaSender, WeightDelta
from engine.net.tensor_codec import decode_tensor


def _decode(encoded):
    return decode_tensor(encoded.header, encoded.payload)


@pytest.mark.parametrize("params", [{"fraction": 0.01}, {"fraction": 0.05, "value_bits": 2, "block": 32},
                                    {"fraction": 1.0, "value_bits": 2, "index_coding": "all", "scale_rule": "mse"},
                                    {"fraction": 1.0, "value_bits": 1, "index_coding": "all", "scale_rule": "mse"}])
def test_error_feedback_transmits_the_sum_of_inputs_minus_the_final_residual(params):
    rng = np.random.default_rng(0)
    feedback = ErrorFeedback("topk", **params)
    inputs = np.zeros(20_000)
    sent = np.zeros(20_000)
    for _ in range(30):
        grad = rng.standard_normal(20_000).astype(np.float32)
        inputs += grad
        sent += _decode(feedback.compress("w", grad))
    residual = feedback.residual("w")
    assert np.abs(residual).max() > 0.1  # something really was held back...
    np.testing.assert_allclose(sent, inputs - residual, rtol=0, atol=1e-4)  # ...and nothing was lost


def test_error_feedback_eventually_sends_a_constant_update_that_plain_top_k_never_does():
    grad = np.random.default_rng(1).standard_normal(10_000).astype(np.float32)
    feedback = ErrorFeedback("topk", fraction=0.01)
    sent = np.zeros_like(grad, dtype=np.float64)
    rel_error = {}
    for rounds in range(1, 401):
        sent += _decode(feedback.compress("w", grad))
        target = rounds * grad.astype(np.float64)
        rel_error[rounds] = np.linalg.norm(sent - target) / np.linalg.norm(target)
    # the residual stays bounded, so the error of the sum falls like 1/rounds
    assert rel_error[400] < 0.6 * rel_error[200] < 0.6 * 0.6 * rel_error[100]
    assert rel_error[400] < 0.15
    assert np.count_nonzero(sent) > 0.8 * grad.size  # without feedback the same 1 % every round


def test_error_feedback_owes_less_than_compressing_each_update_alone():
    figures = error_feedback_figures(update_stream(seed=2, numel=50_000, rounds=30), "topk", fraction=0.01)
    assert figures["ef_rel_error"] < 0.8 * figures["no_ef_rel_error"]


def test_error_feedback_keeps_one_residual_per_tensor_name():
    feedback = ErrorFeedback("topk", k=1)
    feedback.compress("a", np.array([1.0, 2.0], np.float32))
    feedback.compress("b", np.array([5.0, 0.0, 3.0], np.float32))
    np.testing.assert_allclose(feedback.residual("a"), [1.0, 0.0], atol=1e-6)
    np.testing.assert_allclose(feedback.residual("b"), [0.0, 0.0, 3.0], atol=1e-6)
    with pytest.raises(ValueError):
        feedback.compress("a", np.zeros(3, np.float32))
    feedback.reset("a")
    assert feedback.residual("a") is None


def _weights(rng):
    return {"model.layers.0.mlp.up_proj.weight": rng.standard_normal((64, 32)).astype(np.float32),
            "model.norm.weight": np.ones(32, np.float32)}


@pytest.mark.parametrize("encoding,params", [("int8_rowwise", {}), ("topk", {"fraction": 0.05, "value_bits": 4})])
def test_shadows_of_sender_and_receiver_stay_bit_identical_over_many_rounds(encoding, params):
    rng = np.random.default_rng(3)
    weights = _weights(rng)
    sender = DeltaSender(weights, encoding, **params)
    receiver = DeltaReceiver(weights)
    for _ in range(150):
        weights = {n: w + np.float32(1e-3) * rng.standard_normal(w.shape).astype(np.float32)
                   for n, w in weights.items()}
        header, payload = sender.encode(weights).to_wire()
        header = msgpack.unpackb(msgpack.packb(header))
        received = receiver.apply(WeightDelta.from_wire(header, payload))
        for name, shadow in sender.shadow.items():
            assert np.array_equal(shadow.view(np.uint32), received[name].view(np.uint32))
    for name, w in weights.items():  # and the shadow follows the weights: no drift
        drift = np.abs(received[name] - w).max()
        assert drift < 0.05 * np.abs(w).max()


def test_receiver_refuses_out_of_order_unknown_or_misshapen_deltas_and_keeps_its_state():
    rng = np.random.default_rng(4)
    weights = _weights(rng)
    sender = DeltaSender(weights)
    receiver = DeltaReceiver(weights)
    first = sender.encode({n: w + 1 for n, w in weights.items()})
    second = sender.encode({n: w + 2 for n, w in weights.items()})
    with pytest.raises(WireFormatError, match="seq"):
        receiver.apply(second)
    bogus = WeightDelta(seq=0, tensors={**first.tensors, "model.extra": first.tensors["model.norm.weight"]})
    with pytest.raises(WireFormatError, match="unknown tensor"):
        receiver.apply(bogus)
    swapped = WeightDelta(seq=0, tensors={"model.norm.weight": first.tensors["model.layers.0.mlp.up_proj.weight"]})
    with pytest.raises(WireFormatError, match="shape"):
        receiver.apply(swapped)
    assert all(np.array_equal(receiver.weights[n], w) for n, w in weights.items())
    receiver.apply(first)
    receiver.apply(second)


def test_weight_delta_frames_are_validated():
    header, payload = DeltaSender(_weights(np.random.default_rng(5))).encode(
        _weights(np.random.default_rng(6))).to_wire()
    for bad_header, bad_payload, reason in (
            ({**header, "seq": -1}, payload, "seq"),
            ({**header, "tensors": "x"}, payload, "Expected `array`"),
            ({**header, "tensors": [["a b", {}, 0]]}, b"", "regex"),
            ({**header, "tensors": [["a", {}, 10]]}, b"", "size"),
            (header, payload + b"x", "trailing"),
            ({**header, "other": 1}, payload, "unknown field")):
        with pytest.raises(WireFormatError, match=reason):
            WeightDelta.from_wire(bad_header, bad_payload)
