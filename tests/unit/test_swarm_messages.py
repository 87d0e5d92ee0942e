"""Swarm messages: every type decodes from the dicts today's senders write, the bytes keep their
shape, and malformed messages are refused (engine.swarm.messages)."""

import json
import math

import msgpack
import msgspec
import pytest

from engine.net.errors import ProtocolViolation
from engine.swarm import messages as m

PEER = "a" * 16
TENSOR = {"v": 1, "dtype": "float32", "shape": [2, 3], "encoding": "fp32", "params": {}}
PARAMS = {"max_new_tokens": 8, "temperature": 0.7, "top_p": 1.0, "seed": 3, "stop_ids": [2]}

FROM_COORDINATOR = [
    {"type": "challenge", "nonce": "ab" * 16},
    {"type": "welcome", "stage": 0, "num_stages": 2, "layer_start": 0, "layer_end": 2, "num_layers": 4,
     "source": "peer", "source_peer": PEER, "stage_checkpoint": None, "version": 5, "run": {"lr": 0.1},
     "run_id": "r1", "signal_url": "ws://127.0.0.1:1/signal"},
    {"type": "members", "stages": [[PEER], [PEER]], "version": 3, "inference": [PEER], "leaders": [PEER, None]},
    {"type": "gen", "job": "j1", "route": [PEER, PEER], "prompt_ids": [[1, 2, 3]], "params": PARAMS},
    {"type": "gen_release", "job": "j1", "route": [PEER, PEER]},
    {"type": "train_in", "step": 1, "mb": 0, "route": [PEER], "inputs": [[1, 2]], "prox": True},
    {"type": "train_out", "step": 1, "mb": 0, "route": [PEER], "targets": [[1, 2]], "mask": [[True, False]],
     "behaviour": [[-0.5, -1.0]], "advantages": [0.25], "normaliser": 2.0, "proximal": [[-0.4, -0.9]]},
    {"type": "apply", "step": 1, "version": 2, "replicas": [PEER], "checkpoint": False, "inference": [PEER],
     "leader": PEER},
    {"type": "abort", "step": 4},
    {"type": "sync", "source_peer": PEER, "weights_hash": "0123456789abcdef" * 2, "version": 2},
    {"type": "shutdown", "reason": "full"},
    {"type": "export_permit", "peer": PEER, "stage": 1, "expires_s": 1_800_000_000},
]
FROM_NODE = [
    {"type": "hello", "peer_id": PEER, "public_key": "k", "signature": "s", "backend": "torch", "device": "cpu",
     "max_layers": None, "stage": None, "num_stages": None, "version": 0, "run_id": None, "has_base": True,
     "role": "inference"},
    {"type": "ready", "stage": 1, "version": 0},
    {"type": "gen_done", "job": "j1", "tokens": [[4, 2]], "logprobs": [[-0.1, -0.2]], "versions": [1, 1]},
    {"type": "job_failed", "job": "j1", "reason": "peer left"},
    {"type": "mb_loss", "step": 1, "mb": 0, "loss": 0.3, "tokens": 10, "masked_fraction": 0.0, "ess": 1.0,
     "clipped_fraction": 0.1},
    {"type": "mb_done", "step": 1, "mb": 0},
    {"type": "prox_done", "step": 1, "mb": 0, "logprobs": [[-0.3]]},
    {"type": "mb_failed", "step": 1, "mb": 0, "reason": "x"},
    {"type": "stepped", "step": 1, "version": 2, "grad_norm": 0.5, "checksum": -3.5, "update_bytes": 10,
     "dense_bytes": 40, "checkpoint_path": None, "weights_hash": "ab" * 16},
    {"type": "streamed", "version": 2, "streams": [{"peer": PEER, "checksum": 1.0, "delta_bytes": 5,
                                                    "dense_bytes": 20, "residual_max_abs": 0.001}]},
    {"type": "served", "version": 2, "checksum": 1.0, "source": PEER, "full": False},
    {"type": "weights_refused", "source": PEER, "version": 2, "reason": "hash mismatch"},
    {"type": "report", "tokens_generated": 1, "microbatches_trained": 2, "bytes_sent": 3, "bytes_received": 4,
     "uptime_s": 5.5},
]
PEER_HEADERS = [
    {"type": "act", "kind": "gen", "job": "j1", "route": [PEER, PEER], "hop": 1, "versions": [1], "tensor": TENSOR,
     "step": 0, "mb": 0, "params": PARAMS},
    {"type": "tok", "job": "j1", "tokens": [5, 6], "done": False},
    {"type": "drop", "job": "j1", "route": [PEER, PEER], "hop": 1},
    {"type": "grad", "job": "j1", "route": [PEER, PEER], "hop": 0, "tensor": TENSOR, "step": 1, "mb": 0},
    {"type": "share", "step": 1, "tensors": [{"name": "w", "tensor": TENSOR, "nbytes": 24}]},
    {"type": "tied_grad", "step": 1, "stage": 0, "rest_sq_norm": 2.5,
     "tensors": [{"name": "model.embed_tokens.weight", "tensor": TENSOR, "nbytes": 24}]},
    {"type": "weights_req", "stage": 0, "stream": True},
    {"type": "weights", "stage": 0, "version": 3, "config": {"n_layer": 4}, "tensors": [], "stream": 7},
    {"type": "wdelta", "stage": 0, "version": 3, "stream": 7, "delta": {"codec": "int8"}},
    {"type": "wlead", "stage": 0, "version": 3},
]
ALL = ([(m.COORDINATOR_TO_NODE, d) for d in FROM_COORDINATOR] + [(m.NODE_TO_COORDINATOR, d) for d in FROM_NODE]
       + [(m.PEER_MESSAGES, d) for d in PEER_HEADERS])


