"""``polis bench comm``: its scheme registry parses as run settings, and its comparisons say what they claim."""

from __future__ import annotations

from engine.bench.comm import DENSE, INT8, SCHEMES, Scheme, compare
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
