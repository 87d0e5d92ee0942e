"""Node stderr lines become readable log lines (app.log_lines)."""

from app.log_lines import classify


def test_a_log_line_loses_its_own_timestamp_and_keeps_level_and_source():
    line = classify("2026-12-03 08:50:01,123 WARNING engine.swarm.node: coordinator slow")
    assert (line.clock, line.level, line.message, line.detail) == ("08:50:01", "warning", "coordinator slow", False)
    assert line.source == "engine.swarm.node"


def test_library_chatter_and_engine_info_are_details():
    assert classify("2026-12-03 08:50:01,123 INFO aioice.ice: Connection(1) state FROZEN").detail
    assert classify("2026-12-03 08:50:01,123 WARNING aiortc.rtcdtlstransport: odd").detail
    assert classify("2026-12-03 08:50:01,123 INFO engine.swarm.node_jobs: step 3").detail


def test_link_events_are_worded_for_people():
    opened = classify("2026-12-03 08:50:01,123 INFO engine.net.peer_manager: link to abcdef0123456789 open")
    assert opened.message == "Connected to computer abcdef01… of the swarm." and not opened.detail
    local = classify("2026-12-03 08:50:02,000 INFO engine.net.peer_link: link to abcdef0123456789 closed (local)")
    assert local.detail and "normal" in local.message
    failed = classify("2026-12-03 08:50:03,000 INFO engine.net.peer_link: link to abcdef0123456789 closed (failed)")
    assert failed.level == "warning" and "reconnects by itself" in failed.message and not failed.detail
    debug = classify("2026-12-03 08:50:01,123 DEBUG engine.net.peer_link: link to abcdef0123456789 open (frames)")
    assert debug.detail


def test_plain_lines_repeat_events_the_window_shows_so_they_are_details():
    assert classify("polis node: no coordinator answered on the LAN; hosting one").detail
    assert classify('  File "x.py", line 3, in f').detail
    assert classify("Traceback (most recent call last):").level == "error"
