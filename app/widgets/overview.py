"""The Overview tab: the Start/Pause card, swarm status, contribution cards, charts and pipeline.

Turns already-parsed node events (``status``, ``stats``, ``swarm``) and the
contribution totals into what these widgets show. It does not know the node
process, the settings store or the window's actions (the big button is a signal).
"""

from __future__ import annotations

from typing import Any, Callable, Mapping

from PySide6.QtWidgets import QGridLayout, QHBoxLayout, QVBoxLayout, QWidget

from app import formatting
from app.widgets.charts import SwarmProgressChart, ThroughputChart
from app.widgets.hero import HeroCard
from app.widgets.pipeline_view import PipelineView
from app.widgets.stat_card import StatCard
from app.widgets.swarm_status import SwarmStatusPanel

#: card key (a counter of the ``stats`` event) -> (title, tooltip, formatter)
CARDS: dict[str, tuple[str, str, Callable[[float], str]]] = {
    "tokens_generated": ("Tokens generated", "Tokens your stage helped generate for rollouts", formatting.count),
    "microbatches_trained": ("Micro-batches trained", "Training micro-batches your stage processed",
                             formatting.count),
    "bytes_sent": ("Data sent", "Activations and updates sent to other computers", formatting.data_size),
    "bytes_received": ("Data received", "Activations and updates received", formatting.data_size),
    "uptime_s": ("Time contributing", "Time your node has been part of the swarm", formatting.duration),
    "points": ("Points", "Contribution points credited by the coordinator", formatting.count),
}
SWARM_WORDS = {"lan": "Local network", "coordinator": "Coordinator", "demo": "Local demo swarm"}


class OverviewPage(QWidget):
    def __init__(self, parent: QWidget | None = None) -> None:
        super().__init__(parent)
        grid = QVBoxLayout(self)
        grid.setContentsMargins(0, 10, 0, 0)
        grid.setSpacing(14)
        top = QHBoxLayout()
        top.setSpacing(14)
        self.hero = HeroCard()
        self.swarm_panel = SwarmStatusPanel()
        top.addWidget(self.hero, 3)
        top.addWidget(self.swarm_panel, 2)
        grid.addLayout(top)
        cards = QGridLayout()
        cards.setSpacing(14)
        self.cards: dict[str, StatCard] = {}
        for i, (key, (name, tip, _)) in enumerate(CARDS.items()):
            self.cards[key] = StatCard(name, tip)
            cards.addWidget(self.cards[key], 0, i)
        grid.addLayout(cards)
        charts = QHBoxLayout()
        charts.setSpacing(14)
        self.swarm_chart = SwarmProgressChart()
        self.throughput_chart = ThroughputChart()
        charts.addWidget(self.swarm_chart)
        charts.addWidget(self.throughput_chart)
        grid.addLayout(charts, 1)
        self.pipeline = PipelineView()
        grid.addWidget(self.pipeline)
        self._serving = ""

    def set_swarm_mode(self, mode: str) -> None:
        self.swarm_panel.set_swarm_mode(SWARM_WORDS.get(mode, mode))

    def set_display_state(self, state: str, detail: str) -> None:
        self.hero.set_state(state, detail)
        if state in ("stopped", "error"):
            self.swarm_panel.clear()
            self.pipeline.set_stages([])
            self.hero.set_summary("")
            self._serving = ""

    def show_status(self, status: Mapping[str, Any]) -> None:
        self.swarm_panel.update_status(status)
        layers = status.get("layers")
        self._serving = f"serving {layers[:40]}" if isinstance(layers, str) and layers else ""

    def show_stats(self, stats: Mapping[str, Any], session: Mapping[str, float],
                   all_time: Mapping[str, float]) -> None:
        self.show_totals(session, all_time)
        self.swarm_panel.set_policy(stats.get("policy_version"), stats.get("staleness_mean"))
        rate = stats.get("tokens_per_s")
        if isinstance(rate, (int, float)) and not isinstance(rate, bool):
            self.throughput_chart.add_sample(float(rate))
            parts = [formatting.rate(rate, "tokens"), self._serving,
                     f"up {formatting.duration(session['uptime_s'])} this session"]
            self.hero.set_summary(" · ".join(p for p in parts if p))

    def show_totals(self, session: Mapping[str, float], all_time: Mapping[str, float]) -> None:
        for key, (_, _, fmt) in CARDS.items():
            self.cards[key].set_values(fmt(session[key]), fmt(all_time[key]))

    def show_swarm(self, swarm: Mapping[str, Any]) -> None:
        self.swarm_chart.set_data(swarm.get("eval"), swarm.get("reward"))
        self.pipeline.set_stages(swarm.get("stages"))
