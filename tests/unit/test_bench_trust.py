"""``polis bench trust``'s replicated stage: every update is the swarm's robust aggregate of three
replicas' shares (real tiny base, real objective gradients, ``engine.swarm.replica_sync.aggregate``)."""

from __future__ import annotations

import numpy as np

from engine.bench.trust import REPLICAS, ReplicaShares, attacked, forge
from engine.paths import base_checkpoint_dir
from engine.rl.pipeline import LocalPipeline
from engine.rl.recipe import RL_OPTIMIZER
from engine.rl.rollout import Group, Sample


def _update(attack, hostile):
    """One update of three micro-batches; returns (weights moved by, steps lost)."""
    inner = LocalPipeline.from_checkpoint(str(base_checkpoint_dir()), 1, "torch", "cpu", RL_OPTIMIZER)
    try:
        pipeline = ReplicaShares(inner, attack=attack, hostile=hostile, seed=0)
        before = {k: v.copy() for k, v in inner.state_dicts()[0].items()}
        ids = np.random.default_rng(1).integers(3, 12, size=(6, 5))
        pipeline.zero_grad()
        for r in range(REPLICAS):
            rows = slice(2 * r, 2 * r + 2)
            logp = pipeline.token_logprobs(ids[rows, :-1], ids[rows, 1:], key=f"k{r}")
            pipeline.backward(f"k{r}", np.full_like(logp, -1e-2))
        pipeline.grad_sq_norms()
        pipeline.step(1.0)
        after = inner.state_dicts()[0]
        moved = float(np.sqrt(sum(float(np.square(after[k] - before[k]).sum()) for k in before)))
        return moved, pipeline.steps_lost
    finally:
        inner.close()


def test_two_colluders_sending_3e38_lose_the_update_and_leave_the_weights_as_they_were():
    moved, lost = _update("3e38", (0, 1))
    assert lost == 1 and moved == 0.0


def test_a_sign_flipped_x10_replica_moves_the_weights_about_as_much_as_an_honest_update():
    honest, _ = _update(None, ())
    flipped, lost = _update("flip_x10", (0,))
    assert lost == 0 and 0 < flipped < 2 * honest  # clipped, not x10


def test_the_attacks_are_what_finding_6_describes_and_forgery_is_what_finding_4_describes():
    share = {"w": np.array([3.0, 4.0], np.float32)}
    rng = np.random.default_rng(0)
    assert attacked(share, "x10", rng)["w"].tolist() == [30.0, 40.0]
    assert attacked(share, "flip_x10", rng)["w"].tolist() == [-30.0, -40.0]
    assert abs(float(np.linalg.norm(attacked(share, "noise", rng)["w"])) - 50.0) < 1e-3
    assert np.all(attacked(share, "3e38", rng)["w"] == np.float32(3e38))
    groups = [Group(prompt="p", prompt_ids=np.array([1]), samples=[
        Sample(np.array([5, 2]), np.array([-0.1, -0.2], np.float32), np.zeros((2, 1), np.int64), True)])
        for _ in range(3)]
    forged = forge(groups, vocab_size=40, stop_id=2)
    assert forged[0].samples[0].completion_ids.tolist() == [5, 2, 45] and forged[0].samples[0].versions.max() == 2**40
    assert forged[1].samples[0].completion_ids.tolist() == [5, 2]  # one generator in three


def test_several_seeds_are_summarised_per_scenario_against_the_clean_run_of_each_seed():
    from engine.bench.trust import format_summary, summarise

    def row(name, seed, end, clean):
        return {"scenario": name, "seed": seed, "eval_end": end, "vs_clean": round(end - clean, 4), "steps_lost": 0,
                "refused_groups": 3}
    results = [row("clean", 0, 0.10, 0.10), row("x10", 0, 0.12, 0.10),
               row("clean", 1, 0.20, 0.20), row("x10", 1, 0.16, 0.20)]
    summary = {s["scenario"]: s for s in summarise(results)}
    assert summary["x10"]["vs_clean_mean"] == -0.01 and (summary["x10"]["vs_clean_min"],
                                                         summary["x10"]["vs_clean_max"]) == (-0.04, 0.02)
    assert summary["clean"]["eval_end_mean"] == 0.15 and summary["x10"]["seeds"] == [0, 1]
    assert "x10" in format_summary(list(summary.values()), steps=20)
