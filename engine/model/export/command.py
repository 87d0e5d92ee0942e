"""``polis export (--run-dir DIR | --coordinator URL) --out OUT``: one policy version as an HF checkpoint.

From a local run directory it runs ``hf_export.export_version``; from a running swarm
(``--coordinator URL`` with the admin token) ``engine.swarm.export_fetch.fetch_run`` gets every
stage's verified weights (its checkpoint when readable here, else from its leader over WebRTC)
and ``hf_export.write_export`` writes the same folder. With ``--adapter`` a LoRA run's adapters
are written in PEFT's format instead. Then, unless
``--no-eval``, measures the base and the export with ``polis eval``'s code on the run's
task (its held-out split; ``--eval-n`` items) and writes the model card (``README.md``)
from the database and those figures. Prints where the folder is and what to do with it,
or ``--json``.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path


def add_arguments(parser: argparse.ArgumentParser) -> None:
    source = parser.add_mutually_exclusive_group(required=True)
    source.add_argument("--run-dir",
                        help="the run directory (coordinator.db + node data dirs; what `polis demo --run-dir` keeps)")
    source.add_argument("--coordinator", metavar="URL",
                        help="a running swarm's coordinator (http://host:port): fetch each stage from its checkpoint "
                             "when readable here, else from its leader over WebRTC; needs the admin token")
    parser.add_argument("--admin-token-file", default=None,
                        help="with --coordinator: the file `polis coordinator --admin-token-file` wrote "
                             "(or set POLIS_ADMIN_TOKEN)")
    parser.add_argument("--out", required=True, help="folder to write (must be empty or absent unless --force)")
    parser.add_argument("--stage-timeout-s", type=float, default=None,
                        help="with --coordinator: longest one stage's weights may take over WebRTC (default 180)")
    parser.add_argument("--version", type=int, default=None,
                        help="policy version to export (default: the newest every stage has checkpointed; "
                             "with --coordinator the run's current version)")
    parser.add_argument("--base", default=None,
                        help="the base checkpoint the run was cut from (default: as the stage checkpoints record)")
    parser.add_argument("--adapter", action="store_true",
                        help="LoRA runs: write the adapters in PEFT's format instead of merged weights")
    parser.add_argument("--gguf", choices=("f32", "f16"), default=None,
                        help="also write the merged model as one GGUF file (Llama, byte-level BPE) for llama.cpp")
    parser.add_argument("--no-eval", action="store_true", help="skip the before/after eval in the model card")
    parser.add_argument("--eval-n", type=int, default=None, help="held-out items to evaluate (default: all)")
    parser.add_argument("--license", default=None,
                        help="license field of the model card (default: the base's when known, else 'other')")
    parser.add_argument("--backend", default="auto", help="stage backend for the evals: torch, mlx or auto")
    parser.add_argument("--force", action="store_true", help="replace a non-empty --out")
    parser.add_argument("--json", action="store_true", help="print a JSON summary")


def run(args: argparse.Namespace) -> int:
    from backends.base import BackendError
    from engine.extras import MissingExtra
    from engine.model.errors import CheckpointError
    from engine.model.export.hf_export import export_version, stage_json
    from engine.model.export.model_card import render_card
    from engine.model.export.run_record import RunRecord
    from engine.model.importers.output import MANIFEST_FILE, read_json
    from engine.rl.checkpoint_eval import EvalError, evaluate_checkpoint
    from engine.rl.tasks.reasoning_gym_task import TaskUnavailable

    try:
        if args.coordinator:
            record, result = _export_from_swarm(args)
        else:
            result = export_version(args.run_dir, args.out, version=args.version, base_dir=args.base,
                                    adapter=args.adapter, overwrite=args.force)
            record = RunRecord.open(args.run_dir)
        before, after = [], []
        if not args.no_eval and not result.adapter_only:
            task = record.task
            budget = record.run.get("sampling", {}).get("max_new_tokens")
            before = [evaluate_checkpoint(result.base_dir, task, n=args.eval_n, max_new_tokens=budget,
                                          backend=args.backend)]
            after = [evaluate_checkpoint(result.out_dir, task, n=args.eval_n, max_new_tokens=budget,
                                         backend=args.backend)]
        manifest = read_json(result.out_dir / MANIFEST_FILE)
        gguf_path = None
        if args.gguf:
            if result.adapter_only:
                raise ValueError("--gguf writes merged weights; drop --adapter (or export twice)")
            from engine.model.export.gguf_export import write_gguf

            gguf_path = write_gguf(result.out_dir, result.out_dir / f"{manifest['name']}.{args.gguf}.gguf", args.gguf)
        card = render_card(record, result, manifest=manifest, before=before, after=after,
                           license_name=args.license)
        (result.out_dir / "README.md").write_text(card, encoding="utf-8")
    except (CheckpointError, EvalError, BackendError, MissingExtra, TaskUnavailable, ValueError) as exc:
        print(f"polis export: {exc}", file=sys.stderr)
        return 2
    if args.json:
        gguf_text = str(gguf_path) if gguf_path else None
        print(json.dumps({**stage_json(result), "gguf": gguf_text, "evals_before": [r.to_dict() for r in before],
                          "evals_after": [r.to_dict() for r in after]}, indent=2))
        return 0
    out = Path(result.out_dir)
    print(f"Exported version {result.version} of run {result.run_id} to {out}")
    for stage, source in enumerate(result.stage_files):
        print(f"  stage {stage}: {source}")
    for b, a in zip(before, after):
        content = (f", content {100 * b.content:.1f} % -> {100 * a.content:.1f} %"
                   if a.content is not None and b.content is not None else "")
        print(f"  {a.task}: strict {100 * b.strict:.1f} % -> {100 * a.strict:.1f} %{content} "
              f"({a.items} held-out items)")
    if gguf_path:
        print(f"  GGUF ({args.gguf}) for llama.cpp / Ollama: {gguf_path}")
    print("Load it with transformers' AutoModelForCausalLM.from_pretrained(...); the model card is README.md; "
          f"publish it yourself with `huggingface-cli upload YOUR_NAME/MODEL {out}`.")
    return 0


def _export_from_swarm(args: argparse.Namespace):
    """``--coordinator``: fetch every stage's verified weights of the version, write them as the local export."""
    import asyncio
    import os

    from engine.model.export.hf_export import write_export
    from engine.model.importers.output import check_out_dir
    from engine.swarm.export_fetch import fetch_run

    token = os.environ.get("POLIS_ADMIN_TOKEN", "")
    if args.admin_token_file:
        try:
            token = Path(args.admin_token_file).read_text(encoding="utf-8").strip()
        except OSError as exc:
            raise ValueError(f"cannot read the admin token file {args.admin_token_file} ({exc})") from None
    if not token:
        raise ValueError("--coordinator needs the admin token: pass --admin-token-file (the file "
                         "`polis coordinator --admin-token-file` wrote) or set POLIS_ADMIN_TOKEN")
    check_out_dir(Path(args.out), overwrite=args.force)  # before fetching anything
    timeout = {} if args.stage_timeout_s is None else {"stage_timeout_s": args.stage_timeout_s}
    record, stages = asyncio.run(fetch_run(args.coordinator, token, version=args.version, **timeout))
    return record, write_export(record, stages, args.out, base_dir=args.base, adapter=args.adapter,
                                overwrite=args.force)
