"""Typed wire messages: the base structs, one decoder per message family, the NaN/Inf rule.

Every message that crosses a process boundary (coordinator <-> node JSON, node <->
node msgpack headers, signalling JSON, GUI <-> node control lines) is a frozen
``msgspec.Struct`` subclass of :class:`WireMessage` (tagged: the ``"type"`` key
names the struct) or, nested inside one, of :class:`WireRecord`. Bounds live in the
field types (``Annotated[int, msgspec.Meta(ge=0, le=...)]``), unknown keys are
refused, and decoding bytes or text into the tagged union validates everything in
one C pass. A failure raises :class:`~engine.net.errors.ProtocolViolation` whose
message names the offending path (``"gen_done: Expected `int` <= 16777216 - at
`$.tokens[0][3]`"``).

Why msgspec and not pydantic in strict mode: msgspec decodes and validates in one
C pass straight from the bytes, JSON *and msgpack* (the peer headers are msgpack;
pydantic has no msgpack decoder, so they would cost ``msgpack.unpackb`` plus a
validation pass), it is one small dependency with none of its own, and its Structs
are plain typed classes. Measured on the shared 2-core dev machine, a 512x16
``train_out`` (268 KB of JSON): ``polis bench transport --only validation`` gives
2.8-3.6 ms decoded and validated against 29-37 ms for the old ``json.loads`` +
hand-written schema walk (10.4-10.6x) and 3.5-4.5 ms for ``json.loads`` alone
(``polis bench transport --quick --json`` alone on the machine: 1.27 vs 17.3 ms,
13.6x, ``json.loads`` 2.68 ms); an
equivalent pydantic 2.14 model (strict, extra="forbid", allow_inf_nan=False) took
4.6 ms with ``model_validate_json`` against 3.4 ms for msgspec in the same ad-hoc run.

The NaN/Inf rule, in one place: msgspec's JSON decoder refuses ``NaN``/``Infinity``
literals and out-of-range numbers (``1e999``) for every float, and a bounded float
(``ge``/``le``) refuses NaN and +-inf from any source, but an *unbounded* ``float``
decoded from msgpack (or converted from a dict) lets them through. So every float
on the wire must be bounded: :class:`MessageSet` walks its message types when it is
built (at import) and raises ``TypeError`` naming any unbounded float field, so a
new message with a bare ``float`` cannot be written. Fields typed ``Any`` (tensor
headers, model configs, weight-delta headers) are validated by their own decoders
(``engine.net.tensor_codec``, ...), not here.

Encoding: msgspec's JSON encoder writes NaN as ``null`` (which every receiver then
refuses, as a bounded float): senders must not put non-finite values in messages.

It knows nothing about sockets, sessions or what any message means.
"""

from __future__ import annotations

from typing import Annotated, Any, Generic, TypeVar, get_args

import msgspec

from engine.net.errors import ProtocolViolation

__all__ = ["WireMessage", "WireRecord", "MessageSet", "encode_json", "encode_msgpack", "to_dict",
           "FLOAT_MAX", "Finite", "unbounded_float_fields"]

#: Largest finite float64; ``Finite`` is the widest float a message may carry.
FLOAT_MAX = 1.7976931348623157e308

#: Any finite float (NaN and +-inf refused from every source).
Finite = Annotated[float, msgspec.Meta(ge=-FLOAT_MAX, le=FLOAT_MAX)]


class WireMessage(msgspec.Struct, frozen=True, forbid_unknown_fields=True, tag_field="type",
                  kw_only=True, omit_defaults=True):
    """Base of every top-level message: its ``type`` key is the subclass's ``tag``.

    ``omit_defaults``: optional fields equal to their default are not written, so the
    bytes keep the shape the hand-written senders produced (optional keys absent).
    """


class WireRecord(msgspec.Struct, frozen=True, forbid_unknown_fields=True, kw_only=True,
                 omit_defaults=True):
    """Base of a map nested inside a message (no ``type`` key)."""


M = TypeVar("M")


def _members(union: Any) -> tuple[type, ...]:
    args = get_args(union)
    return args if args else (union,)


def _unbounded_floats(tp: msgspec.inspect.Type, path: str, seen: set[type]) -> list[str]:
    """Paths of float fields with no lower or no upper bound, recursively."""
    mi = msgspec.inspect
    if isinstance(tp, mi.FloatType):
        bounded = (tp.ge is not None or tp.gt is not None) and (tp.le is not None or tp.lt is not None)
        return [] if bounded else [path]
    if isinstance(tp, (mi.StructType, mi.DataclassType)):
        if tp.cls in seen:
            return []
        seen.add(tp.cls)
        out: list[str] = []
        for f in tp.fields:
            out += _unbounded_floats(f.type, f"{tp.cls.__name__}.{f.name}", seen)
        return out
    if isinstance(tp, (mi.ListType, mi.TupleType, mi.SetType, mi.FrozenSetType, mi.VarTupleType)):
        items = tp.item_types if isinstance(tp, mi.TupleType) else (tp.item_type,)
        return [p for item in items for p in _unbounded_floats(item, f"{path}[]", seen)]
    if isinstance(tp, mi.DictType):
        return _unbounded_floats(tp.value_type, f"{path}{{}}", seen)
    if isinstance(tp, mi.UnionType):
        return [p for t in tp.types for p in _unbounded_floats(t, path, seen)]
    if isinstance(tp, mi.Metadata):
        return _unbounded_floats(tp.type, path, seen)
    return []


