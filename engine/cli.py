"""The ``polis`` command line: dispatches subcommands to their own modules.

Each subcommand lives in a module exposing ``add_arguments(parser)`` and
``run(args) -> int``; modules are imported only when their command runs, so
``polis --help`` stays fast and never imports torch, mlx or Qt. ``polis`` with no
subcommand opens the desktop app.
"""

from __future__ import annotations

import argparse
import importlib
import logging
import sys
from typing import Sequence

from engine import __version__, extras

#: command -> (module, one-line help)
COMMANDS: dict[str, tuple[str, str]] = {
    "gui": ("app.main", "open the desktop app (the default when no command is given)"),
    "node": ("engine.swarm.node_cli", "run a node that contributes one pipeline stage"),
    "coordinator": ("engine.swarm.coordinator_cli", "run a coordinator (signalling, tasks, ledger)"),
    "demo": ("engine.swarm.demo", "run the main job on this machine with the embedded defaults"),
    "import": ("engine.model.importers.command",
               "make a Polis base from an HF directory, a .gguf file or smollm2-135m"),
    "check-model": ("engine.model.sharded_check", "check sharded generation across backends against transformers"),
    "train": ("engine.swarm.train_command",
              "train the swarm's run recipe in one process (the comparison for polis demo at equal samples)"),
    "eval": ("engine.rl.eval_command", "held-out greedy accuracy of an HF checkpoint on digit or reasoning-gym tasks"),
    "export": ("engine.model.export.command", "write a run's policy version as an HF checkpoint with a model card"),
    "make-base": ("engine.rl.make_base", "rebuild the shipped base checkpoint (supervised warm-up)"),
    "wan-relay": ("engine.swarm.wan_swarm", "emulate internet links for a swarm on this machine (started by "
                                             "`polis demo --wan`)"),
}

#: ``polis bench NAME`` -> (module, one-line help)
BENCHES: dict[str, tuple[str, str]] = {
    "shard": ("engine.bench.shard", "sharded model: accuracy vs transformers, load memory, speed"),
    "rl": ("engine.bench.rl", "RL: sync vs stale/corrected vs controls, from the base checkpoint"),
    "transport": ("engine.bench.transport", "WebRTC transport: goodput, latency, codecs, WAN"),
    "swarm": ("engine.bench.swarm", "swarm over WebRTC vs in-process"),
    "act": ("engine.bench.act", "stage-boundary activation encodings: accuracy, learning, bytes"),
    "wan": ("engine.bench.wan", "the demo swarm on loopback vs over emulated internet links"),
    "weights": ("engine.bench.weight_stream", "weight deltas to inference replicas: bytes and drift"),
    "comm": ("engine.bench.comm", "communication schemes: replica-update bytes per sample vs accuracy"),
    "trust": ("engine.bench.trust", "poisoned rollouts and replica shares vs a clean run: accuracy, steps lost"),
}

#: module -> packages it needs beyond what contributing needs (the ``real-model`` extra); the
#: installed desktop app (installer/polis.spec) leaves these out too, so the command says what to
#: install instead of failing deep inside. (``polis import`` checks its own needs per source.)
REQUIRES: dict[str, tuple[str, ...]] = {
    "engine.model.sharded_check": ("torch", "transformers"),
    "engine.bench.shard": ("torch", "transformers"),
}


def _load(module_name: str):
    try:
        return importlib.import_module(module_name)
    except ModuleNotFoundError as exc:
        if exc.name and module_name.startswith(exc.name):
            return None
        raise


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="polis",
        description="Polis: contribute compute to decentralised RL post-training of a language model.",
    )
    parser.add_argument("--version", action="version", version=f"polis {__version__}")
    parser.add_argument("-v", "--verbose", action="count", default=0, help="more log output (-vv: debug)")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    for name, (_, help_text) in COMMANDS.items():
        sub.add_parser(name, help=help_text, add_help=False)
    bench = sub.add_parser("bench", help="measure speed, memory and accuracy (see `polis bench -h`)")
    bench_sub = bench.add_subparsers(dest="bench", metavar="BENCH", required=True)
    for name, (_, help_text) in BENCHES.items():
        bench_sub.add_parser(name, help=help_text, add_help=False)
    return parser


def _run_module(module_name: str, prog: str, argv: Sequence[str], help_text: str) -> int:
    absent = extras.missing(REQUIRES.get(module_name, ()))
    if absent:
        print(f"polis: {extras.MissingExtra(f'{prog!r}', absent)}", file=sys.stderr)
        return 2
    module = _load(module_name)
    if module is None:
        print(f"polis: '{prog}' is not available in this build.", file=sys.stderr)
        return 2
    parser = argparse.ArgumentParser(prog=prog, description=help_text)
    module.add_arguments(parser)
    args = parser.parse_args(list(argv))
    return int(module.run(args) or 0)


def configure_logging(verbosity: int) -> None:
    level = logging.WARNING - 10 * verbosity
    logging.basicConfig(level=max(level, logging.DEBUG),
                        format="%(asctime)s %(levelname)s %(name)s: %(message)s", stream=sys.stderr)


def main(argv: Sequence[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    parser = build_parser()
    # Split global options from the subcommand and its own arguments.
    idx = next((i for i, a in enumerate(argv) if not a.startswith("-")), len(argv))
    global_args = parser.parse_args(argv[:idx]) if idx < len(argv) else parser.parse_args(argv)
    configure_logging(global_args.verbose)
    if idx >= len(argv):
        return _run_module(COMMANDS["gui"][0], "polis", [], COMMANDS["gui"][1])
    command, rest = argv[idx], argv[idx + 1:]
    if command == "bench":
        if not rest or rest[0].startswith("-"):
            parser.parse_args(argv[: idx + 1] + rest)  # prints bench help / error
            return 2
        name, rest = rest[0], rest[1:]
        if name not in BENCHES:
            parser.error(f"unknown bench '{name}' (choose from {', '.join(BENCHES)})")
        module_name, help_text = BENCHES[name]
        return _run_module(module_name, f"polis bench {name}", rest, help_text)
    if command not in COMMANDS:
        parser.error(f"unknown command '{command}' (choose from {', '.join([*COMMANDS, 'bench'])})")
    module_name, help_text = COMMANDS[command]
    return _run_module(module_name, f"polis {command}", rest, help_text)


if __name__ == "__main__":
    sys.exit(main())