def test_every_message_type_has_an_example_here():
    for family, examples in ((m.COORDINATOR_TO_NODE, FROM_COORDINATOR), (m.NODE_TO_COORDINATOR, FROM_NODE),
                             (m.PEER_MESSAGES, PEER_HEADERS)):
        assert sorted(d["type"] for d in examples) == family.names()


@pytest.mark.parametrize("family,message", ALL, ids=[d["type"] for _, d in ALL])
def test_todays_dicts_validate_and_the_encoded_bytes_keep_their_keys(family, message):
    struct = family.convert(message)
    assert msgspec.to_builtins(struct) == message  # the struct holds exactly the map's fields
    if family is m.PEER_MESSAGES:
        raw = m.encode_peer_header(struct)
        assert msgpack.unpackb(raw) == message  # what a node of the old code reads
        assert m.decode_peer_header(raw) == struct == m.decode_peer_header(msgpack.unpackb(raw))
    else:
        text = m.encode(struct)
        assert json.loads(text) == message
        decode = m.decode_from_node if family is m.NODE_TO_COORDINATOR else m.decode_from_coordinator
        assert decode(text) == struct == decode(json.dumps(message))


def test_optional_keys_at_their_default_are_left_out_of_the_bytes():
    struct = m.TrainIn(step=1, mb=0, route=[PEER], inputs=[[1]])
    assert json.loads(m.encode(struct)) == {"type": "train_in", "step": 1, "mb": 0, "route": [PEER],
                                            "inputs": [[1]]}
    assert m.decode_from_coordinator(m.encode(struct)).prox is False


@pytest.mark.parametrize("change,reason", [
    ({"smuggled": 1}, "unknown field"),
    ({"type": "gen_dome"}, "Invalid value"),
    ({"job": ""}, "length"),
    ({"tokens": [[True]]}, "Expected `int`"),
    ({"tokens": [[1 << 25]]}, "<="),
    ({"tokens": []}, "length"),
    ({"logprobs": [[1e5]]}, "<="),
    ({"logprobs": [["x"]]}, "Expected `float`"),
    ({"versions": [1.0]}, "Expected `int`"),
])
def test_malformed_messages_are_refused_with_the_reason(change, reason):
    message = {**FROM_NODE[2], **change}
    with pytest.raises(ProtocolViolation, match=reason):
        m.decode_from_node(json.dumps(message))
    with pytest.raises(ProtocolViolation, match=reason):
        m.NODE_TO_COORDINATOR.convert(message)


def test_missing_fields_and_missing_type_are_refused():
    message = dict(FROM_NODE[2])
    del message["versions"]
    with pytest.raises(ProtocolViolation, match="versions"):
        m.decode_from_node(json.dumps(message))
    with pytest.raises(ProtocolViolation, match="type"):
        m.decode_from_node(json.dumps({"job": "j1"}))
    with pytest.raises(ProtocolViolation):
        m.decode_from_node("[1, 2]")


@pytest.mark.parametrize("value", [math.nan, math.inf, -math.inf])
def test_non_finite_floats_are_refused_from_json_maps_and_msgpack(value):
    loss = {**FROM_NODE[4], "loss": value}
    with pytest.raises(ProtocolViolation):
        m.decode_from_node(json.dumps(loss))  # json.dumps writes NaN / Infinity literals
    with pytest.raises(ProtocolViolation):
        m.NODE_TO_COORDINATOR.convert(loss)
    header = {**PEER_HEADERS[0], "params": {**PARAMS, "temperature": value}}
    with pytest.raises(ProtocolViolation):
        m.decode_peer_header(msgpack.packb(header))


def test_a_message_of_one_family_is_not_accepted_by_another():
    with pytest.raises(ProtocolViolation):
        m.decode_from_coordinator(json.dumps(FROM_NODE[1]))
    with pytest.raises(ProtocolViolation):
        m.decode_peer_header(m.COORDINATOR_TO_NODE.convert(FROM_COORDINATOR[-1]))  # a struct, wrong family


def test_oversized_messages_are_refused_before_decoding():
    with pytest.raises(ProtocolViolation, match="exceeds"):
        m.decode_peer_header(b"\x80" * (m.MAX_PEER_HEADER_BYTES + 1))
