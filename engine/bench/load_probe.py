"""Peak memory of loading one stage, measured in a fresh process (``python -m engine.bench.load_probe``).

Run by ``polis bench shard`` once per measurement so that nothing else the
bench did inflates the figure. The process first imports the backend and loads
and drops a tiny stage (one-off library set-up is the *baseline*), resets the
kernel's peak-RSS mark where it can (Linux), then loads stage ``--stage`` of
``--stages`` from ``--checkpoint`` and reports the peak resident set size above
the baseline, as one JSON line on stdout. It knows nothing about what the
figure is compared with.
"""

from __future__ import annotations

import argparse
import gc
import json
import sys
import tempfile


def reset_peak() -> bool:
    """Reset the kernel's peak-RSS mark (Linux ``clear_refs``); False where that is not possible."""
    try:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")
        return True
    except OSError:
        return False


def peak_rss_mb() -> float:
    """Peak resident set size of this process (since the last ``reset_peak``), in MiB."""
    try:
        with open("/proc/self/status") as f:
            for line in f:
                if line.startswith("VmHWM:"):
                    return int(line.split()[1]) / 1024
    except OSError:
        pass
    try:
        import resource
    except ImportError:  # Windows
        import psutil

        return psutil.Process().memory_info().peak_wset / 2**20
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return peak / 2**20 if sys.platform == "darwin" else peak / 1024  # bytes on macOS, KiB on Linux


def _warm_up(backend: str, device: str | None) -> None:
    """Load and drop a tiny stage so one-off library set-up (optimiser modules...) joins the baseline."""
    from engine.model.loader import load_stage
    from engine.model.random_checkpoint import small_config, write_random_checkpoint
    from engine.model.shard_plan import plan_stages

    with tempfile.TemporaryDirectory(prefix="polis-probe-") as tmp:
        write_random_checkpoint(tmp, small_config(vocab_size=16, hidden_size=16, num_layers=1, num_heads=2,
                                                  num_kv_heads=1))
        load_stage(tmp, plan_stages(1, 1)[0], backend, device=device).close()


def measure(checkpoint_dir: str, stage: int, num_stages: int, backend: str, device: str | None) -> dict:
    from engine.model.checkpoint import Checkpoint
    from engine.model.loader import load_stage
    from engine.model.shard_plan import plan_stages

    checkpoint = Checkpoint(checkpoint_dir)
    spec = plan_stages(checkpoint.config.num_hidden_layers, num_stages)[stage]
    _warm_up(backend, device)
    gc.collect()
    precise = reset_peak()
    baseline = peak_rss_mb()
    loaded = load_stage(checkpoint, spec, backend, device=device)
    peak = peak_rss_mb()
    return {"stage": stage, "stages": num_stages, "backend": loaded.name, "baseline_mb": round(baseline, 2),
            "peak_mb": round(peak, 2), "load_peak_mb": round(peak - baseline, 2), "peak_reset": precise,
            "stage_fp32_mb": round(checkpoint.stage_nbytes(spec) / 2**20, 2),
            "bytes_read": checkpoint.bytes_read}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m engine.bench.load_probe", description=__doc__.splitlines()[0])
    parser.add_argument("--checkpoint", required=True)
    parser.add_argument("--stage", type=int, required=True)
    parser.add_argument("--stages", type=int, required=True)
    parser.add_argument("--backend", default="torch")
    parser.add_argument("--device", default=None)
    args = parser.parse_args(argv)
    print(json.dumps(measure(args.checkpoint, args.stage, args.stages, args.backend, args.device)))
    return 0


if __name__ == "__main__":
    sys.exit(main())
