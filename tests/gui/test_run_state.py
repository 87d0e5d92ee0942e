"""The run state machine (app.run_state) driven through every transition, without Qt or a node."""

from __future__ import annotations

import pytest

from app.run_state import DEMO_ACTION, PHASES, WORK_RECENT_S, RunState

TWO_STAGES_ALONE = {"stages": [{"stage": 0, "layers": "layers 1-1 of 2", "replicas": 1, "mine": True},
                               {"stage": 1, "layers": "layers 2-2 of 2", "replicas": 0, "mine": False}]}
TWO_STAGES_SERVED = {"stages": [{"stage": 0, "layers": "layers 1-1 of 2", "replicas": 2, "mine": True},
                                {"stage": 1, "layers": "layers 2-2 of 2", "replicas": 2, "mine": False}]}
STATUS = {"state": "contributing", "stage": 0, "num_stages": 2, "layers": "layers 1-1 of 2", "peers": 0}


def _stats(tokens: float, microbatches: float = 0, **extra) -> dict:
    return {"tokens_generated": tokens, "microbatches_trained": microbatches, "tokens_per_s": 12.0, **extra}


def _joined(mode: str = "lan", swarm: dict = TWO_STAGES_SERVED, now: float = 100.0) -> RunState:
    run = RunState(mode)
    run.start(mode)
    run.process_started()
    run.node_event_state("connecting", "looking for a coordinator on the local network")
    run.node_event_state("loading", "loading layers 1-1 of 2")
    run.node_event_state("contributing", "serving layers 1-1 of 2")
    run.node_status(STATUS)
    run.node_swarm(swarm, now)
    return run


def test_a_fresh_window_offers_start_and_shows_no_run_figures():
    view = RunState("lan").view()
    assert (view.phase, view.button, view.button_enabled, view.running) == ("ready", "start", True, False)
    assert view.headline == "Not contributing" and view.color == "idle"
    assert (view.peers, view.stage, view.staleness, view.summary) == ("–", "–", "–", "")


def test_start_then_connecting_is_never_green():
    run = RunState("lan")
    run.start("lan")
    assert run.view().phase == "starting" and run.view().button == "pause" and run.view().color == "busy"
    run.process_started()
    run.node_event_state("connecting", "looking for a coordinator on the local network")
    view = run.view()
    assert view.phase == "connecting" and view.color != "good"
    assert view.detail == "Looking for a coordinator on the local network"


def test_alone_on_the_lan_waits_for_stage_2_and_offers_the_local_demo():
    run = _joined("lan", TWO_STAGES_ALONE)
    run.node_stats(_stats(0), 105.0)
    run.node_stats(_stats(0), 110.0)
    view = run.view()
    assert view.phase == "waiting_for_peers" and view.color == "warn"
    assert view.headline == "Waiting for a computer to serve stage 2 — none found on your network"
    assert view.action == DEMO_ACTION
    assert run.working_s == 0.0 and view.summary == ""
    assert view.peers == "0"


def test_the_demo_offers_no_demo_action_and_words_its_own_wait():
    run = _joined("demo", TWO_STAGES_ALONE)
    view = run.view()
    assert view.phase == "waiting_for_peers" and view.action is None
    assert "demo's helper nodes" in view.headline


def test_a_served_pipeline_without_work_is_connected_not_contributing():
    run = _joined("coordinator")
    run.node_stats(_stats(0), 105.0)
    view = run.view()
    assert view.phase == "waiting_for_work" and view.color == "busy"
    assert view.headline == "Connected, waiting for work"


def test_green_only_while_counters_rise_and_time_accrues_only_then():
    run = _joined("lan")
    run.node_stats(_stats(0), 100.0)
    run.node_stats(_stats(40), 105.0)
    assert run.view().phase == "contributing" and run.view().color == "good"
    assert run.working_s == pytest.approx(5.0)
    run.node_stats(_stats(40, 0), 110.0)  # nothing rose: this interval does not count
    assert run.working_s == pytest.approx(5.0)
    run.node_stats(_stats(40, 3), 115.0)  # training counts as work too
    assert run.working_s == pytest.approx(10.0)
    run.tick(115.0 + WORK_RECENT_S + 1)
    assert run.view().phase == "waiting_for_work"
    assert "of work this run" in run.view().summary


