"""Shard plans: contiguous, even, earlier stages take the extra layers, bad plans refused."""

from __future__ import annotations

import pytest

from backends.base import StageSpec
from engine.model.shard_plan import check_plan, check_spec, plan_stages


@pytest.mark.parametrize("num_layers", [1, 2, 5, 7, 12, 32])
def test_plans_cover_all_layers_contiguously_and_evenly(num_layers):
    for num_stages in range(1, num_layers + 1):
        specs = plan_stages(num_layers, num_stages)
        check_plan(specs, num_layers)
        sizes = [s.num_layers for s in specs]
        assert max(sizes) - min(sizes) <= 1 and sizes == sorted(sizes, reverse=True)
        assert specs[0].is_first and specs[-1].is_last


def test_uneven_split_gives_the_extra_layers_to_the_earliest_stages():
    assert [(s.layer_start, s.layer_end) for s in plan_stages(10, 4)] == [(0, 3), (3, 6), (6, 8), (8, 10)]


@pytest.mark.parametrize("num_layers, num_stages", [(4, 5), (0, 1), (4, 0), (3, -1)])
def test_impossible_splits_are_refused(num_layers, num_stages):
    with pytest.raises(ValueError):
        plan_stages(num_layers, num_stages)


def test_plans_with_gaps_overlaps_or_wrong_labels_are_refused():
    with pytest.raises(ValueError, match="starts at layer"):
        check_plan([StageSpec(0, 2, 0, 2), StageSpec(1, 2, 3, 4)], 4)
    with pytest.raises(ValueError, match="ends at layer"):
        check_plan([StageSpec(0, 2, 0, 2), StageSpec(1, 2, 2, 3)], 4)
    with pytest.raises(ValueError, match="labelled"):
        check_plan([StageSpec(0, 3, 0, 2), StageSpec(1, 3, 2, 4)], 4)
    with pytest.raises(ValueError, match="at least one"):
        check_plan([], 4)


def test_single_specs_must_fit_the_model():
    check_spec(StageSpec(1, 3, 2, 3), 4)
    with pytest.raises(ValueError, match="model has 4"):
        check_spec(StageSpec(1, 3, 2, 5), 4)
    with pytest.raises(ValueError, match="last stage"):
        check_spec(StageSpec(2, 3, 2, 3), 4)
    with pytest.raises(ValueError, match="first stage"):
        check_spec(StageSpec(0, 3, 1, 3), 4)
