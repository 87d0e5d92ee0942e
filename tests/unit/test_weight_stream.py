"""The weight stream to inference replicas: roles in assignment, the state machines, drift, the codec's guards."""

from __future__ import annotations

import msgpack
import numpy as np
import pytest

from engine.net.errors import WireFormatError
from engine.net.shadow_delta import OutOfSequence
from engine.swarm import messages
from engine.swarm.assignment import Assignment, NodeSlot, assign_new_node, rebalance, remove_node
from engine.swarm.stream_book import StreamBook
from engine.swarm.tensor_bundle import checksum
from engine.swarm.weight_stream import StreamFollower, StreamLeader

# ---------------------------------------------------------------- assignment with roles


def test_inference_replicas_fill_the_stage_with_fewest_generation_replicas_but_never_count_as_trainers():
    a = Assignment(stage_layers=[2, 2])
    assert assign_new_node(a, NodeSlot("t0")) == 0
    assert assign_new_node(a, NodeSlot("t1")) == 1
    assert assign_new_node(a, NodeSlot("i0", role="inference")) == 0  # tie: lowest stage
    assert assign_new_node(a, NodeSlot("i1", role="inference")) == 1  # stage 0 has two generators now
    assert a.coverage() == [1, 1] and a.generation_coverage() == [2, 2]
    assert a.replicas() == [["t0"], ["t1"]] and a.replicas("inference") == [["i0"], ["i1"]]
    assert assign_new_node(a, NodeSlot("t2")) == 0  # trainers still go where trainers are fewest


def test_a_stage_with_only_inference_replicas_cannot_train_and_gets_a_trainer_by_rebalancing():
    a = Assignment(stage_layers=[2, 2])
    for peer in ("t0", "t1", "t2"):
        assign_new_node(a, NodeSlot(peer))
    assign_new_node(a, NodeSlot("i0", role="inference"))
    assert a.replicas(None) == [["i0", "t0", "t2"], ["t1"]] or a.nodes["i0"].stage == 1
    stage_of_t1 = a.nodes["t1"].stage
    remove_node(a, "t1")
    # only inference replicas (or nobody) left on t1's stage: it cannot train
    assert not a.complete()
    moves = rebalance(a)
    assert len(moves) == 1 and moves[0][2] == stage_of_t1 and moves[0][0] != "i0"
    assert a.complete()


def test_rebalance_never_moves_inference_replicas():
    a = Assignment(stage_layers=[2, 2])
    assign_new_node(a, NodeSlot("t0"))
    for i in range(3):
        a.nodes[f"i{i}"] = NodeSlot(f"i{i}", stage=0, role="inference")
    assert rebalance(a) == []
    assert a.coverage() == [1, 0] and a.generation_coverage() == [4, 0]


# ---------------------------------------------------------------- state machines


def _weights(rng, scale=1.0):
    return {"model.embed_tokens.weight": (scale * rng.standard_normal((40, 32))).astype(np.float32),
            "model.layers.0.mlp.up_proj.weight": (scale * rng.standard_normal((64, 32))).astype(np.float32),
            "model.layers.0.input_layernorm.weight": np.ones(32, np.float32)}


def _adam_like_step(weights, rng, lr=1e-3):
    """Every entry moves by about lr, like an AdamW update (dense, similar magnitudes)."""
    return {n: (w - np.float32(lr) * np.tanh(rng.standard_normal(w.shape) * 3).astype(np.float32)).astype(np.float32)
            for n, w in weights.items()}


def _wire(frame):
    """Through msgpack, as a peer link would carry it."""
    return msgpack.unpackb(msgpack.packb(frame.header)), bytes(frame.payload)


def _bits_equal(a: dict, b: dict) -> bool:
    return sorted(a) == sorted(b) and all(np.array_equal(a[n].view(np.uint32), b[n].view(np.uint32)) for n in a)


