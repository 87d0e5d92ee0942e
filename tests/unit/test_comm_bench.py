"""``polis bench comm``: its scheme registry parses as run settings, and its comparisons say what they claim."""

from __future__ import annotations

from engine.bench.comm import ACT_FP32, DENSE, INT8, SCHEMES, Scheme, compare, mean_curve, scheme_row
from engine.bench.swarm import versions_per_min
from engine.swarm.run_config import RunConfig, apply_overrides


def test_every_registered_scheme_is_a_valid_set_of_run_settings_with_a_unique_name():
    names = [s.name for s in SCHEMES]
    assert len(set(names)) == len(names) and names[:2] == [DENSE, INT8]
    for scheme in SCHEMES:
        assert isinstance(scheme, Scheme)
        apply_overrides(RunConfig(), list(scheme.settings))  # raises on a bad setting


def _row(name: str, bytes_per_sample: float, accuracies: list[float]) -> dict:
    return {"scheme": name, "update_bytes_per_sample": bytes_per_sample,
            "curve": [{"version": 60 * i, "samples": 7680 * i, "accuracy": a} for i, a in enumerate(accuracies)]}


def test_compare_measures_bytes_against_int8_and_accuracy_against_dense_at_the_same_versions():
    rows = [_row(DENSE, 7000.0, [0.1, 0.5, 0.8]), _row(INT8, 1800.0, [0.1, 0.5, 0.79]),
            _row("sparse", 6.0, [0.1, 0.45, 0.77]), _row("lossy", 6.0, [0.1, 0.3, 0.6])]
    compare(rows)
    by = {r["scheme"]: r for r in rows}
    assert by["sparse"]["update_reduction_vs_int8_every_step"] == 300.0
    assert round(by["sparse"]["accuracy_gap_points_vs_dense"], 6) == -3.0
    assert round(by["sparse"]["accuracy_gap_points_vs_dense_mean"], 6) == -4.0
    assert by["sparse"]["meets_target"] and not by["lossy"]["meets_target"] and not by[INT8]["meets_target"]


def test_a_scheme_whose_last_eval_is_close_but_whose_curve_lags_does_not_meet_the_target():
    rows = [_row(DENSE, 7000.0, [0.1, 0.5, 0.8]), _row(INT8, 1800.0, [0.1, 0.5, 0.8]),
            _row("late", 6.0, [0.1, 0.2, 0.78])]
    compare(rows)
    late = rows[-1]
    assert round(late["accuracy_gap_points_vs_dense"], 6) == -2.0
    assert round(late["accuracy_gap_points_vs_dense_mean"], 6) == -16.0 and not late["meets_target"]


def test_activation_rows_are_measured_against_fp32_activations_not_against_the_update_references():
    def act(name: str, other: float, accuracies: list[float]) -> dict:
        encoding = name.removeprefix("act_")
        return {**_row(name, 2000.0, accuracies), "settings": [f"activation_encoding={encoding}"],
                "other_wire_bytes_per_sample": other}

    rows = [_row(DENSE, 7000.0, [0.1, 0.5, 0.8]), _row(INT8, 1800.0, [0.1, 0.5, 0.8]),
            act(ACT_FP32, 8000.0, [0.1, 0.4, 0.6]), act("act_small", 400.0, [0.1, 0.37, 0.58]),
            act("act_lossy", 400.0, [0.1, 0.2, 0.5]), act("act_big", 1000.0, [0.1, 0.4, 0.6])]
    compare(rows)
    by = {r["scheme"]: r for r in rows}
    assert by["act_small"]["other_wire_reduction_vs_act_fp32"] == 20.0
    assert round(by["act_small"]["accuracy_gap_points_vs_act_fp32"], 6) == -2.0  # not -22 against dense
    assert by["act_small"]["meets_activation_target"]
    assert not by["act_lossy"]["meets_activation_target"] and not by["act_big"]["meets_activation_target"]
    assert "other_wire_reduction_vs_act_fp32" not in by[ACT_FP32] and "meets_activation_target" not in by[INT8]


def test_the_mean_curve_over_seeds_keeps_only_versions_every_run_evaluated_and_their_spread():
    a = [{"version": 0, "samples": 0, "accuracy": 0.1}, {"version": 80, "samples": 100, "accuracy": 0.4},
         {"version": 160, "samples": 200, "accuracy": 0.6}]
    b = [{"version": 0, "samples": 0, "accuracy": 0.1}, {"version": 80, "samples": 110, "accuracy": 0.6}]
    curve = mean_curve([a, b])
    assert [p["version"] for p in curve] == [0, 80]
    assert curve[1]["samples"] == 105 and abs(curve[1]["accuracy"] - 0.5) < 1e-12
    assert curve[1]["accuracy_range"] == [0.4, 0.6]


def test_a_schemes_row_counts_bytes_per_sample_over_all_its_seeds():
    def run(seed: int, update: int, samples: int) -> dict:
        return {"seed": seed, "update_bytes": update, "dense_update_bytes": 10 * update, "bytes_on_wire": 3 * update,
                "seconds": 10.0, "versions_per_min": 60.0 + seed, "staleness_histogram": {},
                "curve": [{"version": 0, "samples": 0, "accuracy": 0.1},
                          {"version": 8, "samples": samples, "accuracy": 0.2}]}

    row = scheme_row(Scheme("x", (), "x"), [run(0, 100, 10), run(1, 300, 30)])
    assert row["update_bytes_per_sample"] == 10.0 and row["other_wire_bytes_per_sample"] == 20.0
    assert row["seeds"] == [0, 1] and row["versions_per_min"] == 60.5


def test_the_pace_comes_from_the_coordinators_version_timestamps():
    log = [{"version": v, "created_at": 1000.0 + 2.0 * v} for v in range(1, 31)]
    assert abs(versions_per_min(log) - 30.0) < 1e-9
    assert versions_per_min(log[:1]) is None and versions_per_min([]) is None
