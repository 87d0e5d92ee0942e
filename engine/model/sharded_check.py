"""``polis check-model``: sharded generation across backends, checked against transformers.

It shows the model layer end to end in one process: it takes the shipped base checkpoint
(``engine.paths.base_checkpoint_dir()``) or, when there is none, writes a small
random one to a temporary directory; cuts it into stages spread over the
available backends (torch, mlx, torch, ...); generates greedily with KV caches
through the stage chain for a few prompts; and checks every step's logits and
every generated token against the unsplit ``transformers`` model. It prints
what it did: stages, layers, backend and device per stage, max logit
difference, tokens/s, and the samples. Exit status 1 if the check fails.
(``polis demo`` runs the whole swarm; this is the model layer alone, in one process.)
"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

from backends import registry
from backends.registry import TORCH_THREADS_ENV
from engine import paths
from engine.model.checkpoint import CONFIG_FILE, Checkpoint
from engine.model.loader import load_stage
from engine.model.random_checkpoint import DEFAULT_ALPHABET, small_config, write_random_checkpoint
from engine.model.shard_plan import plan_stages
from engine.model.sharded_decode import greedy_decode
from engine.model.tokenizer import TOKENIZER_FILE, CharTokenizer

DEFAULT_PROMPTS = ("rev:12345=", "sort:31415=", "add:12+34=")
#: prompts for a chat model (each sent as one user turn through its chat template)
DEFAULT_CHAT_PROMPTS = ("What is 3 + 4?", "Spell the word cat backwards.")
#: largest logit difference accepted by the demo's check (the fp32 target of the bench is 1e-5)
CHECK_ATOL = 1e-4


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--stages", type=int, default=None, help="pipeline stages (default: 2, or 1 for 1 layer)")
    parser.add_argument("--backends", default=None,
                        help="comma-separated backend per stage, cycled (default: every available one)")
    parser.add_argument("--prompt", action="append", default=None, help="a prompt (repeatable)")
    parser.add_argument("--max-new-tokens", type=int, default=24)
    parser.add_argument("--checkpoint", type=Path, default=None, help="checkpoint directory to use")
    parser.add_argument("--threads", type=int, default=None,
                        help="torch intra-op threads (default: torch's choice; use 1 on a busy machine)")


def run(args: argparse.Namespace) -> int:
    if args.threads is not None:
        os.environ[TORCH_THREADS_ENV] = str(args.threads)
    with tempfile.TemporaryDirectory(prefix="polis-demo-") as tmp:
        checkpoint_dir, origin = _choose_checkpoint(args.checkpoint, Path(tmp))
        return _demo(checkpoint_dir, origin, args)


def _choose_checkpoint(requested: Path | None, tmp: Path) -> tuple[Path, str]:
    if requested is not None:
        return requested, f"{requested}"
    base = paths.base_checkpoint_dir()
    if (base / CONFIG_FILE).exists():
        return base, f"shipped base checkpoint ({base})"
    tokenizer = CharTokenizer.build(DEFAULT_ALPHABET)
    config = small_config(tokenizer.vocab_size, hidden_size=128, num_layers=4, num_heads=4, num_kv_heads=2)
    write_random_checkpoint(tmp / "random", config, seed=0, init_std=0.1, max_shard_bytes=256 * 1024,
                            tokenizer=tokenizer)
    return tmp / "random", f"random checkpoint (no base checkpoint in {base}; untrained, so samples are noise)"


def _demo(checkpoint_dir: Path, origin: str, args: argparse.Namespace) -> int:
    from engine.model.reference import load_reference_model, reference_greedy, reference_logits
    from engine.rl.codec import ChatCodec, load_codec

    checkpoint = Checkpoint(checkpoint_dir)
    config = checkpoint.config
    codec = load_codec(checkpoint_dir) if (checkpoint_dir / TOKENIZER_FILE).exists() else None
    if codec is None:
        print("no tokenizer.json in the checkpoint: prompts are shown as token ids")
    chat = isinstance(codec, ChatCodec) and codec.template is not None
    num_stages = args.stages or min(2, config.num_hidden_layers)
    names = args.backends.split(",") if args.backends else registry.available()
    plan = plan_stages(config.num_hidden_layers, num_stages)
    chain = [names[i % len(names)] for i in range(num_stages)]

    print(f"checkpoint: {origin}")
    print(f"model: {config.model_type}, {config.num_hidden_layers} layers, hidden {config.hidden_size}, "
          f"vocab {config.vocab_size}, {config.num_parameters / 1e6:.2f} M parameters")
    stages = [load_stage(checkpoint, spec, name) for spec, name in zip(plan, chain)]
    for spec, stage in zip(plan, stages):
        print(f"  stage {spec.stage_index + 1}/{num_stages}: {spec.describe(config.num_hidden_layers):<16} "
              f"{stage.name} on {stage.device}")
    reference = load_reference_model(checkpoint_dir)
    eos = codec.eos_id if codec else config.eos_token_id

    worst, all_match, sharded_s, reference_s, generated = 0.0, True, 0.0, 0.0, 0
    for text in args.prompt or (DEFAULT_CHAT_PROMPTS if chat else DEFAULT_PROMPTS):
        if chat:
            prompt = codec.encode_messages([{"role": "user", "content": text}])
        elif codec is not None:
            prompt = codec.encode(text) if isinstance(codec, ChatCodec) else codec.encode_prompt(text)
        else:
            prompt = [int(c) % config.vocab_size for c in text.encode()]
        start = time.perf_counter()
        new, step_logits = greedy_decode(stages, np.array([prompt], np.int64), args.max_new_tokens, eos)
        sharded_s += time.perf_counter() - start
        new = new[0].tolist()
        generated += len(new)
        start = time.perf_counter()
        expected = reference_greedy(reference, prompt, args.max_new_tokens, eos)
        reference_s += time.perf_counter() - start
        full = reference_logits(reference, np.array([prompt + new[:-1]], np.int64))[0, len(prompt) - 1:]
        diff = float(np.abs(np.stack([s[0] for s in step_logits]) - full).max())
        worst = max(worst, diff)
        match = new == expected
        all_match &= match
        shown = (codec.decode_completion(new) if isinstance(codec, ChatCodec) else codec.decode_lenient(new)
                 if codec else str(new))
        print(f"  {text!r} -> {shown!r}  ({len(new)} tokens, max |logit diff| {diff:.1e}, "
              f"{'same as' if match else 'DIFFERENT from'} transformers generate)")
    for stage in stages:
        stage.close()
    ok = all_match and worst <= CHECK_ATOL
    print(f"sharded KV-cached generation: {generated / sharded_s:,.0f} tokens/s over {num_stages} stages "
          f"({', '.join(chain)}); unsplit transformers generate: {generated / reference_s:,.0f} tokens/s")
    print(f"check vs unsplit transformers model: max |logit diff| {worst:.1e} (accept <= {CHECK_ATOL:.0e}), "
          f"tokens {'identical' if all_match else 'DIFFERENT'} -> {'OK' if ok else 'FAILED'}")
    return 0 if ok else 1


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="polis check-model", description=__doc__.splitlines()[0])
    add_arguments(parser)
    return run(parser.parse_args(argv))


if __name__ == "__main__":
    sys.exit(main())
