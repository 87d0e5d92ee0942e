"""Limits travel on the node's command line as one flag per LIMIT_FIELDS entry and come back validated."""

from __future__ import annotations

import argparse

import pytest

from engine.control_protocol import (
    LIMIT_FIELDS,
    ProtocolError,
    add_limit_arguments,
    limit_cli_flag,
    limits_from_args,
    limits_to_cli_args,
)


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser()
    add_limit_arguments(parser)
    return parser


def test_limits_round_trip_through_command_line_flags():
    limits = {"memory_cap_gb": 6.5, "cpu_threads": 3, "upload_mbps": 0.5, "gpu_fraction": None}
    parsed = limits_from_args(_parser().parse_args(limits_to_cli_args(limits)))
    assert parsed == {**{name: None for name in LIMIT_FIELDS}, **limits}


def test_unset_limits_add_no_flags_and_parse_as_no_limit():
    assert limits_to_cli_args({name: None for name in LIMIT_FIELDS}) == []
    assert set(limits_from_args(_parser().parse_args([])).values()) == {None}


def test_out_of_range_flags_are_refused():
    args = _parser().parse_args([limit_cli_flag("gpu_fraction"), "1.5"])
    with pytest.raises(ProtocolError, match="gpu_fraction"):
        limits_from_args(args)
    with pytest.raises(ProtocolError, match="unknown limit"):
        limit_cli_flag("warp_drive")
