"""What a node tells others about itself: counters to the coordinator, events to its supervisor.

* every ``report_every_s`` while connected: the counters since the last report
  (``report``) to the coordinator, and a ``stats`` event (work, bytes, compute
  utilisation) to the supervisor (the GUI or a log);
* every third report: a ``swarm`` event with swarm-wide figures and the credit the coordinator
  gives this node (work it observed or verified, unlike the node's own counters), polled from
  the coordinator's public stats API over one reused HTTP session (closed at stop);
* on any change a user sees: a ``status`` event (state, stage, peers, limits).

It also expires jobs untouched for ``JOB_TTL_S`` (through ``expire``), once per report, and
remembers the node's measured uplink in its data directory (:func:`remember_uplink`), which its
next hello claims (:func:`remembered_uplink`): the coordinator places a node on a slow uplink by
it from its next join on (``engine.swarm.bandwidth_placement``).
What it does not know: what the jobs are, how messages travel.
"""

from __future__ import annotations

import asyncio
import json
import logging
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import aiohttp

from engine.atomic_file import atomic_write_text
from engine.control_protocol import CreditRow
from engine.swarm.messages import MAX_PEERS, Report
from engine.swarm.node_context import NodeContext

log = logging.getLogger(__name__)

#: generation caches / training slots untouched this long are freed (seconds)
JOB_TTL_S = 120.0
#: longest a stats poll of the coordinator may take (seconds)
STATS_TIMEOUT_S = 5.0
#: the most recent evaluations / versions / sample completions passed on in a ``swarm`` event
MAX_EVALS, MAX_VERSIONS, MAX_SAMPLES = 200, 500, 4
#: longest sample text passed on (characters; the protocol's Text cap is 1000)
MAX_SAMPLE_CHARS = 400
#: turns of a multi-turn sample the event carries (the last ones)
MAX_SAMPLE_TURNS = 8
#: the verified counters a ``swarm`` event carries
CREDIT_FIELDS = CreditRow.__struct_fields__
#: file in the node's data directory that remembers its measured uplink
UPLINK_FILE = "uplink.json"
#: a remembered uplink older than this is not claimed (seconds: the machine may have moved)
UPLINK_MEMORY_S = 24 * 3600.0
#: the remembered figure is rewritten when the measurement moves by more than this fraction
UPLINK_REWRITE_FRACTION = 0.1


def remembered_uplink(data_dir: Path) -> float | None:
    """The uplink (Mbit/s) this node measured in the last ``UPLINK_MEMORY_S``, or None."""
    try:
        saved = json.loads((data_dir / UPLINK_FILE).read_text())
        mbps, at = float(saved["uplink_mbps"]), float(saved["measured_at"])
    except (OSError, ValueError, KeyError, TypeError):
        return None
    return mbps if mbps > 0 and 0 <= time.time() - at <= UPLINK_MEMORY_S else None


def remember_uplink(data_dir: Path, mbps: float) -> None:
    """Keep ``mbps`` for the next hello (a failed write only costs that advice)."""
    try:
        data_dir.mkdir(parents=True, exist_ok=True)
        atomic_write_text(data_dir / UPLINK_FILE, json.dumps({"uplink_mbps": mbps, "measured_at": time.time()}))
    except OSError as exc:
        log.debug("could not remember the uplink: %s", exc)


