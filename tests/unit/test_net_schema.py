"""The declarative header validator rejects every malformed field with a named path."""

import math

import pytest

from engine.net.errors import ProtocolViolation
from engine.net.schema import Bool, Bytes, Float, Int, List, Map, Schema, SchemaRegistry, Str

SHAPE = Schema("shape_info", {"dims": List(Int(1, 1 << 20), min_len=1, max_len=4)})
ACTIVATION = Schema("activation", {
    "micro_batch": Int(0, 1000),
    "scale": Float(0.0, 10.0),
    "last": Bool(),
    "name": Str(1, 8),
    "blob": Bytes(0, 4, required=False),
    "info": Map(SHAPE),
    "note": Str(max_len=10, required=False, nullable=True),
})
REGISTRY = SchemaRegistry([ACTIVATION])


def _valid() -> dict:
    return {"type": "activation", "micro_batch": 3, "scale": 0.5, "last": False, "name": "x",
            "info": {"dims": [2, 3]}}


def test_valid_header_passes_and_is_returned():
    header = _valid()
    assert REGISTRY.validate(header) is header


@pytest.mark.parametrize("mutation, fragment", [
    (lambda h: h.pop("micro_batch"), "missing key 'micro_batch'"),
    (lambda h: h.update(micro_batch=True), "expected int"),
    (lambda h: h.update(micro_batch=1001), "> maximum 1000"),
    (lambda h: h.update(micro_batch=-1), "< minimum 0"),
    (lambda h: h.update(scale=math.nan), "non-finite"),
    (lambda h: h.update(scale="1"), "expected number"),
    (lambda h: h.update(last=1), "expected bool"),
    (lambda h: h.update(name="toolongname"), "> maximum 8"),
    (lambda h: h.update(name=""), "< minimum 1"),
    (lambda h: h.update(blob=b"12345"), "5 bytes > maximum 4"),
    (lambda h: h.update(info={"dims": []}), "activation.info.dims: 0 items"),
    (lambda h: h.update(info={"dims": [1, 0]}), "activation.info.dims[1]: 0 < minimum 1"),
    (lambda h: h.update(info={"dims": [1], "x": 1}), "unexpected key 'x'"),
    (lambda h: h.update(extra=1), "unexpected key 'extra'"),
    (lambda h: h.update(note=None) or h.update(name=None), "null where a value is required"),
    (lambda h: h.update(type="unknown"), "unknown message type"),
    (lambda h: h.pop("type"), "'type' missing"),
])
def test_each_malformed_field_is_rejected_with_its_path(mutation, fragment):
    header = _valid()
    mutation(header)
    with pytest.raises(ProtocolViolation) as info:
        REGISTRY.validate(header)
    assert fragment in str(info.value)


def test_optional_and_nullable_fields_may_be_absent_or_null():
    header = _valid()
    header["note"] = None
    REGISTRY.validate(header)


def test_non_map_and_non_string_keys_are_rejected():
    with pytest.raises(ProtocolViolation):
        REGISTRY.validate([1, 2])
    header = _valid()
    header[3] = "x"
    with pytest.raises(ProtocolViolation, match="non-string key"):
        REGISTRY.validate(header)


def test_maps_allowing_extras_still_cap_their_key_count():
    loose = Schema("loose", {}, allow_extra=True, max_keys=3)
    loose.validate({"a": 1, "b": 2})
    with pytest.raises(ProtocolViolation, match="keys > maximum 3"):
        loose.validate({str(i): i for i in range(4)})


def test_registering_a_schema_twice_is_an_error():
    with pytest.raises(ValueError):
        SchemaRegistry([Schema("a", {}), Schema("a", {})])
