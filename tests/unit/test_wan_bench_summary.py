"""`polis bench wan` puts the demo's own summaries side by side, per profile."""

import argparse

import pytest

from engine.bench.wan import compare, demo_argv, profile_result, split_profiles


def _summary(before, after, versions, seconds=300.0, wan=None):
    return {"eval_before": before, "eval_after": after, "versions": versions, "rollouts_lost": 0,
            "rollouts": {"trained": 10}, "tokens_generated": 30000, "seconds": seconds,
            "train_job_seconds_mean": 1.5, "step_seconds_mean": 0.4, "staleness_histogram": {"0": 5, "1": 7},
            "bytes_on_wire": 10**6, **({"wan": wan} if wan else {})}


def test_runs_split_on_commas_or_on_semicolons_when_a_mix_is_among_them():
    assert split_profiles("loopback,continental") == ["loopback", "continental"]
    assert split_profiles("loopback; home:1,metro") == ["loopback", "home:1,metro"]
    with pytest.raises(ValueError):
        split_profiles(" , ")


def test_each_run_is_a_quiet_json_demo_with_its_wan_option():
    args = argparse.Namespace(minutes=4.5, wan_profiles="x.toml", checkpoint=None, set=["lr=0.001"])
    assert demo_argv("loopback", args) == ["demo", "--json", "--quiet", "--minutes", "4.5", "--set", "lr=0.001"]
    assert demo_argv("continental", args)[5:] == ["--wan", "continental", "--wan-profiles", "x.toml",
                                                 "--set", "lr=0.001"]


def test_a_profile_result_has_the_rise_versions_per_minute_and_the_relays_drops():
    wan = {"profiles": ["continental"] * 4, "relay": {"total": {"forwarded": 900, "dropped_loss": 5,
                                                                "dropped_queue": 0, "links": 8}}}
    r = profile_result("continental", _summary(0.25, 0.75, 90, wan=wan), minutes=4.5)
    assert r["rise_points"] == 50.0 and r["versions_per_min"] == 20.0
    assert r["tokens_per_s"] == 100.0 and r["relay_dropped_loss"] == 5 and r["relay_links"] == 8
    missing = profile_result("loopback", _summary(0.25, None, 0), minutes=4.5)
    assert missing["rise_points"] is None and missing["relay_forwarded"] is None


def test_later_profiles_are_compared_with_the_first():
    ref = profile_result("loopback", _summary(0.2, 0.8, 120), 4.0)
    wan = profile_result("continental", _summary(0.2, 0.5, 60), 4.0)
    ratios = compare([ref, wan])["continental"]
    assert ratios["rise_ratio"] == 0.5 and ratios["versions_per_min_ratio"] == 0.5
    assert ratios["tokens_per_s_ratio"] == 1.0
