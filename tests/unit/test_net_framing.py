"""Framing: exact round trips, and every hostile frame refused under bounded memory."""

import random

import msgpack
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from engine.net.errors import ProtocolViolation
from engine.net.framing import (
    FIRST,
    MAGIC,
    PREFIX,
    VERSION,
    FrameLimits,
    Reassembler,
    frame_count,
    iter_frames,
    pack_header,
    unpack_header,
)
from tests.support.frame_fuzz import BAD_HEADERS, HOSTILE_KINDS, hostile_frame, mutate, valid_frames

SMALL = FrameLimits(max_frame_bytes=4096, max_payload_bytes=1 << 20, max_partial_messages=3,
                    max_buffered_bytes=256 * 1024)


def _roundtrip(header, payload, frame_bytes, limits=None):
    frames = list(iter_frames(5, header, payload, frame_bytes))
    assert len(frames) == frame_count(len(pack_header(header)), memoryview(payload).nbytes, frame_bytes)
    assert all(len(f) <= frame_bytes for f in frames)
    reassembler = Reassembler(limits or FrameLimits(max_frame_bytes=frame_bytes))
    results = [reassembler.feed(f) for f in frames]
    assert all(r is None for r in results[:-1])
    assert reassembler.partial_messages == 0 and reassembler.buffered_bytes == 0
    return results[-1], len(frames)


@pytest.mark.parametrize("size", [0, 1, 4096 - 28 - 20, 4096 - 28 - 19, 4096 * 3, 100_000])
def test_messages_round_trip_exactly_at_frame_boundaries(size):
    payload = random.Random(size).randbytes(size)
    (header, got), _ = _roundtrip({"type": "blob", "n": size}, payload, 4096)
    assert header == {"type": "blob", "n": size} and got == payload


_HEADER_VALUES = st.one_of(st.integers(-2**63, 2**63 - 1), st.text(max_size=20), st.binary(max_size=20),
                           st.floats(allow_nan=False), st.lists(st.integers(-2**63, 2**63 - 1), max_size=5))


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(header=st.dictionaries(st.text(max_size=8), _HEADER_VALUES, max_size=6),
       payload=st.binary(max_size=8_000), frame_bytes=st.integers(200, 5000))
def test_any_header_and_payload_survive_framing(header, payload, frame_bytes):
    header = {**header, "type": "t"}
    (got_header, got_payload), _ = _roundtrip(header, payload, frame_bytes)
    assert got_header == header and got_payload == payload


def test_numpy_buffers_are_framed_without_conversion():
    import numpy as np

    array = np.arange(3 * 5000, dtype=np.float32).reshape(3, 5000)
    (_, got), count = _roundtrip({"type": "tensor"}, array.data, 4096)
    assert count > 1
    assert np.array_equal(np.frombuffer(got, np.float32).reshape(3, 5000), array)


def test_interleaved_messages_reassemble_independently():
    r = Reassembler(SMALL)
    a = list(iter_frames(1, {"type": "a"}, b"a" * 10_000, 4096))
    b = list(iter_frames(2, {"type": "b"}, b"b" * 9_000, 4096))
    out = []
    for fa, fb in zip(a, b):
        out += [r.feed(fa), r.feed(fb)]
    done = [m for m in out if m is not None]
    assert sorted((h["type"], len(p)) for h, p in done) == [("a", 10_000), ("b", 9_000)]


@pytest.mark.parametrize("kind", HOSTILE_KINDS)
def test_every_hostile_kind_is_refused_and_the_reassembler_stays_usable(kind):
    r = Reassembler(SMALL)
    rng = random.Random(kind)
    for _ in range(20):
        with pytest.raises(ProtocolViolation):
            r.feed(hostile_frame(rng, SMALL, kind))
    assert r.partial_messages == 0 and r.buffered_bytes == 0
    (header, payload), _ = _roundtrip({"type": "ok"}, b"x" * 9000, 4096, SMALL)
    assert header["type"] == "ok"


@pytest.mark.parametrize("raw", BAD_HEADERS)
def test_bad_msgpack_headers_are_refused(raw):
    with pytest.raises(ProtocolViolation):
        unpack_header(raw, SMALL)