def test_inference_weights_equal_the_leader_shadow_bit_for_bit_and_trail_the_trainer_by_one_residual():
    rng = np.random.default_rng(0)
    trainer = _weights(rng)
    leader, follower = StreamLeader(), StreamFollower()
    stream = leader.start("inf", trainer, version=5)
    follower.reset("lead", stream, trainer, version=5)
    served = {n: w.copy() for n, w in trainer.items()}
    residuals = []
    for round_ in range(300):
        before = trainer
        trainer = _adam_like_step(trainer, rng)
        frame = leader.encode("inf", trainer, version=6 + round_)
        assert follower.decide("lead", "wdelta", 6 + round_, frame.header["stream"]) == StreamFollower.APPLY
        header, payload = _wire(frame)
        served.update(follower.apply(header["delta"], payload, header["version"]))
        shadow = leader.shadow("inf")
        assert _bits_equal(served, shadow)  # the replica holds exactly the leader's shadow
        assert frame.report["checksum"] == checksum(served)
        # the trainer is ahead of the replica only by this round's quantisation residual: at most
        # ~half an int8 step (log-coded scales round up by <= 2**(1/8), twice with column scales)
        # of what this round encoded (the step plus the residual carried from the last round)
        for name, w in trainer.items():
            encoded = np.abs(w - before[name]).max() + (residuals[-1] if residuals else 0.0)
            assert np.abs(w - served[name]).max() <= 0.6 * encoded / 127 + 1e-7
        residuals.append(frame.report["residual_max_abs"])
        assert residuals[-1] == max(float(np.abs(trainer[n] - served[n]).max()) for n in trainer)
    assert follower.version == 305
    # no drift: the residual after 300 rounds is as small as after 10 (it never accumulates)
    assert max(residuals[-50:]) <= 2 * max(residuals[:10])
    assert max(residuals) < 1e-3 / 50
    # int8 codes + a scale byte per row (hidden 32 here: ~0.28; ~0.25 for real widths)
    assert frame.report["delta_bytes"] < 0.3 * frame.report["dense_bytes"]


def test_out_of_sequence_delta_leaves_the_replica_untouched_and_asks_for_full_weights():
    rng = np.random.default_rng(1)
    w = _weights(rng)
    leader, follower = StreamLeader(), StreamFollower()
    follower.reset("lead", leader.start("inf", w, 1), w, 1)
    lost = leader.encode("inf", _adam_like_step(w, rng), 2)  # never delivered
    nxt = leader.encode("inf", _adam_like_step(w, rng), 3)
    before = follower.shadow()
    header, payload = _wire(nxt)
    with pytest.raises(OutOfSequence):
        follower.apply(header["delta"], payload, 3)
    assert _bits_equal(follower.shadow(), before) and follower.version == 1
    assert lost.header["delta"]["seq"] == 0
    # resync: full weights from the leader restart both shadows on exactly those weights
    now = _adam_like_step(w, rng)
    stream = leader.start("inf", now, 3)
    follower.reset("lead", stream, now, 3)
    frame = leader.encode("inf", _adam_like_step(now, rng), 4)
    header, payload = _wire(frame)
    follower.apply(header["delta"], payload, 4)
    assert _bits_equal(follower.shadow(), leader.shadow("inf"))


def test_follower_decisions_new_leader_old_streams_and_stale_leads():
    w = _weights(np.random.default_rng(2))
    f = StreamFollower()
    assert f.decide("lead", "wdelta", 3, 7) == "resync"  # never synced
    assert f.decide("lead", "wlead", 3) == "resync"
    f.reset("lead", 7, w, version=3)
    assert f.decide("lead", "wdelta", 4, 7) == "apply"
    assert f.decide("other", "wdelta", 4, 9) == "resync"  # the leader changed
    assert f.decide("other", "wlead", 4) == "resync"
    assert f.decide("lead", "wdelta", 3, 6) == "ignore"  # an older stream, sent before our weights
    assert f.decide("lead", "wdelta", 5, 6) == "resync"  # the leader restarted its stream
    assert f.decide("lead", "wlead", 3) == "ignore"  # sent before it served our fetch
    assert f.decide("lead", "wlead", 4) == "resync"  # it lost our stream since
    f.forget()
    assert not f.following and f.decide("lead", "wdelta", 4, 7) == "resync"


