"""Polis message framing: (msgpack header, binary payload) <-> data-channel frames.

A *message* is a header (a msgpack map with a ``str`` ``"type"``) plus a binary
payload of any length. It travels as one or more *frames*, each small enough for
the remote's maximum data-channel message size (aiortc: 256 KiB)::

    every frame : magic b"\\xb7P" | version u8 | flags u8 | msg_id u32 | index u32 | count u32
    frame 0 adds: header_len u32 | payload_len u64 | header (msgpack) | first payload bytes
    frames 1..  : payload bytes (at least one byte each)

(all integers big-endian). :func:`iter_frames` cuts a message; :class:`Reassembler`
puts frames back together and treats every inbound byte as hostile: sizes, indices,
counts, the msgpack header (decoded with hard length limits, no extension types)
and the number and total size of partial messages are all checked *before* memory
is committed. A bad frame raises :class:`~engine.net.errors.ProtocolViolation`
with a reason and discards the partial message it belonged to.

Frames of one message must arrive in order on an ordered channel; messages may
interleave. Nothing here knows about channels, peers or strikes.
"""

from __future__ import annotations

import struct
from dataclasses import dataclass, field
from typing import Iterator

import msgpack

from engine.net.errors import ProtocolViolation
from engine.net.wire import WireMessage, encode_msgpack

MAGIC = b"\xb7P"
VERSION = 1
PREFIX = struct.Struct("!2sBBIII")
FIRST = struct.Struct("!IQ")
PREFIX_BYTES = PREFIX.size            # 16
FIRST_OVERHEAD_BYTES = PREFIX.size + FIRST.size  # 28
MAX_MSG_ID = 2**32 - 1
TYPE_MAX_CHARS = 64


@dataclass(frozen=True)
class FrameLimits:
    """Caps applied to every inbound frame and message (all sizes in bytes).

    max_frame_bytes: largest single frame accepted (the local max message size).
    max_header_bytes: largest msgpack header.
    max_payload_bytes: largest reassembled payload of one message.
    max_chunks_per_message: most frames one message may declare.
    max_partial_messages: most messages being reassembled at once (per channel).
    max_buffered_bytes: most bytes held by all partial messages together.
    max_str_len, max_bin_len, max_array_len, max_map_len: msgpack decoder limits
        inside a header.
    """

    max_frame_bytes: int = 256 * 1024
    max_header_bytes: int = 64 * 1024
    max_payload_bytes: int = 128 * 1024 * 1024
    max_chunks_per_message: int = 1 << 16
    max_partial_messages: int = 4
    max_buffered_bytes: int = 256 * 1024 * 1024
    max_str_len: int = 16 * 1024
    max_bin_len: int = 16 * 1024
    max_array_len: int = 4096
    max_map_len: int = 256

    def __post_init__(self) -> None:
        if self.max_frame_bytes <= FIRST_OVERHEAD_BYTES:
            raise ValueError(f"max_frame_bytes must exceed {FIRST_OVERHEAD_BYTES}")
        for name in ("max_header_bytes", "max_payload_bytes", "max_chunks_per_message",
                     "max_partial_messages", "max_buffered_bytes", "max_str_len", "max_bin_len",
                     "max_array_len", "max_map_len"):
            if getattr(self, name) < 1:
                raise ValueError(f"FrameLimits.{name} must be >= 1")


def _no_ext(code: int, data: bytes):
    raise ProtocolViolation(f"msgpack extension type {code} is not allowed in a header")


def pack_header(header: dict | WireMessage) -> bytes:
    """msgpack-encode a header (a typed message, or a map with a short ``str`` ``"type"``)."""
    if isinstance(header, WireMessage):
        return encode_msgpack(header)
    if not isinstance(header, dict):
        raise TypeError(f"a header must be a dict, not {type(header).__name__}")
    kind = header.get("type")
    if not isinstance(kind, str) or not 0 < len(kind) <= TYPE_MAX_CHARS:
        raise ValueError("a header needs a 'type' string of 1-64 characters")
    return msgpack.packb(header, use_bin_type=True)