def test_partial_message_count_is_capped():
    r = Reassembler(SMALL)
    for msg_id in range(SMALL.max_partial_messages):
        assert r.feed(next(iter_frames(msg_id, {"type": "p"}, b"z" * 9000, 4096))) is None
    with pytest.raises(ProtocolViolation, match="partial messages in flight"):
        r.feed(next(iter_frames(99, {"type": "p"}, b"z" * 9000, 4096)))
    assert r.partial_messages == SMALL.max_partial_messages


def test_buffered_bytes_across_partials_are_capped():
    limits = FrameLimits(max_frame_bytes=4096, max_partial_messages=100, max_buffered_bytes=10_000)
    r = Reassembler(limits)
    with pytest.raises(ProtocolViolation, match="exceed 10000 bytes"):
        for msg_id in range(10):
            r.feed(next(iter_frames(msg_id, {"type": "p"}, b"z" * 20_000, 4096)))
    assert r.buffered_bytes <= 10_000


def test_declared_payload_over_the_cap_is_refused_before_buffering():
    r = Reassembler(SMALL)
    frames = iter_frames(1, {"type": "big"}, b"q" * (SMALL.max_payload_bytes + 1), 4096)
    with pytest.raises(ProtocolViolation, match="exceeds"):
        r.feed(next(frames))
    assert r.buffered_bytes == 0


def test_out_of_order_duplicate_and_recounted_frames_drop_the_partial():
    frames = list(iter_frames(3, {"type": "p"}, b"k" * 20_000, 4096))
    r = Reassembler(SMALL)
    r.feed(frames[0])
    with pytest.raises(ProtocolViolation, match="expected 1"):
        r.feed(frames[2])
    assert r.partial_messages == 0 and r.buffered_bytes == 0
    r.feed(frames[0])
    with pytest.raises(ProtocolViolation, match="started twice"):
        r.feed(frames[0])
    r.feed(frames[0])
    _, _, _, msg_id, index, count = PREFIX.unpack_from(frames[1])
    recounted = PREFIX.pack(MAGIC, VERSION, 0, msg_id, index, count + 1) + frames[1][PREFIX.size:]
    with pytest.raises(ProtocolViolation, match="changed its frame count"):
        r.feed(recounted)
    assert r.partial_messages == 0


def test_last_frame_short_of_the_declared_size_is_refused():
    frames = list(iter_frames(3, {"type": "p"}, b"k" * 9000, 4096))
    r = Reassembler(SMALL)
    for f in frames[:-1]:
        r.feed(f)
    with pytest.raises(ProtocolViolation):
        r.feed(frames[-1][:-5])
    assert r.buffered_bytes == 0


def test_a_frame_over_the_size_cap_is_refused():
    header = msgpack.packb({"type": "x"})
    frame = PREFIX.pack(MAGIC, VERSION, 0, 1, 0, 1) + FIRST.pack(len(header), 5000) + header + b"a" * 5000
    with pytest.raises(ProtocolViolation, match="exceeds the 4096-byte cap"):
        Reassembler(SMALL).feed(frame)


def test_text_frames_are_refused():
    with pytest.raises(ProtocolViolation, match="not binary"):
        Reassembler(SMALL).feed("hello")


@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(st.lists(st.binary(max_size=300), max_size=30))
def test_random_bytes_never_crash_the_decoder_or_grow_memory(frames):
    r = Reassembler(SMALL)
    for frame in frames:
        try:
            r.feed(frame)
        except ProtocolViolation:
            pass
        assert r.partial_messages <= SMALL.max_partial_messages
        assert r.buffered_bytes <= SMALL.max_buffered_bytes


@settings(max_examples=200, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(st.integers(0, 2**32 - 1))
def test_mutated_valid_frames_never_crash_the_decoder_or_grow_memory(seed):
    rng = random.Random(seed)
    r = Reassembler(SMALL)
    violations = 0
    for _ in range(4):
        for frame in valid_frames(rng, 2048):
            if rng.random() < 0.5:
                frame = mutate(rng, frame)
            try:
                result = r.feed(frame)
            except ProtocolViolation:
                violations += 1
                continue
            if result is not None:
                assert isinstance(result[0], dict) and isinstance(result[0]["type"], str)
                assert isinstance(result[1], bytes)
            assert r.partial_messages <= SMALL.max_partial_messages
            assert r.buffered_bytes <= SMALL.max_buffered_bytes
