"""``polis node --selftest``: prove this install can hold and run a stage, without a swarm.

Loads stage 0 of a two-stage cut of the base checkpoint on the chosen backend,
runs one forward pass on a task prompt, checks the output is finite and of the
right shape, and prints one line (or the reason it failed). Used by the
installer smoke test and by users checking a fresh install.
"""

from __future__ import annotations

import time

import numpy as np


def run_selftest(args) -> int:
    from engine.model.checkpoint import Checkpoint
    from engine.model.loader import load_stage
    from engine.model.shard_plan import plan_stages
    from engine.paths import base_checkpoint_dir
    from engine.rl.codec import TaskCodec

    directory = args.checkpoint or str(base_checkpoint_dir())
    try:
        started = time.perf_counter()
        checkpoint = Checkpoint(directory)
        specs = plan_stages(checkpoint.config.num_hidden_layers, min(2, checkpoint.config.num_hidden_layers))
        backend = load_stage(checkpoint, specs[0], args.backend, args.device)
        codec = TaskCodec.from_dir(directory)
        ids = np.asarray([codec.encode_prompt("rev:12345=")], dtype=np.int64)
        out = backend.forward(ids)
        backend.close()
    except Exception as exc:  # the boundary: say what failed, in one line
        print(f"selftest FAILED: {exc}")
        return 1
    expected = (1, ids.shape[1], checkpoint.config.hidden_size if len(specs) > 1 else checkpoint.config.vocab_size)
    ok = out.shape == expected and bool(np.isfinite(out).all())
    print(f"selftest {'ok' if ok else 'FAILED'}: stage 1 of {len(specs)} "
          f"({specs[0].describe(checkpoint.config.num_hidden_layers)}) on {backend.name} [{backend.device}], "
          f"forward {list(ids.shape)} -> {list(out.shape)} in {time.perf_counter() - started:.2f} s")
    return 0 if ok else 1