def unpack_header(raw: bytes, limits: FrameLimits) -> dict:
    """Decode an untrusted header under ``limits`` (raises ProtocolViolation)."""
    try:
        header = msgpack.unpackb(
            raw, raw=False, use_list=True, strict_map_key=True, ext_hook=_no_ext,
            max_str_len=limits.max_str_len, max_bin_len=limits.max_bin_len,
            max_array_len=limits.max_array_len, max_map_len=limits.max_map_len, max_ext_len=0)
    except ProtocolViolation:
        raise
    except (ValueError, TypeError, msgpack.UnpackException, RecursionError, OverflowError) as exc:
        raise ProtocolViolation(f"header is not valid msgpack ({type(exc).__name__}: {str(exc)[:80]})") from exc
    if not isinstance(header, dict):
        raise ProtocolViolation(f"header is a {type(header).__name__}, not a map")
    for key in header:
        if not isinstance(key, str):
            raise ProtocolViolation("header has a non-string key")
    kind = header.get("type")
    if not isinstance(kind, str) or not 0 < len(kind) <= TYPE_MAX_CHARS:
        raise ProtocolViolation("header 'type' missing, not a string, or longer than 64 characters")
    return header


def frame_count(header_bytes: int, payload_bytes: int, max_frame_bytes: int) -> int:
    """How many frames :func:`iter_frames` makes for these sizes."""
    first = max_frame_bytes - FIRST_OVERHEAD_BYTES - header_bytes
    if first < 0:
        raise ValueError(f"header of {header_bytes} bytes does not fit a {max_frame_bytes}-byte frame")
    rest = max(0, payload_bytes - first)
    per = max_frame_bytes - PREFIX_BYTES
    return 1 + (rest + per - 1) // per


def iter_frames(msg_id: int, header: dict | bytes, payload: bytes | bytearray | memoryview = b"",
                max_frame_bytes: int = 256 * 1024) -> Iterator[bytes]:
    """Cut one message into frames of at most ``max_frame_bytes`` bytes (lazily).

    ``header`` is a dict (packed here) or already-packed msgpack bytes. ``payload``
    may be any C-contiguous buffer (a numpy array's ``.data`` works); it is read,
    not copied, until each frame is built.
    """
    if not 0 <= msg_id <= MAX_MSG_ID:
        raise ValueError("msg_id must fit in 32 bits")
    raw_header = header if isinstance(header, (bytes, bytearray)) else pack_header(header)
    view = memoryview(payload)
    if view.ndim != 1 or view.format != "B":
        view = view.cast("B")
    total = view.nbytes
    count = frame_count(len(raw_header), total, max_frame_bytes)
    first = min(total, max_frame_bytes - FIRST_OVERHEAD_BYTES - len(raw_header))
    yield b"".join((PREFIX.pack(MAGIC, VERSION, 0, msg_id, 0, count),
                    FIRST.pack(len(raw_header), total), raw_header, view[:first]))
    per = max_frame_bytes - PREFIX_BYTES
    pos = first
    for index in range(1, count):
        end = min(total, pos + per)
        yield b"".join((PREFIX.pack(MAGIC, VERSION, 0, msg_id, index, count), view[pos:end]))
        pos = end


@dataclass
class _Partial:
    header: dict
    payload_bytes: int
    count: int
    next_index: int
    received: int
    parts: list = field(default_factory=list)