def test_malformed_deltas_are_refused_and_change_nothing():
    rng = np.random.default_rng(3)
    w = _weights(rng)
    leader, follower = StreamLeader(), StreamFollower()
    follower.reset("lead", leader.start("inf", w, 0), w, 0)
    frame = leader.encode("inf", _adam_like_step(w, rng), 1)
    header, payload = _wire(frame)
    delta = header["delta"]
    before = follower.shadow()
    entries = delta["tensors"]
    big, small = entries[0], entries[2]
    cases = [
        ({**delta, "tensors": [["model.unknown", big[1], big[2]]] + entries[1:]}, payload, "unknown tensor"),
        ({**delta, "tensors": [[small[0], big[1], big[2]], entries[1], [big[0], small[1], small[2]]]}, payload,
         "shape"),
        ({**delta, "tensors": [[big[0], {**big[1], "dtype": "float16"}, big[2]]] + entries[1:]}, payload, "dtype"),
        ({**delta, "tensors": []}, b"", "without tensors"),
        (delta, payload + b"\0" * (1 << 20), "exceeds"),
        ({**delta, "extra": 1}, payload, "unknown field"),
    ]
    for bad, bad_payload, reason in cases:
        with pytest.raises(WireFormatError, match=reason):
            follower.apply(bad, bad_payload, 1)
        assert _bits_equal(follower.shadow(), before) and follower.version == 0
    # a delta whose sum would overflow float32 is refused too
    big = {n: np.full_like(a, 2e38) for n, a in w.items()}
    zeros = {n: np.zeros_like(a) for n, a in w.items()}
    mismatched = StreamLeader()
    f2 = StreamFollower()
    f2.reset("lead", mismatched.start("inf", zeros, 0), big, 0)  # shadows disagree: a hostile leader
    h2, p2 = _wire(mismatched.encode("inf", {n: np.full_like(a, 1.5e38) for n, a in w.items()}, 1))
    with pytest.raises(WireFormatError, match="non-finite"):
        f2.apply(h2["delta"], p2, 1)  # 2e38 + 1.5e38 overflows float32
    assert all(np.all(a == np.float32(2e38)) for a in f2.shadow().values())
    # the follower's good state survives: the genuine delta still applies
    follower.apply(delta, payload, 1)
    assert _bits_equal(follower.shadow(), leader.shadow("inf"))


def test_leader_caps_its_streams_and_forgets_replicas_that_left():
    w = _weights(np.random.default_rng(4))
    from engine.swarm.weight_stream import WeightStreamConfig

    leader = StreamLeader(WeightStreamConfig(max_streams=2))
    a, b = leader.start("a", w, 0), leader.start("b", w, 0)
    assert a != b
    leader.encode("a", w, 1)  # "b" is now the least recently used
    leader.start("c", w, 1)
    assert leader.peers() == ["a", "c"]
    leader.retain(["c", "z"])
    assert leader.peers() == ["c"]
    leader.clear()
    assert leader.peers() == []


def test_stream_book_pairs_what_replicas_serve_with_their_leaders_shadow():
    book = StreamBook()
    book.on_streamed("lead", 0, 4, [messages.StreamReport(peer="inf", checksum=1.5, delta_bytes=260, dense_bytes=1000,
                                                          residual_max_abs=1e-6)])
    book.on_served("inf", 0, messages.Served(version=4, checksum=1.5, source="lead", full=False))
    stats = book.stats()
    assert stats["replicas"]["inf"]["in_sync"] is True and stats["ratio_vs_dense_fp32"] == 0.26
    book.on_served("inf", 0, messages.Served(version=4, checksum=2.0, source="lead", full=False))
    assert book.stats()["replicas"]["inf"]["in_sync"] is False
    book.on_served("inf", 0, messages.Served(version=4, checksum=2.0, source="other", full=False))
    assert book.stats()["replicas"]["inf"]["shadow_checksum"] is None
    book.forget("inf")
    assert book.stats()["replicas"] == {}
