"""``polis demo``: a whole swarm on this machine, learning, over real WebRTC.

Starts a coordinator and ``stages x replicas`` nodes as separate processes on
127.0.0.1 (each node holds only its own stage and talks to the others only
over WebRTC data channels), shows live progress (policy version, reward, eval
accuracy, tokens/s, bytes on the wire, staleness), then ends training, runs a
final held-out eval and prints a before/after table. ``--json`` prints a
summary object as the last line.

It only starts processes and reads the coordinator's stats API; everything it
shows is measured by the swarm itself. The recipe (:func:`coordinator_argv`,
:func:`node_argv`, :data:`DEMO_ENV`, :class:`DemoProcesses`) is shared with the
desktop app's local demo (``polis node --demo``, see ``engine.swarm.local_swarm``),
so both run the same swarm.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
import urllib.request
from collections import deque
from pathlib import Path
from typing import Any

from engine.self_command import polis_command

#: the demo swarm's shape: ``polis demo`` and the desktop app's local demo (``polis node --demo``) share it.
DEFAULT_STAGES = 2
DEFAULT_REPLICAS = 2
#: the real model's demo: 2 stages x 1 replica (2 node processes on 2 cores)
REAL_MODEL_REPLICAS = 1
#: the task the real model's demo trains by default: 2 terms of 1-2 digits, where SmolLM2-135M-Instruct
#: starts in the middle, leaving room for a rise (`polis eval`, 64 held-out items, greedy, 48 tokens,
#: worked example: 34.4 % strict and content; 2 one-digit terms 73.4 %, 3 one-digit terms 15.6 %)
REAL_MODEL_TASK = "reasoning_gym:chain_sum"
REAL_MODEL_TASK_OPTIONS = {"min_terms": 2, "max_terms": 2, "min_digits": 1, "max_digits": 2}
#: the real model's run, sized for 2 CPU cores and for memory (DESIGN §9): 4 prompts x 8 samples a step
#: (64 rows a step put every micro-batch's autograd graph in flight on stage 0 at once: 8.4 GB, and the
#: first 30-minute run was OOM-killed at version 3), jobs of 8 prompts, 48 new tokens (room for the
#: working before the tags), 8-row training micro-batches, one update per batch, 64 held-out items.
#: LoRA rank 16 on every linear layer ("LoRA Without Regret": for RL even low ranks match full
#: fine-tuning, at about 10x its lr: 5e-5 against the 5e-6 of the in-process full GRPO that rose on this
#: task); replicas then move adapters only. Full fine-tuning: --set lora.enabled=false --set lr=5e-06.
#: Not yet measured against each other in the swarm. Tried 2026-12-03: lr 1e-4 with unscaled advantages
#: (objective.scale_by_std=false) rose the same +6.2 points in 30 minutes (v8 35.9, v16 39.1, v24 40.6 %),
#: so the recipe the in-process comparison measured stays. A SmolLM2 micro-batch takes seconds on a CPU:
#: the 30 s default micro-batch deadline evicted the only stage-1 trainer at step 0, hence 120 s.
#: Stage checkpoints (adapters only with LoRA: a few
#: MB) come with every eval, so `polis export` finds the weights of every evaluated version.
#: Activations cross the stage boundary as predcoded_s40_gs64_b4: the first stage codes each row less a
#: linear prediction from its token's base embedding, in a full-rank basis fitted from its first rows,
#: every coefficient quantised with one step (0.4 of their RMS) and range-coded; gradients go back as
#: 4-bit codes in each tensor's own rank-64 basis. Trained 64 versions of this recipe through it
#: (`polis bench act --real-learn-versions 64 --real-learn-set seed=S`, seeds 0, 1 and 2) it ended
#: -1.6 / -3.1 / +0.0 points from fp32 at v64 and -1.6 / -1.2 / -1.2 over the curve, at 18.1 / 20.5 /
#: 18.3x fewer boundary bytes per trained sample than fp32 (activations 17.7-20.7x); without the
#: basis refit after 64k rows, which coded schemes no longer do, seed 0 sent 20.7x at -1.6 / -0.8.
#: predcoded_s20 (half the step) was the default before it: within 1 point over the curve at 11.5-14.1x.
#: int8_outliers (int8 rows, the 0.1 % largest entries exact; 3.9x, never more than 1.6 points
#: behind) is the choice where the range coder's CPU time matters more than bytes; the rank-128
#: schemes (16-17x) lag ~5 points over the curve. int8 with per-row scales, the tiny base's default,
#: wrecks a real model's residual stream (a few channels carry outliers a hundred times the rest):
#: SmolLM2's greedy strict accuracy on 16 held-out chain_sum items was 75 % in fp32 and bf16 and 0 %
#: with int8.
REAL_MODEL_SETTINGS = (
    "activation_encoding=predcoded_s40_gs64_b4",
    "group_size=8", "prompts_per_step=4", "prompts_per_job=8", "generations_in_flight=2",
    "micro_batch_rows=8", "updates_per_batch=1", "lora.enabled=true", "lora.rank=16", "lora.alpha=32",
    "lr=5e-05", "sampling.max_new_tokens=48", "microbatch_timeout_s=120",
    "sampling.temperature=0.7", "task.eval_size=64", "eval_every_versions=8", "checkpoint_every_versions=8",
)
#: how replicas of a real-model stage sync (with LoRA: the adapter): DiLoCo, 32 inner steps, every
#: entry as a sign times a block scale chosen for least squared error, with error feedback (``polis
#: bench comm`` scheme ``diloco_h32_1bit_mse``). Measured with ``polis bench comm --model DIR --schemes
#: diloco_h32_1bit_mse --real-versions 64 --real-eval-every 32 --seeds S`` (2 replicas, seeds 0, 1, 2):
#: 288-301x fewer update bytes per trained sample than int8 every step, strict held-out accuracy at v64
#: 4.7, 3.1 points under and 1.6 over dense fp32 every step (over the curve: 4.7, 3.1 and 0.8 under);
#: the 2-bit H=16 scheme it replaced sent 60-72x. Not for full fine-tuning of a tied model
#: (``refuse_diloco_split_tied``): left out then.
#: With one replica per stage (the demo's) nothing is exchanged and every version is voted as before
REAL_MODEL_REPLICA_SYNC = (
    "replica_sync.mode=diloco", "replica_sync.inner_steps=32", "replica_sync.encoding=topk",
    "replica_sync.topk_fraction=1.0", "replica_sync.value_bits=1", "replica_sync.value_scale=mse",
)
#: ``--env calculator``: questions a 135M model cannot do in its head (two or three terms of 3-4 digits,
#: DESIGN §9), answered with a calculator tool over up to 4 turns; 64 new tokens a turn (a tool call
#: line is about 30), rollouts of the episode's whole context up to 1024 tokens
ENV_TASKS = {"calculator": ("reasoning_gym:chain_sum",
                            {"min_terms": 2, "max_terms": 3, "min_digits": 3, "max_digits": 4})}
#: (a micro-batch of 8 such episodes can be 8 x 1024 tokens: 300 s each before it counts as missed)
ENV_SETTINGS = ("env.max_turns=4", "env.max_context_tokens=1024", "sampling.max_new_tokens=64",
                "microbatch_timeout_s=300")
#: ``--env`` on a real model: SFT steps of the tool warm-up before the swarm starts (``engine.rl.tool_warmup``:
#: the base made 0.03 tool calls an episode, so RL had no reward variance); 4 transcripts a step, lr 1e-4.
#: Measured on SmolLM2-135M (32 held-out prompts, probability that the first turn opens a tool call at
#: temperature 0.7 / share of greedy first turns that do): base 0.028 / 0; 1 step 0.11 / 0; 2 steps
#: 0.34 / 0; 3 steps 0.71 / 1.0; 8 steps at lr 3e-4: 32 of 32 episodes solved greedily (no room left for RL).
#: 2 steps: a third of the sampled episodes call the tool (reward variance in most groups of 8), while
#: the greedy eval still starts from 0.
ENV_WARMUP_STEPS = 2
#: the real model's job and step deadlines (seconds): generous, a timed-out job is generated twice
REAL_MODEL_TIMEOUT_S = 600.0
#: every demo process computes with one thread, so 4 nodes + a coordinator share a small machine fairly.
#: glibc's malloc raises its mmap threshold after the first large free, so the KV caches that grow by one
#: token a step then come from the heap and leave holes; a fixed 1 MB threshold returns every large
#: block to the system (a precaution after a SmolLM2 stage reached 8.4 GB RSS and was OOM-killed;
#: its effect is not measured).
DEMO_ENV = {"POLIS_TORCH_THREADS": "1", "OMP_NUM_THREADS": "1", "MALLOC_MMAP_THRESHOLD_": "1048576"}
#: seconds the final held-out eval gets at least after the time budget (more when this run's evals were slower)
FINAL_EVAL_MIN_S = 240.0
#: seconds over which the progress line's tokens/s is measured
TOKEN_RATE_WINDOW_S = 30.0
#: seconds a demo process gets to exit after SIGTERM before it is killed.
STOP_TIMEOUT_S = 10.0


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--stages", type=int, default=DEFAULT_STAGES,
                        help=f"pipeline stages (default {DEFAULT_STAGES})")
    parser.add_argument("--replicas", type=int, default=None,
                        help=f"nodes per stage (default {DEFAULT_REPLICAS}; {REAL_MODEL_REPLICAS} with --model)")
    parser.add_argument("--model", default=None,
                        help="train a real model instead of the tiny base: a name (smollm2-135m: imported into "
                             "the user data dir on first use) or an imported directory")
    parser.add_argument("--task", default=None,
                        help=f"the task (default: the base's digit task; {REAL_MODEL_TASK} with --model), "
                             "e.g. reasoning_gym:chain_sum")
    parser.add_argument("--env", default="", choices=["", *ENV_TASKS],
                        help="run episodes in an environment with tools (calculator: multi-turn, a calculator "
                             "tool, on 3-4 digit sums unless --task says otherwise; needs --model)")
    parser.add_argument("--warmup-steps", type=int, default=ENV_WARMUP_STEPS,
                        help=f"with --env and --model: supervised tool-use warm-up steps before RL (default "
                             f"{ENV_WARMUP_STEPS}; cached; 0: none)")
    parser.add_argument("--minutes", type=float, default=8.0,
                        help="training time budget in minutes (default 8; the whole demo stays under 10)")
    parser.add_argument("--max-versions", type=int, default=0, help="stop at this policy version (0: time only)")
    parser.add_argument("--backend", default="auto", help="backend of every node (auto, torch, mlx)")
    parser.add_argument("--checkpoint", default=None, help="base checkpoint (default: the shipped one)")
    parser.add_argument("--run-dir", default=None, help="keep the run here (default: a temporary directory)")
    parser.add_argument("--json", action="store_true", help="print a JSON summary as the last line")
    parser.add_argument("--quiet", action="store_true", help="no live progress lines")
    parser.add_argument("--set", action="append", default=[], metavar="KEY=VALUE",
                        help="override a run setting of the coordinator (repeatable), e.g. --set lr=0.001")
    add_wan_arguments(parser)


def add_wan_arguments(parser: argparse.ArgumentParser) -> None:
    """``--wan`` and ``--wan-profiles``: the same options for ``polis demo`` and the swarm benches."""
    parser.add_argument("--wan", default=None, metavar="PROFILE",
                        help="run every link over an emulated internet: a profile (metro, continental, home) or "
                             "a mix such as home:1,metro (node 1 on home, the rest metro); see the README")
    parser.add_argument("--wan-profiles", default=None, metavar="FILE",
                        help="TOML file of extra WAN profiles (default: $POLIS_WAN_PROFILES)")


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _get(url: str, timeout_s: float = 5.0, token: str | None = None) -> dict[str, Any]:
    headers = {} if token is None else {"Authorization": f"Bearer {token}"}
    with urllib.request.urlopen(urllib.request.Request(url, headers=headers), timeout=timeout_s) as response:
        return json.loads(response.read())


def bytes_on_wire(stats: dict[str, Any]) -> float:
    """Bytes the nodes sent on peer links, as they reported them (admin stats: nobody else counts them)."""
    return float(stats["self_reported"]["bytes_sent"])


#: how long the watch loop waits out a coordinator that does not answer its stats request (a busy or
#: memory-starved machine stalls it for seconds) before it gives the run up
STATS_PATIENCE_S = 120.0


def _post(url: str, token: str) -> dict[str, Any]:
    request = urllib.request.Request(url, method="POST", data=b"", headers={"Authorization": f"Bearer {token}"})
    with urllib.request.urlopen(request, timeout=5.0) as response:
        return json.loads(response.read())


def coordinator_argv(run_dir: Path, port: int, *, stages: int = DEFAULT_STAGES, checkpoint: str | None = None,
                     max_versions: int = 0, settings: list[str] | tuple[str, ...] = (),
                     real_model: bool = False, nodes: int = 0) -> list[str]:
    """The demo coordinator's ``polis`` arguments (the recipe of every demo run); ``nodes`` on this
    machine beyond the coordinator's per-address cap (16) raise it."""
    argv = ["-v", "coordinator", "--db", str(run_dir / "coordinator.db"), "--port", str(port),
            "--stages", str(stages), "--admin-token-file", str(run_dir / "admin-token")]
    if real_model:  # a 64-row job of 48 tokens takes ~45 s alone on 2 cores, two in flight twice that
        argv += ["--job-timeout-s", str(REAL_MODEL_TIMEOUT_S), "--step-timeout-s", str(REAL_MODEL_TIMEOUT_S)]
    if checkpoint:
        argv += ["--checkpoint", checkpoint]
    if max_versions:
        argv += ["--max-versions", str(max_versions)]
    if nodes > 16:
        argv += ["--max-nodes-per-address", str(nodes)]
    for item in settings:
        argv += ["--set", item]
    return argv


