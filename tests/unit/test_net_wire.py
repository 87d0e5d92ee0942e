"""What msgspec lets through for NaN/inf, and the one rule that closes the gap (engine.net.wire)."""

import math
from typing import Annotated, Union

import msgspec
import pytest

from engine.net.errors import ProtocolViolation
from engine.net.wire import Finite, MessageSet, WireMessage, WireRecord, unbounded_float_fields


class _Bounded(WireMessage, frozen=True, tag="bounded"):
    x: Annotated[float, msgspec.Meta(ge=-1e4, le=1e4)]


class _Wide(WireMessage, frozen=True, tag="wide"):
    x: Finite


class _Bare(msgspec.Struct):
    x: float


BOUNDED = MessageSet("test", Union[_Bounded, _Wide], max_size=1024)


@pytest.mark.parametrize("text", ['{"type":"bounded","x":NaN}', '{"type":"bounded","x":Infinity}',
                                  '{"type":"wide","x":-Infinity}', '{"type":"wide","x":1e999}',
                                  '{"type":"wide","x":-1e999}'])
def test_json_refuses_nan_and_inf_literals_and_overflowing_numbers(text):
    with pytest.raises(ProtocolViolation):
        BOUNDED.decode_json(text)


@pytest.mark.parametrize("value", [math.nan, math.inf, -math.inf])
@pytest.mark.parametrize("kind", ["bounded", "wide"])
def test_msgpack_and_maps_refuse_non_finite_floats_in_bounded_fields(kind, value):
    with pytest.raises(ProtocolViolation):
        BOUNDED.decode_msgpack(msgspec.msgpack.encode({"type": kind, "x": value}))
    with pytest.raises(ProtocolViolation):
        BOUNDED.convert({"type": kind, "x": value})


@pytest.mark.parametrize("value", [math.nan, math.inf])
def test_msgspec_itself_lets_non_finite_through_unbounded_floats_from_msgpack(value):
    # the gap the MessageSet rule exists for: a bare float accepts NaN/inf from msgpack and maps
    decoded = msgspec.msgpack.decode(msgspec.msgpack.encode({"x": value}), type=_Bare)
    assert not math.isfinite(decoded.x)
    assert not math.isfinite(msgspec.convert({"x": value}, _Bare).x)


def test_a_message_set_with_an_unbounded_float_field_cannot_be_built():
    class Loose(WireRecord):
        y: float

    class HasLoose(WireMessage, tag="has_loose"):
        inner: list[Loose]
        ok: Finite

    assert unbounded_float_fields(HasLoose) == ["Loose.y"]
    with pytest.raises(TypeError, match="Loose.y"):
        MessageSet("bad", HasLoose, max_size=1024)


def test_bounded_floats_still_accept_integers_and_finite_values():
    assert BOUNDED.decode_json('{"type":"bounded","x":3}').x == 3.0
    assert BOUNDED.decode_msgpack(msgspec.msgpack.encode({"type": "wide", "x": 1e300})).x == 1e300


def test_size_cap_is_checked_before_decoding():
    with pytest.raises(ProtocolViolation, match="exceeds"):
        BOUNDED.decode_json('{"type":"bounded","x":1' + "0" * 2000 + "}")


def test_non_maps_and_wrong_inputs_are_violations_not_crashes():
    for bad in ([1, 2], "x", None, 3):
        with pytest.raises(ProtocolViolation):
            BOUNDED.convert(bad)
    with pytest.raises(ProtocolViolation):
        BOUNDED.decode_json(b"\xff\xfe")
    with pytest.raises(ProtocolViolation):
        BOUNDED.decode_msgpack("not bytes")  # type: ignore[arg-type]