def unbounded_float_fields(message_type: Any) -> list[str]:
    """Every float field reachable from ``message_type`` that lacks a lower or upper bound."""
    return _unbounded_floats(msgspec.inspect.type_info(message_type), "$", set())


def _violation(family: str, exc: Exception) -> ProtocolViolation:
    return ProtocolViolation(f"{family}: {str(exc)[:300]}")


class MessageSet(Generic[M]):
    """One family of messages (a tagged union of :class:`WireMessage` types) and its decoders.

    ``max_size`` caps what :meth:`decode_json` / :meth:`decode_msgpack` read, in
    characters for text and bytes for bytes (the transports cap first; this is the
    second fence). Building a set refuses message
    types with unbounded float fields (see the module docstring).
    """

    def __init__(self, family: str, union: Any, *, max_size: int) -> None:
        members = _members(union)
        for cls in members:
            if not (isinstance(cls, type) and issubclass(cls, WireMessage)):
                raise TypeError(f"{family}: {cls!r} is not a WireMessage")
        unbounded = unbounded_float_fields(union)
        if unbounded:
            raise TypeError(f"{family}: unbounded float fields would let NaN/inf through: {unbounded}")
        self.family = family
        self.union = union
        self.max_size = max_size
        self.types: dict[str, type] = {}
        for cls in members:
            info = msgspec.inspect.type_info(cls)
            assert isinstance(info, msgspec.inspect.StructType) and isinstance(info.tag, str)
            self.types[info.tag] = cls
        self._json = msgspec.json.Decoder(union)
        self._msgpack = msgspec.msgpack.Decoder(union)

    def __repr__(self) -> str:
        return f"MessageSet({self.family!r}, types={self.names()})"

    def __contains__(self, name: object) -> bool:
        return name in self.types

    def names(self) -> list[str]:
        return sorted(self.types)

    def _check_size(self, size: int) -> None:
        if size > self.max_size:
            raise ProtocolViolation(f"{self.family}: message of {size} characters/bytes exceeds {self.max_size}")

    def decode_json(self, text: str | bytes | bytearray | memoryview) -> M:
        """Decode and validate one untrusted JSON message (raises ProtocolViolation)."""
        if not isinstance(text, (str, bytes, bytearray, memoryview)):
            raise ProtocolViolation(f"{self.family}: expected a JSON text message, got {type(text).__name__}")
        self._check_size(len(text))
        try:
            return self._json.decode(text)
        except (msgspec.ValidationError, msgspec.DecodeError, RecursionError) as exc:
            raise _violation(self.family, exc) from None

    def decode_msgpack(self, raw: bytes | bytearray | memoryview) -> M:
        """Decode and validate one untrusted msgpack message (raises ProtocolViolation)."""
        if not isinstance(raw, (bytes, bytearray, memoryview)):
            raise ProtocolViolation(f"{self.family}: expected msgpack bytes, got {type(raw).__name__}")
        self._check_size(len(raw))
        try:
            return self._msgpack.decode(raw)
        except (msgspec.ValidationError, msgspec.DecodeError, RecursionError) as exc:
            raise _violation(self.family, exc) from None

    def convert(self, value: Any) -> M:
        """Validate an already-decoded map (e.g. a msgpack header from framing) into its struct."""
        if isinstance(value, WireMessage):
            if type(value) not in self.types.values():
                raise ProtocolViolation(f"{self.family}: {type(value).__name__} is not one of this family")
            return value  # type: ignore[return-value]
        if not isinstance(value, dict):
            raise ProtocolViolation(f"{self.family}: expected a map, got {type(value).__name__}")
        try:
            return msgspec.convert(value, self.union, strict=True)
        except (msgspec.ValidationError, RecursionError) as exc:
            raise _violation(self.family, exc) from None


def encode_json(message: msgspec.Struct) -> str:
    """A message as compact JSON text (websocket ``send_str`` wants ``str``)."""
    return msgspec.json.encode(message).decode("utf-8")


def encode_msgpack(message: msgspec.Struct) -> bytes:
    """A message as msgpack bytes (the same bytes ``msgpack.packb`` writes for its dict)."""
    return msgspec.msgpack.encode(message)


def to_dict(message: msgspec.Struct) -> dict[str, Any]:
    """A message as plain builtins (dicts, lists, str, int, float, bool, None; bytes stay bytes)."""
    return msgspec.to_builtins(message, builtin_types=(bytes, bytearray, memoryview))

