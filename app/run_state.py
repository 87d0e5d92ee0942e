"""What the window says about this computer's run: one state machine for the status line,
the big button, the tray and the contribution cards.

It takes what happens (the user presses Start or Pause, the node process starts or
ends, the node reports ``state``/``status``/``stats``/``swarm`` events, the schedule
holds or releases the node) and answers one :class:`RunView`: the phase, its words,
its colour, the button, the one action that helps, and the figures the cards show.
Because every label is computed from the same facts, the status line, the button
and the cards cannot disagree.

Rules it enforces:

- **Green only while useful work is done.** The node says ``contributing`` as soon
  as its stage is loaded; that is not work. ``Contributing`` needs every stage of
  the pipeline served (else: "Waiting for a computer to serve stage N") and the
  node's token or micro-batch counters rising within :data:`WORK_RECENT_S`.
- **Time accrues only while working**: the interval between two ``stats`` events
  counts when a counter rose in it (points come from the counters themselves).
- **"Pause" has one meaning**: the node process ends and the computer is free
  (in demo mode the demo swarm's processes end with it). A schedule hold (the
  protocol's ``pause`` command: leave the swarm, keep the process) is shown as
  "Waiting", never as "Paused".
- Peers, layers and staleness come from the node's events only; the swarm mode
  shown is the one the running node was started with, not the saved setting.

Pure Python, no Qt, no engine: times are passed in (``now``, monotonic seconds).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any, Mapping

from app.formatting import duration

#: seconds after the last rising counter during which the node still counts as working.
WORK_RECENT_S = 45.0

#: phase -> (colour key, button label, button action, button enabled)
PHASES: dict[str, tuple[str, str, str, bool]] = {
    "ready": ("idle", "start", "start", True),
    "paused": ("idle", "start", "start", True),
    "starting": ("busy", "pause", "pause", True),
    "connecting": ("busy", "pause", "pause", True),
    "waiting_for_peers": ("warn", "pause", "pause", True),
    "waiting_for_work": ("busy", "pause", "pause", True),
    "contributing": ("good", "pause", "pause", True),
    "schedule_hold": ("warn", "pause", "pause", True),
    "stopping": ("idle", "pause", "none", False),
    "restarting": ("busy", "pause", "none", False),
    "error": ("bad", "start", "start", True),
}
MODE_WORDS = {"lan": "Local network", "coordinator": "Coordinator", "demo": "Local demo swarm"}
DEMO_ACTION = ("demo", "Run a local demo instead")
#: what starting the node in each swarm mode does, for the log.
START_WORDS = {"lan": "looking for a swarm on this network", "coordinator": "joining the coordinator you set",
               "demo": "running a local demo swarm on this computer (a coordinator and four nodes)"}


@dataclass(frozen=True)
class RunView:
    """Everything the window shows about the run, derived from one :class:`RunState`."""

    phase: str
    headline: str
    detail: str
    color: str  # idle | busy | warn | good | bad
    button: str  # start | pause
    button_action: str  # start | pause | none
    button_enabled: bool
    action: tuple[str, str] | None  # (name, label) of the one action that helps, or None
    running: bool
    swarm_words: str
    peers: str
    stage: str
    staleness: str
    summary: str


def _number(value: Any) -> float | None:
    if isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value):
        return float(value)
    return None


class RunState:
    """The facts about the current run; :meth:`view` turns them into words."""

    def __init__(self, mode: str = "lan") -> None:
        self.settings_mode = mode
        self.phase = "ready"
        self.running_mode: str | None = None
        self.node_state: str | None = None
        self.node_detail = ""
        self.hold_reason = ""
        self.error_text = ""
        self.layers: str | None = None
        self.stage: int | None = None
        self.num_stages: int | None = None
        self.stages: list[tuple[int, int, bool]] = []  # (index, replicas, mine)
        self.staleness: float | None = None
        self.tokens_per_s: float | None = None
        self.working_s = 0.0  # this run's time spent working
        self._counters: tuple[float, float] | None = None
        self._last_stats_at: float | None = None
        self._last_work_at: float | None = None

    # -- what the user and the process do ------------------------------------------------

    def set_settings_mode(self, mode: str) -> None:
        """The saved swarm setting (shown while no node runs; a running node keeps its own)."""
        self.settings_mode = mode

    def start(self, mode: str) -> None:
        self._new_run(mode)
        self.phase = "starting"

    def restart(self, mode: str) -> None:
        self._new_run(mode)
        self.phase = "restarting"

    def pause(self) -> None:
        if self.phase not in ("ready", "paused", "error"):
            self.phase = "stopping"

    def process_started(self) -> None:
        if self.phase == "restarting":
            self.phase = "starting"

    def process_stopped(self) -> None:
        """The node process ended as asked (Pause, quit) or on its own with exit code 0."""
        self._clear_run()
        if self.phase != "restarting":  # when restarting, the next process is on its way
            self.phase = "paused"

    def failed(self, words: str) -> None:
        """The node crashed or could not be launched."""
        self.phase = "error"
        self.error_text = words
        self._clear_run()

    def hold(self, reason: str) -> None:
        """The schedule asked the running node to wait (protocol ``pause``)."""
        self.hold_reason = reason
        if self.phase not in ("ready", "paused", "error", "stopping", "restarting"):
            self.phase = "schedule_hold"

    def release(self) -> None:
        self.hold_reason = ""
        if self.phase == "schedule_hold":
            self.phase = "connecting"

    # -- what the node reports -------------------------------------------------------------

    def node_event_state(self, state: str, detail: str) -> None:
        self.node_state = state
        self.node_detail = detail
        if self.phase in ("ready", "paused", "error", "stopping", "restarting"):
            return
        if self.hold_reason:
            self.phase = "schedule_hold"
        elif state in ("connecting", "loading", "idle", "paused"):
            self.phase = "connecting"
        elif state == "contributing":
            self._judge_work(None)
        elif state == "stopping":
            self.phase = "stopping"
        elif state == "error":
            self.phase = "error"
            self.error_text = detail

    def node_status(self, status: Mapping[str, Any]) -> None:
        layers = status.get("layers")
        if isinstance(layers, str) and layers:
            self.layers = layers[:40]
        stage, stages = status.get("stage"), status.get("num_stages")
        if isinstance(stage, int) and isinstance(stages, int):
            self.stage, self.num_stages = stage, stages
        state = status.get("state")
        if isinstance(state, str) and state != self.node_state:
            self.node_event_state(state, self.node_detail)

    def node_stats(self, stats: Mapping[str, Any], now: float) -> None:
        """A cumulative ``stats`` event: time counts only if a work counter rose since the last one."""
        counters = (_number(stats.get("tokens_generated")) or 0.0, _number(stats.get("microbatches_trained")) or 0.0)
        rose = self._counters is not None and (counters[0] > self._counters[0] or counters[1] > self._counters[1])
        first_work = self._counters is None and (counters[0] > 0 or counters[1] > 0)
        if rose and self._last_stats_at is not None:
            self.working_s += max(0.0, now - self._last_stats_at)
        if rose or first_work:
            self._last_work_at = now
        self._counters = counters
        self._last_stats_at = now
        self.tokens_per_s = _number(stats.get("tokens_per_s"))
        staleness = _number(stats.get("staleness_mean"))
        if staleness is not None:
            self.staleness = staleness
        self._judge_work(now)

    def node_swarm(self, swarm: Mapping[str, Any], now: float) -> None:
        items = swarm.get("stages")
        if isinstance(items, list):
            stages = []
            for item in items[:64]:
                if isinstance(item, Mapping) and isinstance(item.get("stage"), int):
                    replicas = item.get("replicas")
                    stages.append((item["stage"], replicas if isinstance(replicas, int) and replicas >= 0 else 0,
                                   item.get("mine") is True))
            self.stages = sorted(stages)
        staleness = _number(swarm.get("staleness_mean"))
        if staleness is not None:
            self.staleness = staleness
        self._judge_work(now)

    def tick(self, now: float) -> None:
        """Called now and then: work that stopped turns the green off."""
        self._judge_work(now)

    # -- the view --------------------------------------------------------------------------

    def missing_stage(self) -> int | None:
        """The first pipeline stage (0-based) no computer serves, if the swarm reported its stages."""
        for index, replicas, _ in self.stages:
            if replicas == 0:
                return index
        return None

    def peers(self) -> int | None:
        """Other computers in the swarm, counted from the pipeline the node reported."""
        if not self.stages:
            return None
        total = sum(replicas for _, replicas, _ in self.stages)
        return max(0, total - sum(1 for _, _, mine in self.stages if mine))

    def view(self) -> RunView:
        color, button, action_name, enabled = PHASES[self.phase]
        headline, detail, action = self._words()
        running = self.phase not in ("ready", "paused", "error")
        mode = self.running_mode if running and self.running_mode else self.settings_mode
        peers = self.peers()
        stage_words = "–"
        if running and self.layers:
            stage_words = self.layers
            if self.stage is not None and self.num_stages is not None:
                stage_words += f"  (stage {self.stage + 1} of {self.num_stages})"
        summary = ""
        if running and (self.working_s > 0 or self.phase == "contributing"):
            rate = f"{self.tokens_per_s:.0f} tokens/s · " if self.tokens_per_s is not None else ""
            summary = f"{rate}{duration(self.working_s)} of work this run"
        return RunView(
            phase=self.phase, headline=headline, detail=detail, color=color, button=button,
            button_action=action_name, button_enabled=enabled, action=action, running=running,
            swarm_words=MODE_WORDS.get(mode, mode),
            peers=str(peers) if running and peers is not None else "–",
            stage=stage_words,
            staleness=(f"{self.staleness:.1f} versions behind" if running and self.staleness is not None
                       else "–"),
            summary=summary)

    def _words(self) -> tuple[str, str, tuple[str, str] | None]:
        phase = self.phase
        demo_action = DEMO_ACTION if (self.running_mode or self.settings_mode) != "demo" else None
        if phase == "ready":
            return "Not contributing", "Press Start to lend this computer to the swarm.", None
        if phase == "paused":
            return "Paused", "This computer is free. Press Start to contribute again.", None
        if phase == "starting":
            return "Starting", "Launching the node…", None
        if phase == "restarting":
            return "Restarting", "Stopping the node, then starting it with the new settings…", None
        if phase == "stopping":
            return "Pausing", "Leaving the swarm and freeing this computer…", None
        if phase == "connecting":
            detail = self.node_detail or "Reaching the swarm…"
            return "Connecting", detail[0].upper() + detail[1:], None
        if phase == "schedule_hold":
            return "Waiting", f"{self.hold_reason} Polis resumes by itself when allowed.", None
        if phase == "waiting_for_peers":
            missing = self.missing_stage()
            where = {"lan": "none found on your network",
                     "coordinator": "none has joined this coordinator yet",
                     "demo": "the demo's helper nodes are still starting"}.get(self.running_mode or "", "none yet")
            stage = f"stage {missing + 1}" if missing is not None else "the rest of the pipeline"
            return (f"Waiting for a computer to serve {stage} — {where}",
                    self._serving_words() + " Nothing can be generated until every stage is served.",
                    demo_action)
        if phase == "waiting_for_work":
            return "Connected, waiting for work", self._serving_words() + " No work has reached it yet.", None
        if phase == "contributing":
            return "Contributing", self._serving_words() + " It is generating and training for the swarm.", None
        return "Needs attention", self.error_text or "See the message above.", None

    def _serving_words(self) -> str:
        return f"Your computer serves {self.layers}." if self.layers else "Your computer holds its stage."

    # -- internals -------------------------------------------------------------------------

    def _judge_work(self, now: float | None) -> None:
        """Between connected phases: contributing only with every stage served and recent work."""
        if self.phase not in ("connecting", "waiting_for_peers", "waiting_for_work", "contributing"):
            return
        if self.node_state != "contributing":
            return
        if self.missing_stage() is not None:
            self.phase = "waiting_for_peers"
            return
        recent = (self._last_work_at is not None and now is not None and now - self._last_work_at <= WORK_RECENT_S)
        if self._last_work_at is not None and now is None and self.phase == "contributing":
            recent = True  # a state event carries no time; keep the last judgement
        self.phase = "contributing" if recent else "waiting_for_work"

    def _new_run(self, mode: str) -> None:
        self._clear_run()
        self.running_mode = mode
        self.settings_mode = mode
        self.error_text = ""

    def _clear_run(self) -> None:
        self.node_state = None
        self.node_detail = ""
        self.hold_reason = ""
        self.layers = None
        self.stage = self.num_stages = None
        self.stages = []
        self.staleness = None
        self.tokens_per_s = None
        self.working_s = 0.0
        self._counters = None
        self._last_stats_at = None
        self._last_work_at = None
