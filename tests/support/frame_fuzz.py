"""Malformed frames for robustness tests (test support; never on a product path).

:func:`hostile_frame` builds one frame that *every* :class:`~engine.net.framing.Reassembler`
must reject, whatever it holds (it never reuses a message id below 2**31, which
honest senders start from 0 and would take years to reach), chosen from
:data:`HOSTILE_KINDS` by a seeded ``random.Random``. :func:`mutate` damages a
valid frame at random (the result may, rarely, still be valid).

It knows the frame layout only; it sends nothing.
"""

from __future__ import annotations

import random
import struct

import msgpack

from engine.net.framing import FIRST, MAGIC, PREFIX, VERSION, FrameLimits, iter_frames

#: msgpack headers a receiver must refuse (not a map, no/bad "type", bombs, extensions)
BAD_HEADERS: tuple[bytes, ...] = (
    b"",                                            # empty
    b"\x91" * 5000,                                 # deeply nested arrays
    b"\xdd\xff\xff\xff\xff",                        # array32 claiming 4 G items
    b"\xdf\xff\xff\xff\xff",                        # map32 claiming 4 G pairs
    b"\xdb\x7f\xff\xff\xff",                        # str32 claiming 2 GiB
    b"\xc6\x7f\xff\xff\xff",                        # bin32 claiming 2 GiB
    b"\xd4\x01\x00",                                # fixext1
    msgpack.packb(7),                               # not a map
    msgpack.packb({"kind": "x"}),                   # no "type"
    msgpack.packb({"type": 5}),                     # "type" not a string
    msgpack.packb({"type": ""}),                    # empty "type"
    msgpack.packb({"type": "t" * 65}),              # "type" too long
    msgpack.packb({1: "x", "type": "ping"}),        # non-string key
    msgpack.packb({"type": "ping", "x": "a" * 100})[:-3],  # truncated
    msgpack.packb({"type": "ping"}) + b"\x00",      # trailing bytes
)

HOSTILE_KINDS: tuple[str, ...] = (
    "short", "bad_magic", "bad_version", "bad_flags", "zero_count", "index_past_count",
    "orphan_continuation", "header_too_long", "header_overrun", "payload_too_big",
    "bad_header", "body_exceeds_payload", "too_many_frames_for_bytes",
)


def _hostile_id(rng: random.Random) -> int:
    return rng.randrange(2**31, 2**32)


def _first(msg_id: int, count: int, header: bytes, payload_len: int, body: bytes,
           header_len: int | None = None, index: int = 0) -> bytes:
    return (PREFIX.pack(MAGIC, VERSION, 0, msg_id, index, count)
            + FIRST.pack(len(header) if header_len is None else header_len, payload_len) + header + body)


def hostile_frame(rng: random.Random, limits: FrameLimits | None = None, kind: str | None = None) -> bytes:
    """One frame that breaks the protocol in the way named by ``kind`` (random if None)."""
    limits = limits or FrameLimits()
    kind = kind or rng.choice(HOSTILE_KINDS)
    mid = _hostile_id(rng)
    good_header = msgpack.packb({"type": "ping", "id": 1})
    if kind == "short":
        return bytes(rng.getrandbits(8) for _ in range(rng.randrange(0, PREFIX.size)))
    if kind == "bad_magic":
        frame = bytearray(_first(mid, 1, good_header, 0, b""))
        frame[0] ^= rng.randrange(1, 256)
        return bytes(frame)
    if kind == "bad_version":
        return PREFIX.pack(MAGIC, rng.choice([0, 2, 255]), 0, mid, 0, 1) + FIRST.pack(len(good_header), 0) + good_header
    if kind == "bad_flags":
        return PREFIX.pack(MAGIC, VERSION, rng.randrange(1, 256), mid, 0, 1) + FIRST.pack(len(good_header), 0) \
            + good_header
    if kind == "zero_count":
        return _first(mid, 0, good_header, 0, b"")
    if kind == "index_past_count":
        count = rng.randrange(1, 100)
        return PREFIX.pack(MAGIC, VERSION, 0, mid, count + rng.randrange(0, 5), count) + b"x" * rng.randrange(1, 64)
    if kind == "orphan_continuation":
        count = rng.randrange(2, 1000)
        return PREFIX.pack(MAGIC, VERSION, 0, mid, rng.randrange(1, count), count) + b"y" * rng.randrange(0, 512)
    if kind == "header_too_long":
        return _first(mid, 1, good_header, 0, b"", header_len=limits.max_header_bytes + rng.randrange(1, 1 << 20))
    if kind == "header_overrun":
        return _first(mid, 1, good_header, 0, b"", header_len=len(good_header) + rng.randrange(1, 1000))
    if kind == "payload_too_big":
        return _first(mid, rng.randrange(1, 100), good_header,
                      limits.max_payload_bytes + rng.randrange(1, 1 << 40), b"z" * 16)
    if kind == "bad_header":
        header = rng.choice(BAD_HEADERS)
        return _first(mid, 1, header, 0, b"")
    if kind == "body_exceeds_payload":
        body = b"w" * rng.randrange(2, 512)
        return _first(mid, 1, good_header, rng.randrange(0, len(body)), body)
    if kind == "too_many_frames_for_bytes":
        remaining = rng.randrange(0, 50)
        return _first(mid, remaining + rng.randrange(2, 100), good_header, remaining, b"")
    raise ValueError(f"unknown hostile frame kind {kind!r}")


def valid_frames(rng: random.Random, max_frame_bytes: int = 4096) -> list[bytes]:
    """The frames of one random, valid message (for mutation)."""
    header = {"type": rng.choice(["ping", "tensor", "blob"]), "id": rng.randrange(0, 1 << 30)}
    payload = bytes(rng.getrandbits(8) for _ in range(rng.randrange(0, 3 * max_frame_bytes)))
    return list(iter_frames(rng.randrange(0, 1 << 20), header, payload, max_frame_bytes))


def mutate(rng: random.Random, frame: bytes) -> bytes:
    """Damage a frame: flip, overwrite, truncate, extend or splice random bytes."""
    data = bytearray(frame)
    for _ in range(rng.randrange(1, 4)):
        op = rng.randrange(5)
        if op == 0 and data:
            data[rng.randrange(len(data))] ^= 1 << rng.randrange(8)
        elif op == 1 and data:
            pos = rng.randrange(len(data))
            data[pos:pos + 4] = struct.pack("!I", rng.getrandbits(32))
        elif op == 2 and data:
            del data[rng.randrange(len(data)):]
        elif op == 3:
            data += bytes(rng.getrandbits(8) for _ in range(rng.randrange(1, 64)))
        else:
            pos = rng.randrange(len(data) + 1)
            data[pos:pos] = bytes(rng.getrandbits(8) for _ in range(rng.randrange(1, 16)))
    return bytes(data)
