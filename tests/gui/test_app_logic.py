"""The app's Qt-free parts: schedule rule, idle probe, contribution totals, failure explanations, formatting."""

from __future__ import annotations

import json

from app import formatting
from app.contribution import COUNTERS, ContributionLedger
from app.error_hints import explain_crash
from app.power_policy import IdleDetector, MachineState, may_run
from app.settings import AppSettings


def _state(on_battery=None, idle_s=None) -> MachineState:
    return MachineState(on_battery=on_battery, battery_percent=40.0 if on_battery is not None else None,
                        idle_s=idle_s)


def test_schedule_blocks_on_battery_only_when_asked():
    ac_only = AppSettings(run_only_on_ac_power=True)
    assert may_run(AppSettings(), _state(on_battery=True))[0]
    allowed, reason = may_run(ac_only, _state(on_battery=True))
    assert not allowed and "battery" in reason
    assert may_run(ac_only, _state(on_battery=False))[0]
    assert may_run(ac_only, _state(on_battery=None))[0]  # a desktop without a battery


def test_schedule_waits_for_idle_and_ignores_unknown_idle_time():
    idle_only = AppSettings(run_only_when_idle=True, idle_after_min=5)
    allowed, reason = may_run(idle_only, _state(idle_s=60))
    assert not allowed and "5 min" in reason
    assert may_run(idle_only, _state(idle_s=5 * 60 + 1))[0]
    assert may_run(idle_only, _state(idle_s=None))[0]


def test_idle_detector_without_a_display_says_why(monkeypatch):
    monkeypatch.delenv("DISPLAY", raising=False)
    monkeypatch.delenv("WAYLAND_DISPLAY", raising=False)
    detector = IdleDetector()
    assert not detector.supported and detector.idle_seconds() is None
    assert "not supported" in detector.unsupported_reason and "DISPLAY" in detector.unsupported_reason


def test_contribution_totals_fold_runs_and_persist_across_app_sessions(tmp_path):
    path = tmp_path / "contribution.json"
    ledger = ContributionLedger(path)
    ledger.update({"tokens_generated": 100, "points": 2.5, "uptime_s": 10})
    ledger.update({"tokens_generated": 250, "points": 4.0, "uptime_s": 20})
    ledger.end_run()
    ledger.update({"tokens_generated": 40, "points": 1.0, "uptime_s": 3, "bytes_sent": "junk"})
    assert ledger.session["tokens_generated"] == 290 and ledger.session["bytes_sent"] == 0
    ledger.end_run()
    reopened = ContributionLedger(path)
    assert reopened.all_time == ledger.all_time and reopened.session == {k: 0.0 for k in COUNTERS}
    reopened.update({"tokens_generated": 10})
    assert reopened.all_time["tokens_generated"] == 300


def test_a_corrupt_totals_file_starts_from_zero(tmp_path):
    path = tmp_path / "contribution.json"
    path.write_text("{not json")
    assert ContributionLedger(path).all_time["points"] == 0
    path.write_text(json.dumps({"all_time": {"points": -5, "tokens_generated": 7}}))
    totals = ContributionLedger(path).all_time
    assert totals["points"] == 0 and totals["tokens_generated"] == 7


def test_crash_explanations_name_the_cause_and_a_next_step():
    oom = explain_crash(1, False, ["Traceback (most recent call last):", "torch.OutOfMemoryError: CUDA out of memory"])
    assert "memory" in oom.detail and "Limits" in oom.next_step and "CUDA out of memory" in oom.detail
    killed = explain_crash(None, True, [])
    assert "killed" in killed.detail and killed.next_step
    plain = explain_crash(3, False, ["something odd"])
    assert "exit code 3" in plain.detail and "something odd" in plain.detail


def test_formatting_reads_naturally():
    assert formatting.count(742) == "742" and formatting.count(1_234_567) == "1.23 M"
    assert formatting.data_size(1_500_000) == "1.5 MB" and formatting.data_size(999) == "999 B"
    assert formatting.duration(42) == "42 s" and formatting.duration(3725) == "1 h 02 min"
    assert formatting.count(None) == "–" and formatting.duration(float("nan")) == "–"