def node_argv(index: int, url: str, run_dir: Path, *, backend: str = "auto",
              checkpoint: str | None = None) -> list[str]:
    """Demo node number ``index``'s ``polis`` arguments (own identity and data directory)."""
    argv = ["-v", "node", "--coordinator", url, "--identity", f"demo-node-{index}",
            "--data-dir", str(run_dir / f"node{index}"), "--backend", backend]
    if checkpoint:
        argv += ["--checkpoint", checkpoint]
    return argv


def _die_with_parent() -> None:  # pragma: no cover - runs in the child between fork and exec
    """Linux: the child gets SIGTERM if the process that started it dies (even by SIGKILL)."""
    try:
        import ctypes

        ctypes.CDLL("libc.so.6", use_errno=True).prctl(1, signal.SIGTERM)  # PR_SET_PDEATHSIG
    except (OSError, AttributeError):
        pass


class DemoProcesses:
    """Processes of a demo run, each logging to ``run_dir/NAME.log``; stopped together.

    With ``die_with_parent`` (Linux) each child also ends when this process dies, so a
    supervisor that kills this process cannot leave demo processes behind. Spawn them
    from the thread that lives as long as the process (the kernel ties the signal to it).
    """

    def __init__(self, run_dir: Path, die_with_parent: bool = False) -> None:
        self.run_dir = run_dir
        self.die_with_parent = die_with_parent and sys.platform.startswith("linux")
        self.procs: list[subprocess.Popen] = []

    def spawn(self, name: str, argv: list[str]) -> subprocess.Popen:
        log = open(self.run_dir / f"{name}.log", "wb")
        try:
            proc = subprocess.Popen(polis_command(*argv), stdout=log, stderr=subprocess.STDOUT,
                                    stdin=subprocess.DEVNULL, env=dict(os.environ, **DEMO_ENV),
                                    preexec_fn=_die_with_parent if self.die_with_parent else None)
        finally:
            log.close()
        self.procs.append(proc)
        return proc

    def signal_all(self) -> None:
        for proc in reversed(self.procs):  # nodes before the coordinator
            if proc.poll() is None:
                proc.send_signal(signal.SIGTERM)

    def stop(self) -> None:
        """SIGTERM to every process, then kill what is left after :data:`STOP_TIMEOUT_S` (blocks)."""
        self.signal_all()
        deadline = time.monotonic() + STOP_TIMEOUT_S
        for proc in self.procs:
            try:
                proc.wait(max(0.1, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()

    async def stop_async(self) -> None:
        """:meth:`stop` without blocking an event loop."""
        import asyncio

        self.signal_all()
        deadline = time.monotonic() + STOP_TIMEOUT_S
        while any(p.poll() is None for p in self.procs) and time.monotonic() < deadline:
            await asyncio.sleep(0.1)
        for proc in self.procs:
            if proc.poll() is None:
                proc.kill()
                proc.wait()


def coordinator_alive(url: str) -> bool:
    try:
        _get(url + "/api/stats", 1.0)
        return True
    except OSError:
        return False


class DemoSwarm:
    """The processes of one ``polis demo`` run: a coordinator and ``stages x replicas`` nodes."""

    def __init__(self, run_dir: Path, args: argparse.Namespace) -> None:
        self.run_dir = run_dir
        self.args = args
        self.port = _free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.group = DemoProcesses(run_dir)
        self.procs = self.group.procs
        self.token_file = run_dir / "admin-token"
        self.wan: Any = None  # the WanRelay of a --wan run (engine.swarm.wan_swarm)

    def start(self) -> None:
        a = self.args
        self.group.spawn("coordinator", coordinator_argv(self.run_dir, self.port, stages=a.stages,
                                                         checkpoint=a.checkpoint, max_versions=a.max_versions,
                                                         settings=a.set, real_model=bool(a.model),
                                                         nodes=a.stages * a.replicas))
        deadline = time.monotonic() + 60
        while not coordinator_alive(self.url):
            if time.monotonic() > deadline or self.procs[0].poll() is not None:
                raise RuntimeError(f"the coordinator did not start; see {self.run_dir / 'coordinator.log'}")
            time.sleep(0.2)
        nodes = a.stages * a.replicas
        if getattr(a, "wan", None):
            from engine.swarm.wan_swarm import WanRelay

            self.wan = WanRelay.start(self.group, self.run_dir, a.wan, nodes, self.port,
                                       getattr(a, "wan_profiles", None))
        for i in range(nodes):
            url = self.wan.coordinator_url(i) if self.wan else self.url
            argv = node_argv(i, url, self.run_dir, backend=a.backend, checkpoint=a.checkpoint)
            self.group.spawn(f"node{i}", argv + (self.wan.node_args(i) if self.wan else []))

    def stats(self) -> dict[str, Any]:
        """The coordinator's admin stats (this process holds the token), with the longest page of
        versions, steps and evals; a slow answer is retried for :data:`STATS_PATIENCE_S` seconds."""
        from engine.swarm.stats_view import MAX_PAGE

        deadline = time.monotonic() + STATS_PATIENCE_S
        while True:
            try:
                return _get(f"{self.url}/api/admin/stats?limit={MAX_PAGE}", 15.0,
                            token=self.token_file.read_text().strip())
            except OSError:  # includes timeouts and refused connections
                if time.monotonic() > deadline or self.procs[0].poll() is not None:
                    log_file = self.run_dir / "coordinator.log"
                    raise RuntimeError(f"the coordinator stopped answering; see {log_file}") from None
                time.sleep(2.0)

    def finish(self) -> None:
        _post(self.url + "/api/finish", self.token_file.read_text().strip())

    def stop(self) -> None:
        self.group.stop()


def _progress_line(stats: dict[str, Any], elapsed_s: float, tok_rate: float) -> str:
    evals = stats["evals"]
    steps = stats["steps"]
    last = steps[-1] if steps else {}
    ready = sum(1 for n in stats["nodes"] if n["ready"])
    acc = " ".join(f"v{e['version']}:{e['accuracy']:.0%}" + (f"/{e['content']:.0%}" if e.get("content") not in
                                                                (None, e["accuracy"]) else "")
                   for e in evals[-4:]) or "-"  # strict/content where they differ
    # the mean over the last 8 steps' samples: one step's batch is a few prompts, too noisy to read alone
    recent = steps[-8:]
    samples = sum(int(s.get("samples", 0)) for s in recent)
    reward = sum(float(s.get("reward", 0.0)) * int(s.get("samples", 0)) for s in recent) / samples if samples else 0.0
    return (f"[{elapsed_s:5.0f}s] nodes {ready}/{len(stats['nodes'])}  version {stats['version']:3d}  "
            f"reward(8) {reward:.3f}  eval {acc}  {tok_rate:6.0f} tok/s  "
            f"wire {bytes_on_wire(stats) / 1e6:6.1f} MB  staleness {last.get('staleness_mean', 0.0):.2f}")


def real_model_settings(args: argparse.Namespace) -> list[str]:
    """The coordinator's run settings for ``args``: the real-model recipe first (with ``--model``),
    then ``--task``, then the user's own ``--set`` (which win)."""
    settings: list[str] = []
    if args.model:
        settings += [f"model={args.model}", *REAL_MODEL_SETTINGS, f"task.name={args.task or REAL_MODEL_TASK}"]
        if (args.task or REAL_MODEL_TASK) == REAL_MODEL_TASK:
            settings.append(f"task.options={json.dumps(REAL_MODEL_TASK_OPTIONS)}")
    elif args.task:
        settings.append(f"task.name={args.task}")
    if getattr(args, "env", ""):
        task, options = ENV_TASKS[args.env]
        settings += [f"env.name={args.env}", *ENV_SETTINGS]
        if not args.task:
            settings += [f"task.name={task}", f"task.options={json.dumps(options)}"]
    if args.model and _keeps_lora([*settings, *args.set]):
        settings += REAL_MODEL_REPLICA_SYNC
    return settings + list(args.set)


def _keeps_lora(settings: list[str]) -> bool:
    """Whether these run settings train LoRA adapters (the user may ``--set lora.enabled=false``);
    settings that do not parse are left for the coordinator to refuse, with its message."""
    from engine.swarm.run_config import RunConfig, apply_overrides

    try:
        return apply_overrides(RunConfig(), settings).lora.enabled
    except ValueError:
        return True


def ensure_imported(model: str, out) -> None:
    """A named model (``smollm2-135m``) not yet in the user data dir is imported there now."""
    from engine.paths import imported_model_dir
    from engine.swarm.stage_loading import is_model_name

    if not is_model_name(model) or (imported_model_dir(model) / "config.json").exists():
        return
    from engine.model.importers import import_model

    print(f"Importing {model} into {imported_model_dir(model)} (once)...", file=out, flush=True)
    import_model(model, imported_model_dir(model))


def run(args: argparse.Namespace) -> int:
    if args.replicas is None:
        args.replicas = REAL_MODEL_REPLICAS if args.model else DEFAULT_REPLICAS
    args.set = real_model_settings(args)
    keep = args.run_dir is not None
    run_dir = Path(args.run_dir) if keep else Path(tempfile.mkdtemp(prefix="polis-demo-"))
    run_dir.mkdir(parents=True, exist_ok=True)
    swarm = DemoSwarm(run_dir, args)
    started = time.monotonic()
    out = sys.stderr if args.json else sys.stdout
    try:
        print(f"Starting a swarm on this machine: 1 coordinator + {args.stages} stages x {args.replicas} replicas "
              f"= {args.stages * args.replicas} node processes, talking over WebRTC on 127.0.0.1"
              + (f" through an emulated internet ({args.wan})." if args.wan else "."), file=out)
        print(f"Logs: {run_dir}", file=out)
        if args.model:
            ensure_imported(args.model, out)
        warmup = tool_warm_up(args, out) if args.env and args.model and args.warmup_steps > 0 else None
        started = time.monotonic()  # --minutes is RL's time; the warm-up reports its own seconds
        swarm.start()
        version_times = VersionTimes()
        stats = _watch(swarm, args, started, out, version_times)
        summary = _summary(stats, time.monotonic() - started, args, version_times)
        summary["in_flight"] = stats.get("in_flight")  # per route: jobs in flight and why (engine.swarm.inflight)
        if swarm.wan is not None:
            summary["wan"] = {"mix": args.wan, "profiles": swarm.wan.profiles, "relay": swarm.wan.stats()}
        if args.env:
            swarm.stop()  # the base's no-tool eval below wants the cores
            summary["eval_without_tool_before"] = _without_tool(run_dir, out)  # of RL's start (the warmed base)
            summary["eval_without_tool_after"] = _without_tool(run_dir, out, trained=True)
            summary["warmup"] = warmup
        _print_table(summary, stats, out)
        if args.json:
            print(json.dumps(summary))
        return 0 if summary["eval_after"] is not None else 1
    except KeyboardInterrupt:
        print("\nInterrupted.", file=out)
        return 130
    except RuntimeError as exc:
        print(f"polis demo: {exc}", file=sys.stderr)
        return 1
    finally:
        swarm.stop()
        if not keep:
            shutil.rmtree(run_dir, ignore_errors=True)


def _watch(swarm: DemoSwarm, args: argparse.Namespace, started: float, out,
           version_times: VersionTimes) -> dict[str, Any]:
    budget_s = args.minutes * 60.0
    finish_sent = False
    token_marks: deque[tuple[float, float]] = deque([(time.monotonic(), 0.0)])  # (when, tokens credited)
    evals = EvalClock()
    stats = swarm.stats()
    last_print = 0.0
    while True:
        time.sleep(1.0)
        for proc in swarm.procs[:1]:
            if proc.poll() is not None:
                raise RuntimeError(f"the coordinator exited; see {swarm.run_dir / 'coordinator.log'}")
        stats = swarm.stats()
        now = time.monotonic()
        version_times.see(stats["version"], now)
        evals.see(bool(stats["eval_running"]), now)
        elapsed = now - started
        if not args.quiet and now - last_print >= 5.0:
            # tokens are credited when a job's result is accepted (a real model's job takes seconds): a rate
            # over the last half minute, not since the last line
            token_marks.append((now, stats["credit_totals"]["tokens_generated"]))  # verified by the coordinator
            while len(token_marks) > 2 and now - token_marks[1][0] >= TOKEN_RATE_WINDOW_S:
                token_marks.popleft()
            (t0, n0), (t1, n1) = token_marks[0], token_marks[-1]
            rate = (n1 - n0) / max(t1 - t0, 1e-6)
            print(_progress_line(stats, elapsed, rate), file=out, flush=True)
            last_print = now
        if not finish_sent and (elapsed >= budget_s or stats["finished"]):
            swarm.finish()
            finish_sent = True
            final_version = stats["version"]
            print(f"Training ends at version {final_version}; final held-out eval...", file=out, flush=True)
        if finish_sent:
            done = [e for e in stats["evals"] if e["version"] >= final_version and e["version"] > 0]
            if (done or final_version == 0 and stats["evals"]) and not stats["eval_running"]:
                return stats  # no step at all (e.g. every group had one reward): version 0 is the final policy
            if elapsed > budget_s + evals.final_allowance_s():
                raise RuntimeError(f"the final eval did not finish within {evals.final_allowance_s():.0f} s "
                                   f"(the longest eval of this run took {evals.longest_s:.0f} s)")


class EvalClock:
    """How long this run's held-out evals take, from the coordinator's ``eval_running`` as polled: the
    final eval gets ``FINAL_EVAL_MIN_S`` or twice the longest seen, whichever is more (a multi-turn
    eval of a real model takes minutes, the tiny base's a second)."""

    def __init__(self) -> None:
        self.longest_s = 0.0
        self._since: float | None = None

    def see(self, running: bool, now: float) -> None:
        if running and self._since is None:
            self._since = now
        elif not running and self._since is not None:
            self.longest_s, self._since = max(self.longest_s, now - self._since), None

    def final_allowance_s(self) -> float:
        return max(FINAL_EVAL_MIN_S, 2.0 * self.longest_s)


def _summary(stats: dict[str, Any], seconds: float, args: argparse.Namespace,
             version_times: VersionTimes | None = None) -> dict[str, Any]:
    version_times = version_times or VersionTimes()
    evals = stats["evals"]
    first = next((e for e in evals if e["version"] == 0), None)
    last = evals[-1] if evals and (evals[-1]["version"] > 0 or stats["version"] == 0) else None
    counts = stats["rollouts"]
    steps = stats["steps"]
    return {
        "eval_before": first and first["accuracy"], "eval_after": last and last["accuracy"],
        "eval_before_content": first and first.get("content"), "eval_after_content": last and last.get("content"),
        "eval_after_version": last and last["version"],  # a step in flight at the end may land after it
        "model": stats.get("model"), "lora_rank": stats.get("lora_rank"), "seconds": round(seconds, 1),
        # the coordinator's view of the last steps: seconds from taking the batch to the new version
        # (training micro-batches through the pipeline + the replicas' apply), and what generation made
        "step_seconds_mean": _mean_key(steps, "seconds"),
        # its split: the micro-batches' forward+backward through the stages, then the apply step
        # (the replicas' gradient exchange, the optimiser step, the acknowledgements)
        "step_train_seconds_mean": _mean_key(steps, "train_s"),
        "step_apply_seconds_mean": _mean_key(steps, "apply_s"),
        # wall clock between consecutive versions, seen by this process (generation waits and evals included)
        "seconds_per_version": version_times.seconds_per_version(),
        "samples_trained": stats["samples_trained"],
        # a training generation job (prompts_per_job x group_size rows), dispatch to last token, jobs overlapping
        "train_job_seconds_mean": _mean_of(stats["counters"], "train"),
        "eval_job_seconds_mean": _mean_of(stats["counters"], "eval"),
        "nodes": args.stages * args.replicas, "stages": args.stages, "versions": stats["version"],
        "rollouts_lost": max(0, stats["received_rollouts"] - sum(counts.values())),
        "rollouts": counts, "bytes_on_wire": int(bytes_on_wire(stats)),
        "tokens_generated": int(stats["credit_totals"]["tokens_generated"]),
        "update_bytes_ratio_vs_dense": (stats["update_bytes"] / stats["dense_update_bytes"]
                                        if stats["dense_update_bytes"] else None),
        "staleness_histogram": stats["staleness_histogram"], "task": stats["task"],
        "eval_curve": [[e["version"], e["accuracy"], e.get("content")] for e in evals],
        **_episode_summary(stats, steps),
    }


def _episode_summary(stats: dict[str, Any], steps: list) -> dict[str, Any]:
    """Turns, tool calls, the monitor's figures and the time split of the run's episodes (``--env``)."""
    monitor = stats.get("monitor") or {}
    if not stats.get("env"):
        return {}
    counters = stats["counters"]
    episodes = max(counters.get("reward_count", 0), 1)
    return {"env": stats["env"], "mean_turns": monitor.get("mean_turns"),
            "mean_tool_calls": monitor.get("mean_tool_calls"), "monitor": monitor,
            # seconds per training episode: generation (its jobs' wall time over the episodes they carried,
            # jobs overlapping), tool (in the environment), training (step time over the episodes trained)
            "episode_seconds": {"generation": round(counters.get("train_job_seconds", 0.0) / episodes, 3),
                                "tool": monitor.get("mean_tool_s"),
                                "stepping": round(counters.get("episode_step_seconds", 0.0) / episodes, 4),
                                "training": round(sum(s["seconds"] for s in steps) /
                                                  max(sum(s.get("samples", 0) for s in steps), 1), 3)},
            "turns_from_cache": counters.get("turns_from_cache", 0),
            "turns_recomputed": counters.get("turns_recomputed", 0)}


def tool_warm_up(args: argparse.Namespace, out) -> dict[str, Any]:
    """Warm the run's base up on tool transcripts (``engine.rl.tool_warmup``, cached in the user data dir)
    and point the run at the warmed checkpoint (``model=<its directory>``); returns its figures."""
    from dataclasses import asdict

    from engine.paths import user_data_dir
    from engine.rl.tool_warmup import WarmupSettings, cached_warm_up
    from engine.swarm.run_config import RunConfig, apply_overrides
    from engine.swarm.stage_loading import base_dir

    run = apply_overrides(RunConfig(), args.set)
    settings = WarmupSettings(steps=args.warmup_steps, lora_rank=run.lora.rank, lora_alpha=float(run.lora.alpha),
                              max_new_tokens=run.sampling.max_new_tokens)
    base = base_dir(args.checkpoint, run.model)
    print(f"Tool warm-up of {base.name} ({settings.steps} SFT steps of {settings.batch_size} calculator "
          "transcripts; done once, then reused)...", file=out, flush=True)
    directory, report = cached_warm_up(base, run.task, run.env, settings, user_data_dir() / "warmups",
                                       progress=lambda line: print(line, file=out, flush=True))
    args.set = [*args.set, f"model={directory}"]
    figures = {k: v for k, v in report.to_dict().items() if k not in ("settings", "losses")}
    return {**figures, "dir": str(directory), "settings": asdict(settings), "first_loss": report.losses[:1],
            "last_loss": report.losses[-1:]}


def _without_tool(run_dir: Path, out, *, trained: bool = False) -> dict[str, Any] | None:
    """A policy on the same held-out questions without the tool (its plain task: one turn, greedy).

    ``trained=False``: RL's start (the run's base checkpoint). ``trained=True``: the newest version
    every stage checkpointed, exported (adapters merged) to ``run_dir/export-without-tool``; None when
    no trained version was checkpointed, or the export failed (said on ``out``)."""
    from engine.model.errors import CheckpointError
    from engine.model.export.hf_export import export_version
    from engine.rl.checkpoint_eval import evaluate_checkpoint
    from engine.swarm.run_config import run_config_from_dict
    from engine.swarm.store import Store

    store = Store(run_dir / "coordinator.db")
    try:
        run, base = run_config_from_dict(store.get_meta("run")), store.get_meta("base_checkpoint")
    finally:
        store.close()
    version = 0
    if trained:
        try:
            result = export_version(run_dir, run_dir / "export-without-tool", overwrite=True)
        except CheckpointError as exc:
            print(f"No trained checkpoint to score without the tool: {exc}", file=out, flush=True)
            return None
        base, version = str(result.out_dir), result.version
    print(f"Scoring version {version} on the same held-out questions without the tool...", file=out, flush=True)
    scored = evaluate_checkpoint(base, run.task)
    return {"strict": scored.strict, "content": scored.content, "items": scored.items, "seconds": scored.seconds,
            "version": version}


def _mean_key(rows: list[dict[str, Any]], key: str) -> float | None:
    values = [r[key] for r in rows if key in r]
    return round(sum(values) / len(values), 2) if values else None


class VersionTimes:
    """When this process first saw each policy version (monotonic seconds), for the cost of a version."""

    def __init__(self) -> None:
        self.first_seen: dict[int, float] = {}

    def see(self, version: int, now: float) -> None:
        self.first_seen.setdefault(version, now)

    def seconds_per_version(self) -> float | None:
        """Mean seconds from version 1 to the last version seen (None before two versions)."""
        trained = sorted(v for v in self.first_seen if v >= 1)
        if len(trained) < 2:
            return None
        first, last = trained[0], trained[-1]
        return round((self.first_seen[last] - self.first_seen[first]) / (last - first), 1)


def _mean_of(counters: dict[str, Any], kind: str) -> float | None:
    done = counters.get(f"{kind}_jobs_done", 0)
    return round(counters.get(f"{kind}_job_seconds", 0.0) / done, 2) if done else None


def _print_table(summary: dict[str, Any], stats: dict[str, Any], out) -> None:
    before, after = summary["eval_before"], summary["eval_after"]
    fmt = lambda x: "n/a" if x is None else f"{100 * x:5.1f} %"  # noqa: E731
    print("", file=out)
    chat = ":" in summary["task"] or summary["task"] == "mixture"
    measure = "strict score (answer in <answer> tags)" if chat else "exact match"
    print(f"Held-out {measure} on '{summary['task']}' ({stats['evals'][-1]['n'] if stats['evals'] else 0} "
          "prompts, greedy):", file=out)
    print(f"  before RL (version 0)      {fmt(before)}", file=out)
    after_version = summary["eval_after_version"] or summary["versions"]
    print(f"  after RL  (version {after_version:<4d})   {fmt(after)}", file=out)
    if before is not None and after is not None:
        print(f"  change                     {100 * (after - before):+5.1f} points", file=out)
    if chat:
        b, a = summary["eval_before_content"], summary["eval_after_content"]
        print(f"  content only (the stated answer, tags ignored): {fmt(b)} -> {fmt(a)}", file=out)
    if summary.get("env"):
        plain = summary.get("eval_without_tool_before") or {}
        print(f"  RL's start without the tool (same questions)  {fmt(plain.get('strict'))}", file=out)
        plain = summary.get("eval_without_tool_after") or {}
        print(f"  after RL without the tool (version {plain.get('version', '-')})     {fmt(plain.get('strict'))}",
              file=out)
        warm = summary.get("warmup")
        if warm:
            b, w, nt = warm.get("before") or {}, warm.get("after") or {}, warm.get("base_without_tool") or {}
            print(f"Tool warm-up ({warm['steps']} SFT steps, {warm['seconds']:.0f} s"
                  f"{', reused from cache' if warm['reused'] else ''}) on {b.get('episodes', 0)} held-out episodes: "
                  f"base {fmt(b.get('strict'))} with {b.get('tool_calls_per_episode', 0):.2f} tool calls each "
                  f"({fmt(nt.get('strict'))} without the tool) -> warmed {fmt(w.get('strict'))} with "
                  f"{w.get('tool_calls_per_episode', 0):.2f}", file=out)
        print(f"Episodes: {summary['mean_turns']} turns and {summary['mean_tool_calls']} tool calls each (latest "
              f"{(summary['monitor'] or {}).get('episodes', 0)}); seconds each: {summary['episode_seconds']}; "
              f"monitor tells on: {(summary['monitor'] or {}).get('suspicious') or 'none'}", file=out)
    print(f"Run: {summary['seconds']:.0f} s, {summary['nodes']} nodes, {summary['stages']} stages, "
          f"{summary['tokens_generated']} tokens generated, {summary['bytes_on_wire'] / 1e6:.1f} MB on the wire, "
          f"rollouts lost: {summary['rollouts_lost']}", file=out)
    if summary["step_seconds_mean"] is not None:
        print(f"Per version: {summary['seconds_per_version'] or 'n/a'} s wall clock; a step "
              f"{summary['step_seconds_mean']} s = training pass {summary['step_train_seconds_mean']} s + apply "
              f"{summary['step_apply_seconds_mean']} s; a generation job {summary['train_job_seconds_mean']} s",
              file=out)
