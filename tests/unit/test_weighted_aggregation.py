"""Replicas that trained unequal shares of a step aggregate to the step's gradient (issue 15 point 5).

Micro-batches follow the routes' speed, so a slow trainer holds a small partial sum; the robust
rules compare per-share estimates, and the coordinator's ``apply`` names the shares.
"""

from __future__ import annotations

import asyncio
from collections import Counter

import numpy as np
import pytest

from engine.rl.batch import TrainBatch
from engine.swarm import messages
from engine.swarm.microbatches import MicrobatchDispatcher
from engine.swarm.replica_step import token_shares
from engine.swarm.replica_sync import aggregate
from tests.support.recording_links import RecordingLinks


def _partial_sums(rng, rows_per_replica: dict[str, int]) -> tuple[dict, np.ndarray]:
    """Per-row gradients around one direction; each replica holds the sum of its rows' (token-normalised)."""
    total = sum(rows_per_replica.values())
    direction = rng.normal(size=64)
    out, full = {}, np.zeros(64)
    for peer, rows in rows_per_replica.items():
        g = sum(direction + 0.3 * rng.normal(size=64) for _ in range(rows)) / total
        out[peer] = {"w": g.astype(np.float32)}
        full += out[peer]["w"].astype(np.float64)
    return out, full


def test_with_shares_two_unequal_honest_replicas_sum_to_the_steps_gradient_unclipped():
    rng = np.random.default_rng(0)
    contributions, full = _partial_sums(rng, {"fast": 16, "slow": 4})
    weighted = aggregate(contributions, shares={"fast": 0.8, "slow": 0.2})["w"]
    np.testing.assert_allclose(weighted, full, rtol=1e-5, atol=1e-6)
    plain = aggregate(contributions)["w"]  # equal weights clip the fast replica to 2x the slow one's norm
    assert np.linalg.norm(plain - full) > 0.1 * np.linalg.norm(full)


def test_with_shares_the_robust_rule_still_bounds_a_hostile_replica():
    rng = np.random.default_rng(1)
    contributions, full = _partial_sums(rng, {"a": 12, "b": 4, "c": 4})
    shares = {"a": 0.6, "b": 0.2, "c": 0.2}
    honest = aggregate(contributions, shares=shares)["w"]
    assert np.linalg.norm(honest - full) < 0.25 * np.linalg.norm(full)
    contributions["c"] = {"w": -10 * contributions["c"]["w"]}  # sign-flipped and scaled
    attacked = aggregate(contributions, shares=shares)["w"]
    assert np.dot(attacked, full) > 0.8 * np.dot(full, full)  # still the step's direction
    assert np.linalg.norm(attacked - full) < 0.5 * np.linalg.norm(full)


def test_equal_shares_give_the_unweighted_rule_and_a_replica_with_no_share_is_left_out():
    rng = np.random.default_rng(2)
    for peers in ({"a": 4, "b": 4}, {"a": 4, "b": 4, "c": 4}):
        contributions, _ = _partial_sums(rng, peers)
        equal = {p: 1 / len(peers) for p in peers}
        np.testing.assert_allclose(aggregate(contributions, shares=equal)["w"], aggregate(contributions)["w"],
                                   rtol=1e-5, atol=1e-7)
    contributions, _ = _partial_sums(rng, {"a": 4, "b": 4})
    alone = aggregate(contributions, shares={"a": 1.0, "b": 0.0})["w"]
    np.testing.assert_array_equal(alone, contributions["a"]["w"])


def test_apply_shares_are_used_only_when_they_name_every_replica_and_sum_to_one():
    apply = messages.Apply(step=0, version=1, replicas=["a", "b"], checkpoint=False, token_shares=[0.75, 0.25])
    assert token_shares(apply) == {"a": 0.75, "b": 0.25}
    assert token_shares(messages.Apply(step=0, version=1, replicas=["a", "b"], checkpoint=False)) is None
    assert token_shares(messages.Apply(step=0, version=1, replicas=["a", "b"], checkpoint=False,
                                       token_shares=[0.5, 0.2])) is None
    wire = messages.encode(messages.Apply(step=0, version=1, replicas=["peer-a"], checkpoint=False, token_shares=[1.5]))
    with pytest.raises(Exception, match="token_shares"):  # a share is a fraction
        messages.decode_from_coordinator(wire)


def test_the_dispatcher_counts_each_trainers_tokens_for_the_steps_shares():
    links, counters = RecordingLinks.grid([["a0", "a1"], ["b0", "b1"]]), Counter()
    dispatcher = MicrobatchDispatcher(links, counters, micro_batch_rows=8, timeout_s=10.0)
    dispatcher.weights.train_done(("a0", "b0"), 12, 1.0)
    dispatcher.weights.train_done(("a1", "b1"), 4, 1.0)  # a route 3x slower

    def answer(peer, message):
        if isinstance(message, messages.TrainOut):
            asyncio.get_running_loop().call_soon(dispatcher.on_mb_done, message.route[0],
                                                 messages.MbDone(step=message.step, mb=message.mb))
    links.on_send = answer
    rows, width = 16, 3
    batch = TrainBatch(inputs=np.ones((rows, width), np.int64), targets=np.ones((rows, width), np.int64),
                       mask=np.ones((rows, width), bool), behaviour=np.full((rows, width), -1.0, np.float32),
                       advantages=np.ones(rows, np.float32), staleness=np.zeros(rows, np.int64))
    assert asyncio.run(dispatcher.run(0, batch, None)) == []
    trained = dispatcher.take_trained_tokens()
    assert trained == {"a0": 12 * width, "b0": 12 * width, "a1": 4 * width, "b1": 4 * width}
    assert dispatcher.take_trained_tokens() == Counter()
