"""``polis bench weights``: the weight stream to inference replicas, in one process.

Every stage of the base checkpoint is loaded twice on the torch backend: a trainer
(AdamW at the run's learning rate, real backpropagation of a random upstream
gradient through the stage on random tokens) and an inference replica loaded
without optimiser state. After every step the trainer's stream
(``engine.swarm.weight_stream``) encodes its weights against the replica's shadow,
the replica applies the delta and installs the result with ``set_weights``, the
same code path as the swarm. Measured per stage over ``--versions`` versions:

* bytes of one delta on the wire vs the stage's dense fp32 weights;
* ``max |trainer weights - replica weights|`` after the last version and over all
  versions, next to the largest weight change of one step (the scale it is small
  against), and whether the replica's weights equal the trainer's shadow bit for bit;
* the same for a naive stream without a shadow (each step's change quantised on its
  own), whose error accumulates: the drift the shadow prevents;
* bytes of the exact sparse streams (``sparse_exact``: the entries whose fp32, or bf16,
  bits changed, at their exact values) on the same steps, against the int8 deltas, the
  share of entries each step changed, and whether their replica holds exactly the
  trainer's weights (fp32) or their bf16 rounding (bf16).

With ``--lora-rank R`` both load LoRA adapters of rank R on every linear layer (the
real-model demo's setting): the stream then carries adapter deltas only, and the
ratios are against the stage's full dense fp32 weights (what full fine-tuning streams).

No network: bytes are the delta payloads a link would carry. The last stdout line is
the JSON object with ``--json``.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from dataclasses import dataclass, field
from typing import Any

import numpy as np


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--json", action="store_true", help="print one JSON object as the last line")
    parser.add_argument("--checkpoint", default=None, help="base checkpoint (default: the shipped one)")
    parser.add_argument("--stages", type=int, default=2, help="pipeline stages the model is cut into")
    parser.add_argument("--versions", type=int, default=50, help="optimiser steps streamed")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--lr", type=float, default=None,
                        help="AdamW learning rate (default: the run's; real models post-train far lower)")
    parser.add_argument("--lora-rank", type=int, default=0,
                        help="train LoRA adapters of this rank on every linear layer (as the real-model demo: "
                             "the stream then carries adapter deltas only); 0 (default): full fine-tuning")


@dataclass
class _ExactStream:
    """An exact sparse stream measured beside the int8 one: its two ends and what it cost."""

    leader: Any
    follower: Any
    nbytes: list[int] = field(default_factory=list)
    changed: list[float] = field(default_factory=list)
    exact: bool = True


def _measure_stage(checkpoint, spec, versions: int, lr: float, rng: np.random.Generator,
                   lora_rank: int = 0) -> dict[str, Any]:
    from backends import registry
    from backends.base import LoraConfig, OptimizerConfig
    from engine.net.codec_sparse_exact import round_to
    from engine.net.tensor_codec import decode_tensor, encode_tensor
    from engine.swarm.weight_stream import StreamFollower, StreamLeader, WeightStreamConfig

    weights = checkpoint.stage_weights(spec)
    trainer = registry.create("torch", device="cpu")
    replica = registry.create("torch", device="cpu")
    lora = LoraConfig(enabled=True, rank=lora_rank, alpha=2.0 * lora_rank) if lora_rank else LoraConfig()
    trainer.load(spec, weights, checkpoint.config, OptimizerConfig(lr=lr, lora=lora))
    replica.load(spec, weights, checkpoint.config, OptimizerConfig(trainable=False, lora=lora))
    try:
        start = trainer.state_dict()
        leader, follower = StreamLeader(), StreamFollower()
        follower.reset("leader", leader.start("replica", start, 0), start, 0)
        naive = {n: w.copy() for n, w in start.items()}
        exact_streams: dict[str, _ExactStream] = {}
        for dtype in ("float32", "bfloat16"):
            config = WeightStreamConfig(encoding="sparse_exact", value_dtype=dtype)
            e = exact_streams[dtype] = _ExactStream(StreamLeader(config), StreamFollower(config))
            e.follower.reset("leader", e.leader.start("replica", start, 0), start, 0)
        previous = start
        vocab, hidden = checkpoint.config.vocab_size, checkpoint.config.hidden_size
        delta_bytes, step_max, residual_max, naive_max, exact = [], 0.0, 0.0, 0.0, True
        for version in range(1, versions + 1):
            ids = rng.integers(0, vocab, size=(8, 12))
            x = ids if spec.is_first else rng.standard_normal((8, 12, hidden)).astype(np.float32)
            out = trainer.forward(x, key="k")
            trainer.backward("k", rng.standard_normal(out.shape).astype(np.float32) / out.size)
            trainer.step()
            now = trainer.state_dict()
            frame = leader.encode("replica", now, version)
            replica.set_weights(follower.apply(frame.header["delta"], frame.payload, version))
            served = replica.state_dict()
            exact &= all(np.array_equal(served[n].view(np.uint32), s.view(np.uint32))
                         for n, s in leader.shadow("replica").items())
            delta_bytes.append(len(frame.payload))
            step_max = max(step_max, max(float(np.abs(now[n] - previous[n]).max()) for n in now))
            residual = max(float(np.abs(now[n] - served[n]).max()) for n in now)
            residual_max = max(residual_max, residual)
            for n in now:  # no shadow: quantise this step's change alone and add it
                enc = encode_tensor(now[n] - previous[n], "int8_rowwise")
                naive[n] = naive[n] + decode_tensor(enc.header, enc.payload, max_elements=now[n].size,
                                                    expected_shape=now[n].shape)
            naive_max = max(float(np.abs(now[n] - naive[n]).max()) for n in now)
            for dtype, e in exact_streams.items():
                frame = e.leader.encode("replica", now, version)
                held = e.follower.shadow()
                held.update(e.follower.apply(frame.header["delta"], frame.payload, version))
                e.nbytes.append(len(frame.payload))
                e.changed.append(sum(int(t["k"]) for _, t, _ in frame.header["delta"]["tensors"])
                                 / sum(int(w.size) for w in now.values()))
                e.exact &= all(np.array_equal(held[n].view(np.uint32), round_to(now[n], dtype).view(np.uint32))
                               for n in now)
            previous = now
        dense = sum(int(np.asarray(w).size) * 4 for w in weights.values())  # the whole stage, adapters or not
        return {"stage": spec.stage_index, "parameters": dense // 4, "dense_fp32_bytes": dense,
                "bytes_per_delta": float(np.mean(delta_bytes)),
                "ratio_vs_dense_fp32": float(np.mean(delta_bytes)) / dense,
                "max_step_change": step_max, "residual_max_abs_last": residual, "residual_max_abs_all": residual_max,
                "replica_equals_shadow_bitwise": bool(exact), "naive_no_shadow_error_last": naive_max,
                "sparse_exact": {dtype: {"bytes_per_delta": float(np.mean(e.nbytes)),
                                         "ratio_vs_int8": float(np.mean(e.nbytes)) / float(np.mean(delta_bytes)),
                                         "changed_fraction": float(np.mean(e.changed)),
                                         "replica_exact": e.exact}
                                 for dtype, e in exact_streams.items()}}
    finally:
        trainer.close()
        replica.close()


def measure(args: argparse.Namespace) -> dict[str, Any]:
    from engine.model.checkpoint import Checkpoint
    from engine.model.shard_plan import plan_stages
    from engine.paths import base_checkpoint_dir
    from engine.swarm.run_config import RunConfig

    checkpoint = Checkpoint(args.checkpoint or base_checkpoint_dir())
    lr = args.lr or RunConfig().lr
    rng = np.random.default_rng(args.seed)
    started = time.monotonic()
    lora_rank = int(args.lora_rank)
    stages = [_measure_stage(checkpoint, spec, args.versions, lr, rng, lora_rank)
              for spec in plan_stages(checkpoint.config.num_hidden_layers, args.stages)]
    return {"versions": args.versions, "lr": lr, "encoding": "int8_rowwise", "lora_rank": lora_rank, "stages": stages,
            "seconds": round(time.monotonic() - started, 1)}


def format_table(result: dict[str, Any]) -> str:
    what = f"LoRA rank {result['lora_rank']} adapters" if result.get("lora_rank") else "full fine-tuning"
    lines = [f"weight stream, {result['versions']} AdamW steps at lr {result['lr']:g}, {what} "
             f"({result['encoding']} deltas; ratio against the whole stage in dense fp32)",
             "stage  params  dense fp32 B  B/delta  ratio   max step   |trainer-replica| last / all   "
             "bit-exact  no-shadow error"]
    for s in result["stages"]:
        lines.append(f"{s['stage']:5d} {s['parameters']:7d} {s['dense_fp32_bytes']:13d} {s['bytes_per_delta']:8.0f} "
                     f"{s['ratio_vs_dense_fp32']:6.3f}  {s['max_step_change']:9.2e}   "
                     f"{s['residual_max_abs_last']:9.2e} / {s['residual_max_abs_all']:9.2e}       "
                     f"{'yes' if s['replica_equals_shadow_bitwise'] else 'NO':>3}      "
                     f"{s['naive_no_shadow_error_last']:9.2e}")
    lines.append("exact sparse deltas on the same steps: stage  values  B/delta  vs int8  changed  exact")
    for s in result["stages"]:
        for dtype, e in s["sparse_exact"].items():
            lines.append(f"{s['stage']:42d}  {dtype:>8} {e['bytes_per_delta']:8.0f} {e['ratio_vs_int8']:7.2f}x "
                         f"{e['changed_fraction']:7.1%}  {'yes' if e['replica_exact'] else 'NO'}")
    lines.append(f"({result['seconds']} s)")
    return "\n".join(lines)


def run(args: argparse.Namespace) -> int:
    result = measure(args)
    if args.json:
        print(format_table(result), file=sys.stderr)
        print(json.dumps(result, default=float))
    else:
        print(format_table(result))
    return 0 if all(s["replica_equals_shadow_bitwise"] for s in result["stages"]) else 1
