"""`polis bench swarm` compares accuracy at equal trained samples, not at equal versions."""

import pytest

from engine.bench.swarm import _cumulative_samples, _gaps


def test_cumulative_samples_add_up_each_versions_batch_rows_in_version_order():
    versions = [{"version": 2, "samples": 100}, {"version": 1, "samples": 128}, {"version": 3, "samples": None}]
    assert _cumulative_samples(versions) == {0: 0, 1: 128, 2: 228, 3: 228}


def test_gaps_compare_each_swarm_eval_with_the_mean_of_in_process_seeds_at_the_same_point():
    swarm = [{"version": 0, "samples": 0, "accuracy": 0.125}, {"version": 8, "samples": 1000, "accuracy": 0.5}]
    local = [[{"version": 0, "samples": 0, "accuracy": 0.125}, {"version": 12, "samples": 1010, "accuracy": 0.4}],
             [{"version": 0, "samples": 0, "accuracy": 0.125}, {"version": 12, "samples": 1002, "accuracy": 0.6}]]
    gaps = _gaps(swarm, local)
    assert [g["samples"] for g in gaps] == [0, 1000]
    assert gaps[0]["gap_points"] == pytest.approx(0.0)
    assert gaps[1]["inprocess"] == pytest.approx(0.5)
    assert gaps[1]["inprocess_spread"] == [0.4, 0.6]
    assert gaps[1]["gap_points"] == pytest.approx(0.0)
    assert _gaps(swarm, [local[0]])[1]["gap_points"] == pytest.approx(10.0)


def test_the_bench_swarms_carry_every_option_the_demo_swarm_reads(monkeypatch, tmp_path):
    import engine.swarm.demo as demo
    from engine.bench.swarm import _swarm_window

    class Started(Exception):
        pass

    class Recorder:
        def __init__(self, run_dir, args):
            self.args = args

        def start(self):
            a = self.args
            _ = (a.stages, a.replicas, a.checkpoint, a.max_versions, a.set, a.model, a.backend, a.wan,
                 a.wan_profiles)
            raise Started

        def stop(self):
            pass

    monkeypatch.setattr(demo, "DemoSwarm", Recorder)
    with pytest.raises(Started):
        _swarm_window("base", tmp_path / "w", [], 1, 1.0, ("continental", None))
