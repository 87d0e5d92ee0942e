import numpy as np
import pytest

from engine.net.errors import ProtocolViolation
from engine.swarm import tensor_bundle
from engine.swarm.replica_sync import ReplicaCompressor, aggregate, dense_nbytes


def _grads(seed, scale=1.0):
    rng = np.random.default_rng(seed)
    return {"a.weight": (scale * rng.normal(size=(64, 32))).astype(np.float32),
            "b.bias": (scale * rng.normal(size=(32,))).astype(np.float32)}


@pytest.mark.parametrize("encoding, max_share_of_dense", [("topk", 1 / 5), ("int8", 0.27)])
def test_replicas_that_exchange_compressed_grads_compute_identical_aggregates(encoding, max_share_of_dense):
    replicas = {f"p{i}": ReplicaCompressor(encoding, 0.05) for i in range(3)}
    sent = {}
    own = {}
    for i, (peer, comp) in enumerate(replicas.items()):
        encoded, decoded = comp.compress(_grads(i))
        entries, payload = tensor_bundle.pack(encoded)
        sent[peer] = (entries, payload)
        own[peer] = decoded
    shapes = {k: v.shape for k, v in _grads(0).items()}
    results = []
    for me in replicas:
        contributions = {me: own[me]}
        for peer, (entries, payload) in sent.items():
            if peer != me:
                contributions[peer] = tensor_bundle.unpack(entries, payload, shapes, require_all=True)
        results.append(aggregate(contributions))
    for other in results[1:]:
        for name in results[0]:
            assert np.array_equal(results[0][name], other[name])
    total = sum(len(p) for _, p in sent.values())
    assert total < sum(dense_nbytes(_grads(i)) for i in range(3)) * max_share_of_dense


@pytest.mark.parametrize("encoding", ["topk", "int8"])
def test_error_feedback_sends_everything_eventually(encoding):
    comp = ReplicaCompressor(encoding, 0.1)
    g = _grads(0)
    sent_sum = {k: np.zeros_like(v) for k, v in g.items()}
    for _ in range(30):
        _, decoded = comp.compress(g)
        for k in g:
            sent_sum[k] += decoded[k]
    for k in g:
        owed = comp._feedback.residual(k)
        np.testing.assert_allclose(sent_sum[k] + owed, 30 * g[k], rtol=1e-4, atol=1e-3)


def test_an_outlier_replica_is_norm_clipped_with_three_or_more():
    contributions = {"a": _grads(1), "b": _grads(2), "evil": _grads(3, scale=1000.0)}
    agg = aggregate(contributions)
    plain = {k: sum(c[k] for c in contributions.values()) for k in agg}
    norm = lambda d: np.sqrt(sum(float((v ** 2).sum()) for v in d.values()))  # noqa: E731
    assert norm(agg) < 5 * norm(contributions["a"])
    assert norm(plain) > 100 * norm(contributions["a"])


def test_bundle_rejects_unknown_names_wrong_shapes_and_byte_mismatch():
    entries, payload = tensor_bundle.pack_arrays(_grads(0))
    shapes = {k: v.shape for k, v in _grads(0).items()}
    with pytest.raises(ProtocolViolation):
        tensor_bundle.unpack(entries, payload + b"x", shapes)
    with pytest.raises(ProtocolViolation):
        tensor_bundle.unpack(entries, payload, {"a.weight": (64, 32)})
    with pytest.raises(ProtocolViolation):
        tensor_bundle.unpack(entries, payload, {"a.weight": (32, 64), "b.bias": (32,)})
    with pytest.raises(ProtocolViolation):
        tensor_bundle.unpack(entries[:1], payload[: entries[0]["nbytes"]], shapes, require_all=True)


def test_int8_updates_are_dense_within_a_percent_and_fp32_exact():
    g = _grads(4)
    _, decoded = ReplicaCompressor("int8").compress(g)
    for k in g:
        assert np.linalg.norm(decoded[k] - g[k]) <= 0.01 * np.linalg.norm(g[k])
    _, exact = ReplicaCompressor("fp32").compress(g)
    assert all(np.array_equal(exact[k], g[k]) for k in g)
    with pytest.raises(ValueError, match="update encoding"):
        ReplicaCompressor("zip")
