"""The hand-written wire validator and message schemas as they were, frozen: the "before" of a bench.

Used only by ``polis bench transport`` (:mod:`engine.bench.message_validation`) to
measure, in the same run, how long the old path (``json.loads`` / ``msgpack.unpackb``
then a Python walk over a :class:`Schema`) took against the typed msgspec structs
that replaced it (``engine.swarm.messages``, ``engine.control_protocol``). Nothing in
the product imports this module; do not extend it. Only the schemas of the benched
messages are kept (``train_out``, ``gen_done``, the peer ``act`` header, and the old
control ``parse_event``), copied unchanged from the code before the switch.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass, field
from typing import Any, Iterable, Mapping

from engine.net.errors import ProtocolViolation

#: How many characters of an offending value are quoted in an error message.
_QUOTE_CHARS = 40


def _quote(value: Any) -> str:
    text = repr(value)
    return text if len(text) <= _QUOTE_CHARS else text[:_QUOTE_CHARS] + "..."


@dataclass(frozen=True)
class Field:
    """Base class of every field rule. ``required=False`` makes the key optional;
    ``nullable=True`` accepts ``None`` as the value."""

    required: bool = True
    nullable: bool = False

    def check(self, value: Any, path: str) -> None:  # pragma: no cover - overridden
        raise NotImplementedError

    def validate(self, value: Any, path: str) -> None:
        if value is None:
            if self.nullable:
                return
            raise ProtocolViolation(f"{path}: null where a value is required")
        self.check(value, path)


@dataclass(frozen=True)
class Any_(Field):
    """Any value the decoder produced (its size is still capped by the decoder)."""

    def check(self, value: Any, path: str) -> None:
        return None


@dataclass(frozen=True)
class Int(Field):
    """An integer in ``[min_value, max_value]`` (``bool`` is rejected)."""

    min_value: int = -(2**63)
    max_value: int = 2**63 - 1
    required: bool = True
    nullable: bool = False

    def __init__(self, min_value: int = -(2**63), max_value: int = 2**63 - 1, *,
                 required: bool = True, nullable: bool = False) -> None:
        if min_value > max_value:
            raise ValueError(f"Int: min_value {min_value} > max_value {max_value}")
        object.__setattr__(self, "min_value", min_value)
        object.__setattr__(self, "max_value", max_value)
        object.__setattr__(self, "required", required)
        object.__setattr__(self, "nullable", nullable)

    def check(self, value: Any, path: str) -> None:
        if isinstance(value, bool) or not isinstance(value, int):
            raise ProtocolViolation(f"{path}: expected int, got {type(value).__name__}")
        if value < self.min_value:
            raise ProtocolViolation(f"{path}: {value} < minimum {self.min_value}")
        if value > self.max_value:
            raise ProtocolViolation(f"{path}: {value} > maximum {self.max_value}")


@dataclass(frozen=True)
class Float(Field):
    """A finite real number in ``[min_value, max_value]``; ints are accepted too."""

    min_value: float = -math.inf
    max_value: float = math.inf
    allow_non_finite: bool = False
    required: bool = True
    nullable: bool = False

    def __init__(self, min_value: float = -math.inf, max_value: float = math.inf, *,
                 allow_non_finite: bool = False, required: bool = True, nullable: bool = False) -> None:
        object.__setattr__(self, "min_value", min_value)
        object.__setattr__(self, "max_value", max_value)
        object.__setattr__(self, "allow_non_finite", allow_non_finite)
        object.__setattr__(self, "required", required)
        object.__setattr__(self, "nullable", nullable)

    def check(self, value: Any, path: str) -> None:
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            raise ProtocolViolation(f"{path}: expected number, got {type(value).__name__}")
        if isinstance(value, float) and not math.isfinite(value):
            if not self.allow_non_finite:
                raise ProtocolViolation(f"{path}: non-finite number {value}")
            return
        if value < self.min_value or value > self.max_value:
            raise ProtocolViolation(f"{path}: {value} outside [{self.min_value}, {self.max_value}]")


@dataclass(frozen=True)
class Bool(Field):
    """``True`` or ``False`` (not 0/1)."""

    def check(self, value: Any, path: str) -> None:
        if not isinstance(value, bool):
            raise ProtocolViolation(f"{path}: expected bool, got {type(value).__name__}")


def _check_len(value: Any, path: str, min_len: int, max_len: int, unit: str) -> None:
    n = len(value)
    if n < min_len:
        raise ProtocolViolation(f"{path}: {n} {unit} < minimum {min_len}")
    if n > max_len:
        raise ProtocolViolation(f"{path}: {n} {unit} > maximum {max_len}")


@dataclass(frozen=True)
class Str(Field):
    """A text string of ``min_len..max_len`` characters, optionally from ``choices``."""

    min_len: int = 0
    max_len: int = 256
    choices: frozenset[str] | None = None
    required: bool = True
    nullable: bool = False

    def __init__(self, min_len: int = 0, max_len: int = 256, *, choices: Iterable[str] | None = None,
                 required: bool = True, nullable: bool = False) -> None:
        object.__setattr__(self, "min_len", min_len)
        object.__setattr__(self, "max_len", max_len)
        object.__setattr__(self, "choices", None if choices is None else frozenset(choices))
        object.__setattr__(self, "required", required)
        object.__setattr__(self, "nullable", nullable)

    def check(self, value: Any, path: str) -> None:
        if not isinstance(value, str):
            raise ProtocolViolation(f"{path}: expected str, got {type(value).__name__}")
        _check_len(value, path, self.min_len, self.max_len, "characters")
        if self.choices is not None and value not in self.choices:
            raise ProtocolViolation(f"{path}: {_quote(value)} is not one of {sorted(self.choices)}")


@dataclass(frozen=True)
class List(Field):
    """A list (or tuple) of ``min_len..max_len`` items, each checked by ``item``."""

    item: Field = field(default_factory=Any_)
    min_len: int = 0
    max_len: int = 64
    required: bool = True
    nullable: bool = False

    def __init__(self, item: Field | None = None, *, min_len: int = 0, max_len: int = 64,
                 required: bool = True, nullable: bool = False) -> None:
        object.__setattr__(self, "item", item if item is not None else Any_())
        object.__setattr__(self, "min_len", min_len)
        object.__setattr__(self, "max_len", max_len)
        object.__setattr__(self, "required", required)
        object.__setattr__(self, "nullable", nullable)

    def check(self, value: Any, path: str) -> None:
        if not isinstance(value, (list, tuple)):
            raise ProtocolViolation(f"{path}: expected list, got {type(value).__name__}")
        _check_len(value, path, self.min_len, self.max_len, "items")
        for i, item in enumerate(value):
            self.item.validate(item, f"{path}[{i}]")


@dataclass(frozen=True)
class Map(Field):
    """A nested map checked by its own :class:`Schema`."""

    schema: "Schema | None" = None
    required: bool = True
    nullable: bool = False

    def __init__(self, schema: "Schema", *, required: bool = True, nullable: bool = False) -> None:
        object.__setattr__(self, "schema", schema)
        object.__setattr__(self, "required", required)
        object.__setattr__(self, "nullable", nullable)

    def check(self, value: Any, path: str) -> None:
        assert self.schema is not None
        self.schema.validate(value, path=path)


class Schema:
    """The rules for one kind of map: which keys, which values.

    ``allow_extra=False`` (the default) rejects unknown keys, so a peer cannot
    smuggle fields that a later version might trust. ``max_keys`` caps maps that
    allow extras.
    """

    def __init__(self, name: str, fields: Mapping[str, Field], *, allow_extra: bool = False,
                 max_keys: int = 64) -> None:
        self.name = name
        self.fields = dict(fields)
        self.allow_extra = allow_extra
        self.max_keys = max(max_keys, len(self.fields))

    def __repr__(self) -> str:
        return f"Schema({self.name!r}, keys={sorted(self.fields)})"

    def validate(self, value: Any, *, path: str | None = None) -> dict:
        """Return ``value`` (a dict) if it satisfies every rule, else raise ProtocolViolation."""
        path = path or self.name
        if not isinstance(value, dict):
            raise ProtocolViolation(f"{path}: expected map, got {type(value).__name__}")
        if len(value) > self.max_keys:
            raise ProtocolViolation(f"{path}: {len(value)} keys > maximum {self.max_keys}")
        for key in value:
            if not isinstance(key, str):
                raise ProtocolViolation(f"{path}: non-string key {_quote(key)}")
            if key not in self.fields and not self.allow_extra:
                raise ProtocolViolation(f"{path}: unexpected key {_quote(key)}")
        for key, rule in self.fields.items():
            if key not in value:
                if rule.required:
                    raise ProtocolViolation(f"{path}: missing key {key!r}")
                continue
            rule.validate(value[key], f"{path}.{key}")
        return value


class SchemaRegistry:
    """Schemas keyed by the header's ``"type"`` string; validates by dispatch.

    An unknown ``type`` is a violation (the sender speaks something we do not).
    Each schema's own ``type`` field is implied: it need not be declared.
    """

    def __init__(self, schemas: Iterable[Schema] = (), *, type_key: str = "type") -> None:
        self.type_key = type_key
        self._schemas: dict[str, Schema] = {}
        for schema in schemas:
            self.add(schema)

    def add(self, schema: Schema) -> None:
        if schema.name in self._schemas:
            raise ValueError(f"schema {schema.name!r} registered twice")
        if self.type_key not in schema.fields:
            schema.fields[self.type_key] = Str(1, 64, choices={schema.name})
        self._schemas[schema.name] = schema

    def __contains__(self, name: object) -> bool:
        return name in self._schemas

    def names(self) -> list[str]:
        return sorted(self._schemas)

    def validate(self, header: Any) -> dict:
        if not isinstance(header, dict):
            raise ProtocolViolation(f"header: expected map, got {type(header).__name__}")
        kind = header.get(self.type_key)
        if not isinstance(kind, str):
            raise ProtocolViolation(f"header: {self.type_key!r} missing or not a string")
        schema = self._schemas.get(kind)
        if schema is None:
            raise ProtocolViolation(f"header: unknown message type {_quote(kind)}")
        return schema.validate(header)


# ------------------------------------------------------- the old schemas of the benched messages
MAX_ROWS = 4096
MAX_TOKENS = 4096
MAX_STAGES = 256
_PEER_ID = Str(4, 64)
_JOB = Str(1, 64)
_TOKEN = Int(0, 1 << 24)
_VERSION = Int(0, 1 << 40)
_STEP = Int(0, 1 << 40)
_ROUTE = List(_PEER_ID, min_len=1, max_len=MAX_STAGES)
_TOKEN_ROWS = List(List(_TOKEN, min_len=1, max_len=MAX_TOKENS), min_len=1, max_len=MAX_ROWS)
_FLOAT_ROWS = List(List(Float(-1e4, 1e4), max_len=MAX_TOKENS), min_len=1, max_len=MAX_ROWS)
_FLOAT_ROWS_OPT = List(List(Float(-1e4, 1e4), max_len=MAX_TOKENS), min_len=1, max_len=MAX_ROWS, required=False)
_BOOL_ROWS = List(List(Bool(), max_len=MAX_TOKENS), min_len=1, max_len=MAX_ROWS)
# eos_id became stop_ids (a short list) after the baseline was frozen; mirrored so both paths read one header
_GEN_PARAMS = Schema("gen_params", {"max_new_tokens": Int(1, MAX_TOKENS), "temperature": Float(0, 100),
                                    "top_p": Float(1e-6, 1), "seed": Int(0, 2**63 - 1),
                                    "stop_ids": List(_TOKEN, min_len=1, max_len=16)})

COORDINATOR_TO_NODE = SchemaRegistry([
    Schema("train_out", {"step": _STEP, "mb": Int(0, 1 << 20), "route": _ROUTE, "targets": _TOKEN_ROWS,
                         "mask": _BOOL_ROWS, "behaviour": _FLOAT_ROWS, "advantages": List(Float(-1e4, 1e4),
                                                                                           max_len=MAX_ROWS),
                         "normaliser": Float(1e-9, 1e12), "prox": Bool(required=False),
                         "proximal": _FLOAT_ROWS_OPT}),
])
NODE_TO_COORDINATOR = SchemaRegistry([
    Schema("gen_done", {"job": _JOB, "tokens": _TOKEN_ROWS, "logprobs": _FLOAT_ROWS,
                        "versions": List(_VERSION, min_len=1, max_len=MAX_STAGES)}),
])
PEER_MESSAGES = SchemaRegistry([
    Schema("act", {"kind": Str(choices={"gen", "train", "prox"}), "job": _JOB, "route": _ROUTE,
                   "hop": Int(1, MAX_STAGES), "versions": List(_VERSION, min_len=1, max_len=MAX_STAGES),
                   "tensor": Any_(), "step": _STEP, "mb": Int(0, 1 << 20), "params": Map(_GEN_PARAMS, required=False)}),
])

_EVENTS = ("hello", "state", "status", "stats", "swarm", "log", "error")
_STATES = ("idle", "connecting", "loading", "contributing", "paused", "stopping", "error")


def parse_event(line: str) -> dict[str, Any]:
    """The old control-protocol event check: json.loads plus a few key checks."""
    message = json.loads(line)
    if not isinstance(message, dict):
        raise ProtocolViolation("a line must hold a JSON object")
    event = message.get("event")
    if event not in _EVENTS:
        raise ProtocolViolation(f"unknown event {event!r}")
    if event in ("state", "status") and message.get("state") not in _STATES:
        raise ProtocolViolation(f"unknown state {message.get('state')!r}")
    if event == "error" and not isinstance(message.get("message"), str):
        raise ProtocolViolation("error event without a message")
    return message
