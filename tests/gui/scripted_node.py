"""A scripted stand-in for ``polis node --control stdio``, used only by the GUI tests.

Speaks the real control protocol (``engine.control_protocol``): says hello, walks
through connecting -> loading -> contributing after ``start``, emits rising stats
and swarm events, obeys pause/start/status/set_limits/stop (and ``export`` with
``--demo``: a stand-in folder, then ``exported``), and echoes the limits
it received (on the command line and via ``set_limits``) in ``status`` events.
Its own options (before ``--control``) make it misbehave on purpose: crash when a
file appears, ignore ``stop``, write invalid and split lines, leak fake secrets to stderr.
It is a fake: it trains nothing and opens no sockets.
"""

from __future__ import annotations

import argparse
import math
import os
import queue
import sys
import threading
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from engine.control_protocol import (  # noqa: E402
    ProtocolError,
    add_limit_arguments,
    encode_event,
    limits_from_args,
    parse_command,
)

FAKE_PRIVATE_KEY = ("-----BEGIN PRIVATE KEY-----\nMC4CAQAwBQYDK2VwBCIEIFakeFakeFakeFakeFakeFakeFakeFakeFakeFake\n"
                    "-----END PRIVATE KEY-----")
FAKE_TOKEN = "tok_9f8e7d6c5b4a39281706f5e4d3c2b1a0"


def _emit(event: str, **fields) -> None:
    sys.stdout.write(encode_event(event, **fields))
    sys.stdout.flush()


def _curve(version: int, start: float, gain: float) -> float:
    """A made-up learning curve with a little deterministic wobble (for the charts only)."""
    return round(start + gain * (1 - math.exp(-version / 14)) + 0.02 * math.sin(version * 2.3), 4)


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="scripted_node")
    parser.add_argument("node", nargs="?", help="accepted for symmetry with `polis node`")
    parser.add_argument("--control", choices=["stdio"], required=True)
    swarm = parser.add_mutually_exclusive_group(required=True)
    swarm.add_argument("--lan", action="store_true")
    swarm.add_argument("--coordinator")
    swarm.add_argument("--demo", action="store_true")
    add_limit_arguments(parser)
    parser.add_argument("--tick-s", type=float, default=0.05)
    parser.add_argument("--crash-when-file", type=Path, default=None, help="exit 1 once this file exists")
    parser.add_argument("--ignore-stop", action="store_true")
    parser.add_argument("--garbage", action="store_true")
    parser.add_argument("--leak-secret", action="store_true")
    parser.add_argument("--silent", action="store_true", help="say hello, then nothing")
    parser.add_argument("--alone-unless-demo", action="store_true",
                        help="without --demo, no computer serves the other stages: no work, stage 2 empty")
    parser.add_argument("--chatter", action="store_true", help="write aioice chatter and link lines to stderr")
    return parser


def _read_commands(commands: "queue.Queue[dict | None]") -> None:
    for raw in sys.stdin.buffer:
        try:
            commands.put(parse_command(raw))
        except ProtocolError as exc:
            _emit("error", message=f"bad command: {exc}", hint="", fatal=False)
    commands.put(None)  # EOF