class NodeStatus:
    """Reports and events of one node."""

    def __init__(self, ctx: NodeContext, *, coordinator_url: str, report_every_s: float,
                 emit: Callable[..., None], bytes_moved: Callable[[], tuple[float, float]],
                 link_count: Callable[[], int], expire: Callable[[float], None],
                 limits: dict[str, Any], link_rtt_ms: Callable[[], dict[str, float]] = dict,
                 send_rates: Callable[[], dict[str, Any]] = dict, data_dir: Path | None = None) -> None:
        self.ctx = ctx
        self.coordinator_url = coordinator_url
        self.report_every_s = report_every_s
        self.emit = emit
        self.bytes_moved = bytes_moved
        self.link_count = link_count
        self.link_rtt_ms = link_rtt_ms
        self.send_rates = send_rates
        self.data_dir = data_dir  #: where the measured uplink is remembered (None: nowhere)
        self._remembered_mbps = 0.0
        self.expire = expire
        self.limits = limits
        self.state = "idle"
        self._started = time.monotonic()
        self._reported = {"tokens_generated": 0.0, "microbatches_trained": 0.0, "bytes_sent": 0.0,
                          "bytes_received": 0.0, "uptime_s": 0.0,
                          "gen_compute_s": 0.0, "gen_steps": 0.0}
        self._http: aiohttp.ClientSession | None = None

    def set_state(self, state: str, detail: str) -> None:
        self.state = state
        self.emit("state", state=state, detail=detail)

    async def close(self) -> None:
        if self._http is not None:
            await self._http.close()
            self._http = None

    # ------------------------------------------------------------------ periodic
    async def report_loop(self) -> None:
        """While connected: report, emit stats, expire stale jobs; poll swarm figures every third time."""
        ctx = self.ctx
        busy_before, wall_before = ctx.compute.busy_seconds, time.monotonic()
        ticks = 0
        while True:
            await asyncio.sleep(self.report_every_s)
            busy_now, wall_now = ctx.compute.busy_seconds, time.monotonic()
            busy_fraction = (busy_now - busy_before) / max(wall_now - wall_before, 1e-6)
            busy_before, wall_before = busy_now, wall_now
            log.debug("compute busy %.0f%% of the last %.1f s", 100 * busy_fraction, self.report_every_s)
            sent, received = self.bytes_moved()
            now = {"gen_compute_s": 0.0, "gen_steps": 0.0, **ctx.counters, "bytes_sent": sent,
                   "bytes_received": received, "uptime_s": time.monotonic() - self._started}
            delta = {k: max(0.0, now[k] - self._reported[k]) for k in self._reported}
            self._reported = now
            rtt = dict(sorted(self.link_rtt_ms().items())[:MAX_PEERS])
            rates = self.send_rates()
            rates["link_send_mbps"] = dict(sorted(rates.get("link_send_mbps", {}).items())[:MAX_PEERS])
            uplink = float(rates.get("uplink_mbps", 0.0))
            if self.data_dir is not None and uplink > 0 and \
                    abs(uplink - self._remembered_mbps) > UPLINK_REWRITE_FRACTION * self._remembered_mbps:
                remember_uplink(self.data_dir, uplink)
                self._remembered_mbps = uplink
            await ctx.coordinator.send(Report(**{k: float(v) for k, v in delta.items()}, link_rtt_ms=rtt, **rates))
            self.emit("stats", tokens_generated=int(now["tokens_generated"]),
                      microbatches_trained=int(now["microbatches_trained"]), bytes_sent=int(sent),
                      bytes_received=int(received), uptime_s=round(now["uptime_s"], 1),
                      points=round(now["tokens_generated"] / 100 + now["microbatches_trained"], 1),
                      policy_version=ctx.stage.rt.version, staleness_mean=None,
                      tokens_per_s=round(delta["tokens_generated"] / self.report_every_s, 1),
                      compute_busy_fraction=round(busy_fraction, 3))
            if ctx.stage.rt.backend is not None:
                self.expire(time.monotonic() - JOB_TTL_S)
            ticks += 1
            if ticks % 3 == 1:
                await self.emit_swarm()

    async def emit_swarm(self) -> None:
        """Swarm-wide figures for the supervisor, from the coordinator's stats API."""
        me = self.ctx.peer_id
        url = f"{self.coordinator_url.rstrip('/')}/api/stats?limit={MAX_VERSIONS}&peer={me}"
        if self._http is None or self._http.closed:
            self._http = aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=STATS_TIMEOUT_S))
        try:
            async with self._http.get(url) as response:
                stats = await response.json()
            steps = stats.get("steps") or []
            staleness = float(steps[-1]["staleness_mean"]) if steps else None
            self.emit("swarm", policy_version=int(stats["version"]), staleness_mean=staleness,
                      eval=[{"version": int(e["version"]), "accuracy": float(e["accuracy"]),
                             **({"content": float(e["content"])} if e.get("content") is not None else {})}
                            for e in stats["evals"][-MAX_EVALS:]],
                      model=str(stats.get("model") or "")[:200] or None,
                      model_parameters=int(stats["model_parameters"]) if stats.get("model_parameters") else None,
                      task=str(stats.get("task") or "")[:200] or None,
                      samples=[_sample(s) for s in (stats.get("samples") or [])[-MAX_SAMPLES:]],
                      monitor=_monitor(stats.get("monitor")),
                      reward=[{"version": int(v["version"]), "reward": float(v["reward"] or 0.0)}
                              for v in stats["versions"][-MAX_VERSIONS:]],
                      stages=[{"stage": int(s["stage"]), "layers": str(s["layers"]),
                               "replicas": len(s["replicas"]) + len(s.get("inference", ())),
                               "mine": me in s["replicas"] or me in s.get("inference", ())}
                              for s in stats["stages"]],
                      credit=_credit(stats.get("credit")))
        except (aiohttp.ClientError, asyncio.TimeoutError, KeyError, TypeError, ValueError) as exc:
            log.debug("no swarm stats this time: %s", exc)

    # ------------------------------------------------------------------ on change
    def emit_status(self, force: bool = False) -> None:
        """A ``status`` event (without a stage: only when ``force``, e.g. the supervisor asked)."""
        ctx, spec = self.ctx, self.ctx.stage.spec
        if spec is None:
            if force:
                self.emit("status", state=self.state, coordinator=self.coordinator_url, stage=None,
                          num_stages=None, layers=None, role=ctx.role, peers=0, policy_version=None,
                          limits=self.limits)
            return
        self.emit("status", state=self.state, coordinator=self.coordinator_url,
                  stage=spec.stage_index, num_stages=spec.num_stages,
                  layers=spec.describe(ctx.stage.num_layers), role=ctx.role,
                  peers=self.link_count(), policy_version=ctx.stage.rt.version, limits=self.limits)


