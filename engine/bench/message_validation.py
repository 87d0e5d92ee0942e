"""How long decoding + validating the largest wire messages takes: typed structs vs the old path.

Part of ``polis bench transport`` (``--only validation`` runs just this, in seconds).
For each message type it times, on the same bytes in the same run:

* ``after_ms``: the product path now: one msgspec pass from bytes/text to a typed,
  validated struct (``engine.swarm.messages``, ``engine.control_protocol``);
* ``before_ms``: the hand-written path it replaced (``json.loads`` or
  ``msgpack.unpackb``, then a Python walk over a Schema), kept frozen in
  :mod:`engine.bench.legacy_validation`;
* ``parse_only_ms``: ``json.loads`` / ``msgpack.unpackb`` alone (no validation at all).

The messages: a ``train_out`` of 512 rows x 16 tokens (the largest coordinator
message), a ``gen_done`` of one default generation job (prompts_per_job x group_size
= 128 rows, 8 tokens), a peer ``act`` header (msgpack, with its tensor header) and a
control ``stats`` event. Each figure is the median over rounds of the mean per call.
Both paths must accept every message (checked first). Nothing here prints.
"""

from __future__ import annotations

import json
import random
import statistics
import time
from typing import Any, Callable

import msgpack

from engine import control_protocol
from engine.bench import legacy_validation as legacy
from engine.swarm import messages

_PEER = "a3f9c2d17b6e4058"


def _train_out(rows: int, tokens: int, rng: random.Random) -> dict[str, Any]:
    return {"type": "train_out", "step": 41, "mb": 3, "route": [_PEER, _PEER[::-1]],
            "targets": [[rng.randrange(40) for _ in range(tokens)] for _ in range(rows)],
            "mask": [[rng.random() < 0.9 for _ in range(tokens)] for _ in range(rows)],
            "behaviour": [[round(-3 * rng.random(), 6) for _ in range(tokens)] for _ in range(rows)],
            "advantages": [round(rng.uniform(-2, 2), 6) for _ in range(rows)], "normaliser": float(rows * tokens),
            "proximal": [[round(-3 * rng.random(), 6) for _ in range(tokens)] for _ in range(rows)]}


def _gen_done(rows: int, tokens: int, rng: random.Random) -> dict[str, Any]:
    return {"type": "gen_done", "job": "g-000123", "tokens": [[rng.randrange(40) for _ in range(tokens)]
                                                           for _ in range(rows)],
            "logprobs": [[round(-3 * rng.random(), 6) for _ in range(tokens)] for _ in range(rows)],
            "versions": [17, 17]}


def _act() -> dict[str, Any]:
    return {"type": "act", "kind": "gen", "job": "g-000123", "route": [_PEER, _PEER[::-1]], "hop": 1,
            "versions": [17], "tensor": {"v": 1, "dtype": "float32", "shape": [128, 1, 64],
                                         "encoding": "int8_rowwise", "params": {"col_scaled": True}},
            "step": 0, "mb": 0, "params": {"max_new_tokens": 8, "temperature": 0.7, "top_p": 1.0, "seed": 99,
                                          "stop_ids": [2]}}


def _stats_line() -> str:
    return control_protocol.encode_event(
        "stats", tokens_generated=123456, microbatches_trained=789, bytes_sent=98765432, bytes_received=87654321,
        uptime_s=3600.5, points=2023.6, policy_version=480, staleness_mean=None, tokens_per_s=412.3,
        compute_busy_fraction=0.87).strip()


def _time_ms(fn: Callable[[], Any], budget_s: float, rounds: int) -> float:
    fn()  # warm up (and prove it accepts the message)
    start = time.perf_counter()
    fn()
    once = max(time.perf_counter() - start, 1e-7)
    calls = max(3, int(budget_s / rounds / once))
    means = []
    for _ in range(rounds):
        start = time.perf_counter()
        for _ in range(calls):
            fn()
        means.append((time.perf_counter() - start) / calls * 1000.0)
    return statistics.median(means)


def message_validation(budget_s: float = 1.0, rounds: int = 5) -> dict[str, dict[str, Any]]:
    """Per message type: after_ms, before_ms, parse_only_ms, speedup (before / after), bytes."""
    rng = random.Random(0)
    train_out = json.dumps(_train_out(512, 16, rng))
    gen_done = json.dumps(_gen_done(128, 8, rng))
    act = msgpack.packb(_act(), use_bin_type=True)
    stats = _stats_line()
    cases: dict[str, tuple[Any, Callable[[], Any], Callable[[], Any], Callable[[], Any]]] = {
        "train_out_512x16": (train_out, lambda: messages.decode_from_coordinator(train_out),
                             lambda: legacy.COORDINATOR_TO_NODE.validate(json.loads(train_out)),
                             lambda: json.loads(train_out)),
        "gen_done_128x8": (gen_done, lambda: messages.decode_from_node(gen_done),
                           lambda: legacy.NODE_TO_COORDINATOR.validate(json.loads(gen_done)),
                           lambda: json.loads(gen_done)),
        "peer_act_header": (act, lambda: messages.decode_peer_header(act),
                            lambda: legacy.PEER_MESSAGES.validate(msgpack.unpackb(act, raw=False)),
                            lambda: msgpack.unpackb(act, raw=False)),
        "control_stats_event": (stats, lambda: control_protocol.decode_event(stats),
                                lambda: legacy.parse_event(stats), lambda: json.loads(stats)),
    }
    out: dict[str, dict[str, Any]] = {}
    for name, (raw, after, before, parse_only) in cases.items():
        per_path = budget_s / 3
        after_ms = _time_ms(after, per_path, rounds)
        before_ms = _time_ms(before, per_path, rounds)
        parse_ms = _time_ms(parse_only, per_path, rounds)
        out[name] = {"after_ms": after_ms, "before_ms": before_ms, "parse_only_ms": parse_ms,
                     "speedup": before_ms / after_ms, "bytes": len(raw)}
    return out


def format_table(figures: dict[str, dict[str, Any]]) -> str:
    lines = [f"{'message (decode + validate)':28s} {'bytes':>8s} {'typed ms':>9s} {'before ms':>10s} "
             f"{'parse ms':>9s} {'speedup':>8s}"]
    for name, row in figures.items():
        lines.append(f"{name:28s} {row['bytes']:8d} {row['after_ms']:9.4f} {row['before_ms']:10.4f} "
                     f"{row['parse_only_ms']:9.4f} {row['speedup']:7.1f}x")
    return "\n".join(lines)