def main() -> int:
    args = _parser().parse_args()
    limits = limits_from_args(args)
    swarm = "demo" if args.demo else ("lan" if args.lan else args.coordinator)
    print(f"scripted node: swarm={swarm} limits={limits}", file=sys.stderr, flush=True)
    alone = args.alone_unless_demo and not args.demo
    if args.chatter:
        for line in ("2026-12-03 08:50:01,101 INFO aioice.ice: Connection(0) Check CandidatePair(...) State.FROZEN",
                     "2026-12-03 08:50:01,202 INFO engine.net.peer_manager: link to 3f9a1c2b7d8e9f00aa open",
                     "2026-12-03 08:50:01,303 INFO engine.net.peer_link: link to 3f9a1c2b7d8e9f00aa closed (local)"):
            print(line, file=sys.stderr, flush=True)
    if args.leak_secret:
        print(f"debug identity dump {FAKE_PRIVATE_KEY}", file=sys.stderr)
        print(f"debug coordinator auth token={FAKE_TOKEN}", file=sys.stderr, flush=True)
    _emit("hello", version="0.0-scripted", peer_id="p-1a2b3c4d", fingerprint="SHA256:ab12cd34ef56",
          key_storage="file", device="Scripted CPU (4 cores)", backend="torch-cpu", memory_gb=16.0)
    if args.garbage:
        sys.stdout.write("this is not json\n[1,2]\n{\"event\":\"nonsense\"}\n")
        line = encode_event("log", level="info", message="split line arrived whole")
        sys.stdout.write(line[:10])
        sys.stdout.flush()
        time.sleep(0.05)
        sys.stdout.write(line[10:])
        sys.stdout.flush()
    _emit("state", state="idle", detail="waiting for start")
    commands: queue.Queue[dict | None] = queue.Queue()
    threading.Thread(target=_read_commands, args=(commands,), name="stdin-reader", daemon=True).start()

    state, ticks, version = "idle", 0, 1
    stats = dict(tokens_generated=0, microbatches_trained=0, bytes_sent=0, bytes_received=0, uptime_s=0.0,
                 points=0.0)

    def status() -> None:
        _emit("status", state=state, coordinator="http://127.0.0.1:8700", stage=1, num_stages=4,
              layers="layers 3–4 of 8", role="trainer", peers=5, policy_version=version, limits=limits)

    while True:
        deadline = time.monotonic() + args.tick_s
        while True:
            try:
                command = commands.get(timeout=max(0.0, deadline - time.monotonic()))
            except queue.Empty:
                break
            if command is None:
                return 0
            cmd = command["cmd"]
            if args.silent and cmd != "stop":
                continue
            if cmd == "start" and state in ("idle", "paused"):
                _emit("state", state="connecting", detail="Looking for the swarm's coordinator")
                _emit("state", state="loading", detail="Loading layers 3–4 of 8")
                state = "contributing"
                _emit("state", state=state, detail="Generating rollouts and training your stage")
                status()
            elif cmd == "pause" and state == "contributing":
                state = "paused"
                _emit("state", state=state, detail="paused by request")
            elif cmd == "set_limits":
                limits = {**limits, **command["limits"]}
                _emit("log", level="info", message=f"limits now {limits}")
                status()
            elif cmd == "status":
                status()
            elif cmd == "export" and not args.demo:
                _emit("error", message="Export model works for the local demo this node runs.", hint="", fatal=False)
            elif cmd == "export":  # a stand-in folder: the real node runs `polis export` (engine.swarm.demo_export)
                out = Path(command["out"])
                out.mkdir(parents=True)
                (out / "README.md").write_text("---\nbase_model: scripted\n---\n# scripted export\n")
                _emit("exported", path=str(out), version=version, model="scripted")
            elif cmd == "stop" and not args.ignore_stop:
                _emit("state", state="stopping", detail="leaving the swarm")
                return 0
        if args.crash_when_file is not None and args.crash_when_file.exists():
            print("Traceback (most recent call last):\nRuntimeError: scripted node: simulated failure",
                  file=sys.stderr, flush=True)
            return 1
        if state == "contributing" and alone:
            ticks += 1
            _emit("stats", **stats, policy_version=0, staleness_mean=None, tokens_per_s=0.0)
            if ticks % 5 == 1:
                _emit("swarm", policy_version=0, eval=[], reward=[],
                      stages=[{"stage": s, "layers": f"layers {2 * s + 1}–{2 * s + 2} of 8",
                               "replicas": 1 if s == 1 else 0, "mine": s == 1} for s in range(4)])
        elif state == "contributing":
            ticks += 1
            stats["tokens_generated"] += 37
            stats["microbatches_trained"] += 1 if ticks % 2 == 0 else 0
            stats["bytes_sent"] += 12_345
            stats["bytes_received"] += 23_456
            stats["uptime_s"] = round(stats["uptime_s"] + args.tick_s, 3)
            stats["points"] = round(stats["points"] + 0.5, 3)
            version = 1 + ticks // 5
            rate = 37 / args.tick_s * (1.0 + 0.12 * math.sin(ticks / 9.0) + 0.05 * math.sin(ticks * 1.7))
            _emit("stats", **stats, policy_version=version, staleness_mean=0.5, tokens_per_s=round(rate, 1))
            if ticks % 5 == 0:
                _emit("swarm", policy_version=version,
                      eval=[{"version": v, "accuracy": _curve(v, 0.18, 0.62)} for v in range(1, version + 1)],
                      reward=[{"version": v, "reward": _curve(v, 0.31, 0.55)} for v in range(1, version + 1)],
                      stages=[{"stage": s, "layers": f"layers {2 * s + 1}–{2 * s + 2} of 8",
                               "replicas": 1 + (s + 1) % 3, "mine": s == 1} for s in range(4)],
                      model="smollm2-135m", model_parameters=134_515_008, task="reasoning_gym:chain_sum",
                      samples=[{"prompt": f"What is {v} + 4?", "answer": f"{v} + 4 = {v + 4}. <answer>{v + 4}</answer>",
                                "reward": 1.05, "version": v} for v in range(max(1, version - 3), version + 1)])


if __name__ == "__main__":
    code = main()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)  # not sys.exit: the daemon stdin reader would hold stdin's lock at shutdown
