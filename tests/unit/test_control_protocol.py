import json

import pytest

from engine.control_protocol import (
    ProtocolError,
    encode_command,
    encode_event,
    parse_command,
    parse_event,
    validate_limits,
)


def test_commands_round_trip_with_validated_limits():
    line = encode_command("set_limits", limits={"upload_mbps": 5, "cpu_threads": 2, "memory_cap_gb": None})
    parsed = parse_command(line)
    assert parsed == {"cmd": "set_limits", "limits": {"upload_mbps": 5.0, "cpu_threads": 2, "memory_cap_gb": None}}


@pytest.mark.parametrize("line", [
    b"\xff\xfe", "not json", "[1,2]", '{"cmd": "format_disk"}', '{"cmd": "set_limits", "limits": {"upload_mbps": -1}}',
    '{"cmd": "set_limits", "limits": {"cpu_threads": 1.5}}', '{"cmd": "set_limits", "limits": {"nope": 1}}',
    '{"cmd": "set_limits", "limits": {"upload_mbps": true}}', "x" * (300 * 1024),
])
def test_bad_command_lines_raise_protocol_error(line):
    with pytest.raises(ProtocolError):
        parse_command(line)


def test_events_carry_a_timestamp_and_unknown_states_are_rejected():
    event = parse_event(encode_event("state", state="contributing", detail="serving layers 1-2 of 4"))
    assert event["state"] == "contributing" and event["t"] > 0
    with pytest.raises(ProtocolError):
        parse_event(json.dumps({"event": "state", "state": "dancing"}))
    with pytest.raises(ProtocolError):
        encode_event("explode")


def test_limits_reject_non_finite_values():
    with pytest.raises(ProtocolError):
        validate_limits({"download_mbps": float("nan")})


def test_unknown_fields_are_refused_in_commands_and_events():
    with pytest.raises(ProtocolError, match="unknown field"):
        parse_command('{"cmd": "start", "force": true}')
    with pytest.raises(ProtocolError, match="unknown field"):
        parse_event('{"event": "log", "t": 1.0, "level": "info", "message": "x", "color": "red"}')
    with pytest.raises(ProtocolError):
        encode_event("log", level="info", message="x", color="red")  # refused on the sending side too


def test_non_finite_numbers_are_refused_in_events_on_both_sides():
    with pytest.raises(ProtocolError):
        encode_event("stats", tokens_generated=1, microbatches_trained=0, bytes_sent=0, bytes_received=0,
                     uptime_s=1.0, points=0.0, policy_version=None, staleness_mean=None,
                     tokens_per_s=float("nan"))
    with pytest.raises(ProtocolError):
        parse_event('{"event": "stats", "t": 1.0, "tokens_generated": 1e999, "microbatches_trained": 0, '
                    '"bytes_sent": 0, "bytes_received": 0, "uptime_s": 1, "points": 0, "policy_version": null, '
                    '"staleness_mean": null, "tokens_per_s": 0}')


def test_event_maps_keep_the_numbers_as_sent():
    line = encode_event("stats", tokens_generated=37, microbatches_trained=1, bytes_sent=5, bytes_received=6,
                        uptime_s=1.5, points=0.5, policy_version=3, staleness_mean=None, tokens_per_s=2.5)
    event = parse_event(line)
    assert event["tokens_generated"] == 37 and isinstance(event["tokens_generated"], int)