def _sample(row: dict[str, Any]) -> dict[str, Any]:
    """One of the coordinator's sample completions as the ``swarm`` event carries it (text capped)."""
    turns = [{"role": str(t["role"]), "text": str(t["text"])[:MAX_SAMPLE_CHARS]} for t in (row.get("turns") or [])
             if t.get("role") in ("assistant", "tool", "user")][-MAX_SAMPLE_TURNS:]
    return {"prompt": str(row["prompt"])[-MAX_SAMPLE_CHARS:], "answer": str(row["answer"])[:MAX_SAMPLE_CHARS],
            "reward": float(row["reward"]), "version": int(row["version"]),
            **({"turns": turns, "tool_calls": int(row.get("tool_calls") or 0)} if len(turns) > 1 else {})}


def _credit(row: Any) -> dict[str, int] | None:
    """This node's verified credit as the ``swarm`` event carries it (None: the coordinator has none)."""
    if not isinstance(row, dict):
        return None
    return {name: int(row[name]) for name in CREDIT_FIELDS}


def _monitor(figures: Any) -> dict[str, Any] | None:
    """The monitor's figures as the ``swarm`` event carries them (None before any episode)."""
    if not isinstance(figures, dict) or not figures.get("episodes"):
        return None
    return {"episodes": int(figures["episodes"]), "mean_turns": float(figures["mean_turns"]),
            "mean_tool_calls": float(figures["mean_tool_calls"]),
            "commonest_share": float(figures["shortcut"]["commonest_share"]),
            "gold_share": float(figures["shortcut"]["gold_share"]),
            "turn_cut_share": float(figures["tool_loops"]["turn_cut_share"]),
            "suspicious": [str(x)[:200] for x in figures.get("suspicious", [])][:8]}
