"""Finding 6 of issue 14: one hostile replica of a stage cannot steer, blow up or NaN its step.

Real aggregation (``engine.swarm.replica_sync.aggregate``) over gradients whose per-replica noise
is as large as their common signal (a hard case: honest shares already disagree a lot).
"""

from __future__ import annotations

import numpy as np
import pytest

from engine.swarm.replica_sync import aggregate

N = 4096


def _normal(seed: int, scale: float = 1.0) -> np.ndarray:
    return (scale * np.random.default_rng(seed).normal(size=N)).astype(np.float32)


def _honest(seed: int, replicas: int = 3) -> list[np.ndarray]:
    signal = _normal(seed)
    return [(signal + _normal(1000 + 10 * seed + i)) / replicas for i in range(replicas)]


def _cos(a: np.ndarray, b: np.ndarray) -> float:
    return float(a.astype(np.float64) @ b / np.linalg.norm(a) / np.linalg.norm(b))


ATTACKS = {"x10": lambda own, seed: 10 * own, "sign-flipped x10": lambda own, seed: -10 * own,
           "noise": lambda own, seed: _normal(77 + seed, 3.0)}


@pytest.mark.parametrize("attack", sorted(ATTACKS))
def test_one_hostile_replica_of_three_leaves_the_step_close_to_the_honest_mean(attack):
    for seed in range(3):
        a, b, c = _honest(seed)
        honest = 3 * (a + b) / 2  # what the two honest replicas say the step's sum is
        bad = ATTACKS[attack](c, seed)
        agg = aggregate({"a": {"w": a}, "b": {"w": b}, "evil": {"w": bad}})["w"]
        plain = a + b + bad
        assert _cos(agg, honest) > 0.85, (attack, seed, _cos(agg, honest))
        assert 0.6 < np.linalg.norm(agg) / np.linalg.norm(honest) < 1.5
        # without the defence the step goes elsewhere or is many times too long
        assert _cos(plain, honest) < 0.6 or np.linalg.norm(plain) > 3 * np.linalg.norm(honest)


def test_three_honest_replicas_aggregate_to_their_plain_sum():
    a, b, c = _honest(5)
    agg = aggregate({"a": {"w": a}, "b": {"w": b}, "c": {"w": c}})["w"]
    assert _cos(agg, a + b + c) > 0.999 and abs(np.linalg.norm(agg) / np.linalg.norm(a + b + c) - 1) < 0.05


def test_with_two_replicas_a_x10_share_counts_at_most_clip_factor_times_the_other():
    a, b = _honest(1, replicas=2)
    agg = aggregate({"a": {"w": a}, "evil": {"w": 10 * b}})["w"]
    assert np.linalg.norm(agg) <= 3.0 * np.linalg.norm(a) + 1e-3  # |a| + 2|a|, not 10|b|


def test_a_non_finite_share_is_skipped_and_colluders_past_fp32_range_make_the_step_skip():
    a, b, c = _honest(2)
    nan = b.copy()
    nan[3] = np.nan
    agg = aggregate({"a": {"w": a}, "b": {"w": nan}, "c": {"w": c}})["w"]
    assert np.isfinite(agg).all() and _cos(agg, a + c) > 0.99
    huge = np.full(N, 3e38, dtype=np.float32)
    colluded = aggregate({"a": {"w": a}, "x": {"w": huge}, "y": {"w": huge}})["w"]
    assert not np.isfinite(colluded).all()  # the stage's apply skips a non-finite aggregate
    assert np.isnan(aggregate({"x": {"w": nan}})["w"]).all()


def test_the_step_log_keeps_each_stages_median_gradient_norm_its_skip_and_the_decided_digest():
    from engine.swarm.messages import Stepped
    from engine.swarm.step_runner import stage_figures

    def stepped(norm: float, skipped: bool = False) -> Stepped:
        return Stepped(step=4, version=5, grad_norm=norm, checksum=1.0, update_bytes=0, dense_bytes=0,
                       checkpoint_path=None, weights_hash="ab" * 16, skipped=skipped)

    reports = {"a": stepped(1.0), "b": stepped(1.2), "liar": stepped(1e9), "c": stepped(0.0, True),
               "d": stepped(0.0, True), "e": stepped(3.0)}
    figures = stage_figures([["a", "b", "liar"], ["c", "d", "e"], ["gone"]], reports, {0: "ab" * 16, 1: None})
    assert figures[0] == {"replicas": 3, "grad_norm": 1.2, "skipped": False, "weights_hash": "ab" * 16}
    assert figures[1]["skipped"] and figures[1]["grad_norm"] == 0.0 and figures[1]["weights_hash"] is None
    assert figures[2] == {"replicas": 0, "grad_norm": None, "skipped": False, "weights_hash": None}