def test_a_stage_losing_its_last_replica_turns_the_green_off():
    run = _joined("lan")
    run.node_stats(_stats(0), 100.0)
    run.node_stats(_stats(10), 105.0)
    assert run.view().phase == "contributing"
    run.node_swarm(TWO_STAGES_ALONE, 106.0)
    assert run.view().phase == "waiting_for_peers"


def test_peers_layers_and_staleness_come_from_the_events_and_agree_with_the_pipeline():
    run = _joined("lan")
    run.node_stats(_stats(5, staleness_mean=None), 101.0)
    view = run.view()
    assert view.peers == "3"  # 2 + 2 replicas, one of them this computer
    assert view.stage == "layers 1-1 of 2  (stage 1 of 2)"
    assert view.staleness == "–"
    run.node_swarm({**TWO_STAGES_SERVED, "staleness_mean": 4.0}, 102.0)
    assert run.view().staleness == "4.0 versions behind"
    assert view.detail.count("layers 1-1 of 2") == 1 and "layers" not in view.summary


def test_pause_stops_and_shows_paused_with_start():
    run = _joined("lan")
    run.pause()
    view = run.view()
    assert view.phase == "stopping" and not view.button_enabled
    run.node_event_state("stopping", "leaving the swarm")
    run.process_stopped()
    view = run.view()
    assert (view.phase, view.headline, view.button, view.running) == ("paused", "Paused", "start", False)
    assert view.peers == "–" and view.stage == "–"


def test_pause_before_anything_runs_is_ignored():
    run = RunState("lan")
    run.pause()
    assert run.view().phase == "ready"


def test_restart_says_restarting_until_the_new_process_is_up_and_shows_the_new_mode():
    run = _joined("lan")
    run.set_settings_mode("demo")  # saved, not applied: the running node keeps its swarm
    assert run.view().swarm_words == "Local network"
    run.restart("demo")
    view = run.view()
    assert view.phase == "restarting" and view.headline == "Restarting" and view.button == "pause"
    run.node_event_state("stopping", "leaving the swarm")
    run.process_stopped()  # the old process ended; the new one is on its way
    assert run.view().phase == "restarting"
    run.process_started()
    assert run.view().phase == "starting" and run.view().swarm_words == "Local demo swarm"


def test_schedule_hold_is_waiting_not_paused_and_release_reconnects():
    run = _joined("lan")
    run.node_stats(_stats(0), 100.0)
    run.node_stats(_stats(9), 105.0)
    run.hold("Waiting for AC power: this computer runs on battery.")
    run.node_event_state("paused", "paused: not taking work")
    view = run.view()
    assert view.phase == "schedule_hold" and view.headline == "Waiting" and "battery" in view.detail
    assert view.button == "pause"
    run.release()
    assert run.view().phase == "connecting"
    run.node_event_state("contributing", "serving layers 1-1 of 2")
    assert run.view().phase == "waiting_for_work"  # green again only with fresh work
    run.node_stats(_stats(20), 110.0)
    assert run.view().phase == "contributing"


def test_a_crash_needs_attention_and_offers_start():
    run = _joined("lan")
    run.failed("The node stopped unexpectedly. See the message above.")
    view = run.view()
    assert (view.phase, view.color, view.button, view.running) == ("error", "bad", "start", False)
    assert view.detail.startswith("The node stopped unexpectedly")
    run.start("lan")
    assert run.view().phase == "starting" and run.view().detail == "Launching the node…"


def test_the_node_reporting_an_error_state_needs_attention():
    run = _joined("lan")
    run.node_event_state("error", "could not load the stage")
    assert run.view().phase == "error" and run.view().detail == "could not load the stage"


def test_events_after_the_process_ended_do_not_revive_the_run():
    run = _joined("lan")
    run.pause()
    run.process_stopped()
    run.node_event_state("contributing", "late line")
    run.node_stats(_stats(99), 200.0)
    assert run.view().phase == "paused"


def test_every_phase_has_words_and_only_contributing_is_green():
    run = RunState("lan")
    for phase in PHASES:
        run.phase = phase
        view = run.view()
        assert view.headline
        assert (view.color == "good") == (phase == "contributing")
