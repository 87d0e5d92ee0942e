"""``polis eval CHECKPOINT --task NAME``: held-out greedy accuracy of any HF checkpoint, as a table or JSON.

The task comes from flags (``--task``, repeatable; ``--options`` for a reasoning-gym
dataset's config, ``--min-digits`` / ``--max-digits`` for digit tasks) or from a run
(``--run-dir``: the task its coordinator trained on, so the held-out split is the run's).
The figures are computed by ``engine.rl.checkpoint_eval``; this module only parses
arguments and prints. ``--json`` prints one object: ``{"checkpoint", "results": [...]}``,
each result a ``TaskEval`` as a dict (strict and content-only accuracy for chat tasks).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import logging
import sys
from pathlib import Path
from typing import Any, Sequence

from engine.rl.tasks import TaskConfig, is_chat_task_name

log = logging.getLogger(__name__)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("checkpoint", help="an HF checkpoint directory (config.json, safetensors, tokenizer.json)")
    parser.add_argument("--task", action="append", default=None,
                        help="task to evaluate: reversal, sorting, addition, reasoning_gym:<dataset> "
                             "(repeat for several; default: the run's task with --run-dir, else reversal)")
    parser.add_argument("--options", default=None,
                        help='a reasoning-gym dataset\'s config as JSON, e.g. \'{"min_terms": 2, "max_terms": 2}\'')
    parser.add_argument("--min-digits", type=int, default=None, help="digit tasks: shortest digit string")
    parser.add_argument("--max-digits", type=int, default=None, help="digit tasks: longest digit string")
    parser.add_argument("--eval-size", type=int, default=None,
                        help="size of the held-out split (it defines the split; default: the task's own)")
    parser.add_argument("--run-dir", default=None,
                        help="take the task (and its held-out split) from this run's coordinator.db")
    parser.add_argument("--n", type=int, default=None, help="evaluate only the first N held-out items")
    parser.add_argument("--max-new-tokens", type=int, default=None, help="completion budget per item")
    parser.add_argument("--backend", default="auto", help="stage backend: torch, mlx or auto")
    parser.add_argument("--json", action="store_true", help="print JSON instead of a table")


def task_configs(args: argparse.Namespace) -> list[TaskConfig]:
    """The tasks the flags name (validated by ``TaskConfig``; raises ValueError)."""
    base: TaskConfig | None = None
    if args.run_dir:
        from engine.model.export.run_record import RunRecord

        base = RunRecord.open(args.run_dir).task
    names = args.task or [base.name if base is not None else TaskConfig().name]
    out = []
    for name in names:
        config = base if base is not None and base.name == name else TaskConfig(name=name)
        changes: dict[str, Any] = {}
        if args.options is not None:
            try:
                changes["options"] = json.loads(args.options)
            except json.JSONDecodeError as exc:
                raise ValueError(f"--options is not JSON ({exc})") from None
        if args.min_digits is not None:
            changes["min_digits"] = args.min_digits
        if args.max_digits is not None:
            changes["max_digits"] = args.max_digits
        if args.eval_size is not None:
            changes["eval_size"] = args.eval_size
        out.append(dataclasses.replace(config, **changes))
    return out


def format_table(checkpoint: str, results: Sequence[Any]) -> str:
    def pct(x: float | None) -> str:
        return "-" if x is None else f"{100 * x:.1f}%"

    lines = [f"checkpoint: {checkpoint}",
             f"{'task':<32} {'items':>5} {'strict':>7} {'content':>8} {'formed':>7} {'reward':>7} {'seconds':>8}"]
    for r in results:
        lines.append(f"{r.task:<32} {r.items:>5} {pct(r.strict):>7} {pct(r.content):>8} {pct(r.well_formed):>7} "
                     f"{r.reward:>7.3f} {r.seconds:>8.1f}")
    lines.append("strict: exact match (digit tasks) or the answer in <answer> tags (chat tasks); "
                 "content: the stated answer, tags ignored")
    return "\n".join(lines)


def run(args: argparse.Namespace) -> int:
    from backends.base import BackendError
    from engine.model.errors import CheckpointError
    from engine.rl.checkpoint_eval import EvalError, evaluate_checkpoint
    from engine.rl.codec import CodecError
    from engine.rl.tasks.reasoning_gym_task import TaskUnavailable

    checkpoint = Path(args.checkpoint)
    try:
        configs = task_configs(args)
        results = []
        for config in configs:
            if is_chat_task_name(config.name) and args.min_digits is not None:
                raise ValueError("--min-digits/--max-digits apply to digit tasks only")
            results.append(evaluate_checkpoint(checkpoint, config, n=args.n, max_new_tokens=args.max_new_tokens,
                                               backend=args.backend))
    except (ValueError, CheckpointError, CodecError, EvalError, BackendError, TaskUnavailable) as exc:
        print(f"polis eval: {exc}", file=sys.stderr)
        return 2
    if args.json:
        print(json.dumps({"checkpoint": str(checkpoint), "results": [r.to_dict() for r in results]}, indent=2))
    else:
        print(format_table(str(checkpoint), results))
    return 0