class Reassembler:
    """Turns inbound frames back into ``(header, payload)`` messages, under caps.

    :meth:`feed` returns the completed message or ``None`` (more frames needed) and
    raises ProtocolViolation for a bad frame; the reassembler stays usable after.
    """

    def __init__(self, limits: FrameLimits | None = None) -> None:
        self.limits = limits or FrameLimits()
        self._partials: dict[int, _Partial] = {}
        self._buffered = 0

    @property
    def partial_messages(self) -> int:
        return len(self._partials)

    @property
    def buffered_bytes(self) -> int:
        return self._buffered

    def reset(self) -> None:
        self._partials.clear()
        self._buffered = 0

    def _drop(self, msg_id: int) -> None:
        partial = self._partials.pop(msg_id, None)
        if partial is not None:
            self._buffered -= partial.received

    def feed(self, frame: bytes) -> tuple[dict, bytes] | None:
        limits = self.limits
        if not isinstance(frame, (bytes, bytearray)):
            raise ProtocolViolation(f"frame is {type(frame).__name__}, not binary")
        n = len(frame)
        if n < PREFIX_BYTES:
            raise ProtocolViolation(f"frame of {n} bytes is shorter than the {PREFIX_BYTES}-byte prefix")
        if n > limits.max_frame_bytes:
            raise ProtocolViolation(f"frame of {n} bytes exceeds the {limits.max_frame_bytes}-byte cap")
        magic, version, flags, msg_id, index, count = PREFIX.unpack_from(frame, 0)
        if magic != MAGIC:
            raise ProtocolViolation("frame has a bad magic number")
        if version != VERSION:
            raise ProtocolViolation(f"frame version {version} is not supported (want {VERSION})")
        if flags != 0:
            raise ProtocolViolation(f"frame has unknown flags {flags:#x}")
        if not 1 <= count <= limits.max_chunks_per_message:
            self._drop(msg_id)
            raise ProtocolViolation(f"frame count {count} outside 1..{limits.max_chunks_per_message}")
        if index >= count:
            self._drop(msg_id)
            raise ProtocolViolation(f"frame index {index} >= count {count}")
        if index == 0:
            return self._first(frame, msg_id, count)
        return self._next(frame, msg_id, index, count)

    def _first(self, frame: bytes, msg_id: int, count: int) -> tuple[dict, bytes] | None:
        limits = self.limits
        if msg_id in self._partials:
            self._drop(msg_id)
            raise ProtocolViolation(f"message {msg_id} started twice")
        if len(frame) < FIRST_OVERHEAD_BYTES:
            raise ProtocolViolation("first frame too short for its header sizes")
        header_len, payload_len = FIRST.unpack_from(frame, PREFIX_BYTES)
        if header_len > limits.max_header_bytes:
            raise ProtocolViolation(f"header of {header_len} bytes exceeds the {limits.max_header_bytes}-byte cap")
        body_start = FIRST_OVERHEAD_BYTES + header_len
        if body_start > len(frame):
            raise ProtocolViolation("header length runs past the end of the frame")
        if payload_len > limits.max_payload_bytes:
            raise ProtocolViolation(
                f"payload of {payload_len} bytes exceeds the {limits.max_payload_bytes}-byte cap")
        body = len(frame) - body_start
        if body > payload_len:
            raise ProtocolViolation(f"first frame carries {body} bytes of a {payload_len}-byte payload")
        remaining = payload_len - body
        if count == 1 and remaining:
            raise ProtocolViolation(f"single-frame message carries {body} of {payload_len} payload bytes")
        if count - 1 > remaining:
            raise ProtocolViolation(f"{count - 1} more frames declared for {remaining} remaining bytes")
        if remaining > (count - 1) * (limits.max_frame_bytes - PREFIX_BYTES):
            raise ProtocolViolation(f"{remaining} bytes cannot fit in {count - 1} more frames")
        if count > 1:
            if len(self._partials) >= limits.max_partial_messages:
                raise ProtocolViolation(
                    f"more than {limits.max_partial_messages} partial messages in flight")
            if self._buffered + body > limits.max_buffered_bytes:
                raise ProtocolViolation(f"partial messages would exceed {limits.max_buffered_bytes} bytes")
        header = unpack_header(bytes(frame[FIRST_OVERHEAD_BYTES:body_start]), limits)
        if count == 1:
            return header, bytes(frame[body_start:])
        self._partials[msg_id] = _Partial(header, payload_len, count, 1, body,
                                          [memoryview(frame)[body_start:]])
        self._buffered += body
        return None

    def _next(self, frame: bytes, msg_id: int, index: int, count: int) -> tuple[dict, bytes] | None:
        partial = self._partials.get(msg_id)
        if partial is None:
            raise ProtocolViolation(f"frame {index} of unknown message {msg_id}")
        if count != partial.count:
            self._drop(msg_id)
            raise ProtocolViolation(f"message {msg_id} changed its frame count {partial.count} -> {count}")
        if index != partial.next_index:
            self._drop(msg_id)
            raise ProtocolViolation(f"message {msg_id}: frame {index} arrived, expected {partial.next_index}")
        body = len(frame) - PREFIX_BYTES
        if body == 0:
            self._drop(msg_id)
            raise ProtocolViolation(f"message {msg_id}: empty continuation frame")
        if partial.received + body > partial.payload_bytes:
            self._drop(msg_id)
            raise ProtocolViolation(f"message {msg_id}: frames exceed the declared {partial.payload_bytes} bytes")
        if self._buffered + body > self.limits.max_buffered_bytes:
            self._drop(msg_id)
            raise ProtocolViolation(f"partial messages would exceed {self.limits.max_buffered_bytes} bytes")
        partial.parts.append(memoryview(frame)[PREFIX_BYTES:])
        partial.received += body
        partial.next_index += 1
        self._buffered += body
        if index < count - 1:
            return None
        self._drop(msg_id)
        if partial.received != partial.payload_bytes:
            raise ProtocolViolation(f"message {msg_id}: {partial.received} of {partial.payload_bytes} bytes")
        return partial.header, b"".join(partial.parts)
