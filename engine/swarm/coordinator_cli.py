"""``polis coordinator``: serve a swarm's coordinator until interrupted.

The run lives in ``--db`` (SQLite): starting again with the same file resumes
it (version, rollouts, evals, ledger). Run settings given on the command line
apply only when the database holds no run yet.
"""

from __future__ import annotations

import argparse
import asyncio
import logging
import signal
import sys
from dataclasses import replace

log = logging.getLogger(__name__)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--db", required=True, help="SQLite file of the run (created or resumed)")
    parser.add_argument("--checkpoint", default=None, help="base checkpoint directory (default: the shipped one)")
    parser.add_argument("--host", default="127.0.0.1", help="address to listen on (0.0.0.0 for a LAN)")
    parser.add_argument("--port", type=int, default=8700, help="port to listen on (0: any free port)")
    parser.add_argument("--stages", type=int, default=2, help="pipeline stages the model is cut into")
    parser.add_argument("--task", default=None, help="task name (reversal, sorting, addition)")
    parser.add_argument("--max-versions", type=int, default=None, help="stop training at this policy version")
    parser.add_argument("--seed", type=int, default=None)
    parser.add_argument("--admin-token-file", default=None,
                        help="write the admin token (for GET /api/admin/stats, POST /api/eval, /api/finish, "
                             "/api/export and the OpenAI-compatible /v1/chat/completions, /v1/models) to this file")
    parser.add_argument("--lan", action="store_true", help="advertise this coordinator on the LAN with zeroconf")
    parser.add_argument("--max-nodes-per-address", type=int, default=16,
                        help="most node identities admitted from one network address (identities are free)")
    parser.add_argument("--job-timeout-s", type=float, default=60.0,
                        help="re-queue a generation job unanswered this long (default 60; a real model on a CPU "
                             "needs minutes)")
    parser.add_argument("--step-timeout-s", type=float, default=120.0,
                        help="abort a training step unfinished this long (default 120)")
    parser.add_argument("--serve-deadline-s", type=float, default=180.0,
                        help="answer a /v1/chat/completions request 504 when the swarm has not served it in this "
                             "long (default 180)")
    parser.add_argument("--set", action="append", default=[], metavar="KEY=VALUE",
                        help="override a run setting, e.g. --set lr=0.001 --set task.max_digits=5 (repeatable)")


def build_config(args):
    from engine.paths import base_checkpoint_dir
    from engine.swarm.coordinator import CoordinatorConfig
    from engine.swarm.run_config import RunConfig, apply_overrides

    run = apply_overrides(RunConfig(), args.set)
    if args.task:
        run = replace(run, task=replace(run.task, name=args.task))
    if args.max_versions is not None:
        run = replace(run, max_versions=args.max_versions)
    if args.seed is not None:
        run = replace(run, seed=args.seed)
    return CoordinatorConfig(db_path=args.db, base_checkpoint=args.checkpoint or str(base_checkpoint_dir()),
                             host=args.host, port=args.port, num_stages=args.stages, run=run,
                             job_timeout_s=args.job_timeout_s, step_timeout_s=args.step_timeout_s,
                             max_nodes_per_address=args.max_nodes_per_address,
                             serve_deadline_s=args.serve_deadline_s)


async def _serve(args) -> int:
    from engine.swarm.coordinator import Coordinator

    try:
        coordinator = Coordinator(build_config(args))
    except ValueError as exc:  # a bad --set, or settings this model cannot train with
        print(f"polis coordinator: {exc}", file=sys.stderr)
        return 2
    if args.admin_token_file:  # before serving: whoever sees the coordinator answer can read its admin stats
        import os

        fd = os.open(args.admin_token_file, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
        with os.fdopen(fd, "w") as f:
            f.write(coordinator.admin_token)
    url = await coordinator.start()
    advertiser = None
    if args.lan:
        from engine import __version__
        from engine.net.discovery import DiscoveryConfig, LanAdvertiser, ServiceAdvert, reachable_address

        # advertise an address other machines can reach, never the wildcard 0.0.0.0
        discovery = DiscoveryConfig.from_env()
        if args.host.startswith("127.") and not discovery.loopback_only:
            log.warning("advertising a coordinator that listens on %s only: other machines cannot join it "
                        "(use --host 0.0.0.0)", args.host)
        url = f"http://{reachable_address(discovery, args.host)}:{url.rsplit(':', 1)[1]}"
        advertiser = LanAdvertiser(ServiceAdvert(role="coordinator", peer_id=coordinator.run_id,
                                                 signalling_url=url, version=__version__,
                                                 coordinator_key=coordinator.identity.public_key), discovery)
        await advertiser.start()
    from engine.net.identity import pin_url

    print(f"coordinator listening on {url} (run {coordinator.run_id}, version {coordinator.book.version})\n"
          f"nodes join with: polis node --coordinator '{pin_url(url, coordinator.identity.public_key)}' "
          f"(the '#key=' part pins this coordinator's key)", flush=True)
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGINT, signal.SIGTERM):
        try:
            loop.add_signal_handler(sig, stop.set)
        except (NotImplementedError, RuntimeError):
            pass
    try:
        await stop.wait()
    finally:
        if advertiser is not None:
            await advertiser.close()
        await coordinator.stop()
    return 0


def run(args) -> int:
    if args.lan:
        from engine.net.discovery import lan_env_problem

        problem = lan_env_problem()  # a bad POLIS_LAN_* value is one clear line, before anything starts
        if problem:
            print(f"polis coordinator: {problem}", file=sys.stderr)
            return 2
    try:
        return asyncio.run(_serve(args))
    except KeyboardInterrupt:
        return 0
    except OSError as exc:
        print(f"polis coordinator: cannot listen on {args.host}:{args.port}: {exc}", file=sys.stderr)
        return 1
