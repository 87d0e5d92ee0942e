"""`polis bench rl` turns curves into steps-to-target, spreads and the issue's checks."""

from engine.bench.rl import aggregate, checks, format_table, summarise_seed


def _result(curve, seed=0, masked=0.0):
    return {"seed": seed, "curve": curve, "compute_s_at_step": {s: s * 0.5 for s, _ in curve},
            "masked_fraction": masked, "ess": 1.0, "clipped_fraction": 0.0, "zero_variance_fraction": 0.1,
            "entropy_proxy_end": 0.1, "dropped_stale": 0, "staleness_histogram": {"0": 10}, "wall_s": 1.0}


def test_steps_to_target_is_the_first_eval_at_or_above_it_and_null_when_never_reached():
    s = summarise_seed(_result([[0, 0.1], [5, 0.3], [10, 0.45], [15, 0.2], [20, 0.5]]), target=0.4)
    assert s["steps_to_target"] == 10 and s["seconds_to_target"] == 5.0
    assert s["eval_end"] == 0.5 and abs(s["eval_end_last3"] - (0.45 + 0.2 + 0.5) / 3) < 1e-4
    never = summarise_seed(_result([[0, 0.1], [5, 0.2]]), target=0.4)
    assert never["steps_to_target"] is None and never["seconds_to_target"] is None


def test_aggregate_takes_medians_of_steps_with_misses_counting_as_infinite():
    seeds = [summarise_seed(_result([[0, 0.1], [s, 0.5]], seed=i), 0.4) for i, s in enumerate((10, 30))]
    seeds.append(summarise_seed(_result([[0, 0.1], [40, 0.2]], seed=2), 0.4))
    agg = aggregate(seeds)
    assert agg["steps_to_target"] == 30 and agg["steps_to_target_per_seed"] == [10, 30, None]
    assert agg["eval_end_spread"] == [0.2, 0.5]
    assert aggregate(seeds[2:] * 2)["steps_to_target"] is None


def _run(start, end, steps):
    return {"eval_start": start, "eval_end": end, "eval_end_last3": end, "steps_to_target": steps}


def test_checks_follow_the_issue_criteria():
    good = {"sync": _run(0.1, 0.9, 70), "stale4_corrected": _run(0.1, 0.87, 84),
            "shuffled_reward": _run(0.1, 0.12, None)}
    assert all(checks(good, 0.4).values())
    bad = {"sync": _run(0.1, 0.35, 70), "stale4_corrected": _run(0.1, 0.8, 85),
           "shuffled_reward": _run(0.1, 0.3, None)}
    assert not any(checks(bad, 0.4).values())
    assert checks(good, 0.4, ends_comparable=False)["stale4_corrected_ends_within_5_points"] is None


def test_table_lists_every_run_and_check():
    runs = {"sync": {**_run(0.1, 0.9, 70), "seconds_to_target": 30.0, "masked_fraction": 0.0, "ess": 1.0,
                     "zero_variance_fraction": 0.2, "dropped_stale": 0}}
    report = {"task": "t", "base_eval": 0.1, "target": 0.4, "steps": 10, "num_seeds": 1, "workers": 1,
              "seconds": 1.0, "runs": runs, "checks": checks(runs, 0.4)}
    text = format_table(report)
    assert "sync" in text and "[ok] sync_rises_30_points" in text
