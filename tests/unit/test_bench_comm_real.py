from types import SimpleNamespace

import numpy as np
import pytest

from engine.bench import comm_real
from engine.swarm.run_config import ReplicaSyncSettings


class _Stage:
    """A stage holding one tensor; its trainer moves it."""

    def __init__(self) -> None:
        self.w = np.zeros(8, np.float32)

    def state_dict(self):
        return {"w": self.w.copy()}

    def set_weights(self, weights):
        self.w = np.array(weights["w"], np.float32)

    def close(self):
        pass


class _Trainer:
    """Every step moves its replica's two stages by ``move`` (replicas move apart between syncs)."""

    def __init__(self, stages, move: float) -> None:
        self.stages, self.move, self.evals = stages, move, 0

    def step(self):
        for stage in self.stages:
            stage.w = stage.w + np.float32(self.move)
        return SimpleNamespace(trained=True, trained_samples=8)

    def evaluate(self):
        self.evals += 1
        return SimpleNamespace(exact_match=float(self.stages[0].w[0]), content=None)


def _fake_replicas(monkeypatch, sync: ReplicaSyncSettings):
    made = []

    def run(model, settings):
        seed = next((int(s.split("=")[1]) for s in settings if s.startswith("seed=")), 0)
        return SimpleNamespace(replica_sync=sync, prompts_per_step=4, seed=seed)

    def replica(model, run_):
        stages = [_Stage(), _Stage()]
        made.append(_Trainer(stages, move=1.0 + run_.seed))  # replica r moves by 1 + r a step
        return stages, made[-1]

    monkeypatch.setattr(comm_real, "recipe", run)
    monkeypatch.setattr(comm_real, "_replica", replica)
    return made


def test_diloco_replicas_drift_apart_between_syncs_and_hold_the_same_averaged_bits_after_each(monkeypatch):
    sync = ReplicaSyncSettings(mode="diloco", inner_steps=2, encoding="fp32", outer_lr=1.0, outer_momentum=0.0)
    made = _fake_replicas(monkeypatch, sync)
    result = comm_real.diloco_run("model", [], versions=4, eval_every=2, replicas=2)
    a, b = made
    # 2 inner steps of +1 and +2, then the mean: +3 per sync, the same bits in both replicas
    assert np.array_equal(a.stages[0].w, np.full(8, 6.0)) and np.array_equal(b.stages[1].w, a.stages[1].w)
    assert result["replicas_identical"] and result["samples"] == 4 * 2 * 8
    assert [p["version"] for p in result["curve"]] == [0, 2, 4] and [p["strict"] for p in result["curve"]] == [0, 3, 6]
    # each sync: 2 replicas x 2 stages send one fp32 tensor of 8 values (plus its bundle framing)
    assert 2 * 2 * 2 * 32 <= result["update_bytes"] < 2 * 2 * 2 * 64


def test_evals_between_syncs_are_refused_because_replicas_disagree_there(monkeypatch):
    _fake_replicas(monkeypatch, ReplicaSyncSettings(mode="diloco", inner_steps=4))
    with pytest.raises(ValueError, match="inner_steps dividing eval_every"):
        comm_real.diloco_run("model", [], versions=8, eval_every=6, replicas=2)


def test_a_scheme_row_meets_the_target_only_with_50x_fewer_bytes_and_no_5_point_loss():
    dense = {"int8_update_bytes_per_sample": 1000.0,
             "curve": [{"version": v, "strict": s} for v, s in ((0, 0.3), (16, 0.4), (32, 0.5))]}

    def row(bytes_per_sample, strict):
        r = {"update_bytes_per_sample": bytes_per_sample,
             "curve": [{"version": v, "strict": s} for v, s in zip((0, 16, 32), strict)]}
        comm_real._compare(r, dense)
        return r

    good = row(10.0, (0.3, 0.38, 0.47))
    assert good["meets_target"] and good["update_reduction_vs_int8_every_step"] == 100.0
    assert good["accuracy_gap_points_vs_dense"] == pytest.approx(-3.0)
    assert not row(30.0, (0.3, 0.4, 0.5))["meets_target"]  # 33x is short of 50x
    assert not row(10.0, (0.3, 0.3, 0.46))["meets_target"]  # -10 then -4: a mean gap of -7
