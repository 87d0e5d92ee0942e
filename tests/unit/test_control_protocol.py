import json

import pytest

from engine.control_protocol import (ProtocolError, encode_command, encode_event, parse_command,
                                     parse_event, validate_limits)


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
