"""The Overview tab: the Start/Pause card, swarm status, contribution cards, charts, samples and pipeline.

Shows the run state's view (status line, button, swarm fields), and turns
already-parsed node events (``status``, ``stats``, ``swarm``) and the contribution
totals into the cards, charts and pipeline. It does not know the node
process, the settings store or the window's actions (the big button is a signal).
"""

from __future__ import annotations

from typing import Any, Callable, Mapping

from PySide6.QtWidgets import QGridLayout, QHBoxLayout, QVBoxLayout, QWidget

from app import formatting
from app.run_state import RunView
from app.widgets.charts import SwarmProgressChart, ThroughputChart
from app.widgets.hero import HeroCard
from app.widgets.pipeline_view import PipelineView
from app.widgets.samples_view import SamplesPanel
from app.widgets.stat_card import StatCard
from app.widgets.swarm_status import SwarmStatusPanel

#: card key (a counter of the ``stats`` event) -> (title, tooltip, formatter)
CARDS: dict[str, tuple[str, str, Callable[[float], str]]] = {
    "tokens_generated": ("Tokens generated", "Tokens your stage helped generate for rollouts", formatting.count),
    "microbatches_trained": ("Micro-batches trained", "Training micro-batches your stage processed",
                             formatting.count),
    "bytes_sent": ("Data sent", "Activations and updates sent to other computers", formatting.data_size),
    "bytes_received": ("Data received", "Activations and updates received", formatting.data_size),
    "uptime_s": ("Time contributing", "Time your computer spent generating or training (waiting does not count)",
                 formatting.duration),
    "points": ("Points", "Points this computer counts for its own work (tokens / 100 + micro-batches); "
                         "what the coordinator verified is under Credited", formatting.count),
}


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
        charts.addWidget(self.swarm_chart, 1)  # equal halves, whatever their legends say
        charts.addWidget(self.throughput_chart, 1)
        grid.addLayout(charts, 1)
        self.samples = SamplesPanel()  # the model, the task and what it writes now
        grid.addWidget(self.samples)
        self.pipeline = PipelineView()
        grid.addWidget(self.pipeline)

    def show_view(self, view: RunView) -> None:
        """The run's words and figures (``app.run_state``): hero card and swarm panel agree by construction."""
        self.hero.show_view(view)
        self.swarm_panel.show_view(view)
        if not view.running:
            self.pipeline.set_stages([])

    def show_status(self, status: Mapping[str, Any]) -> None:
        self.swarm_panel.update_status(status)

    def show_stats(self, stats: Mapping[str, Any], session: Mapping[str, float],
                   all_time: Mapping[str, float]) -> None:
        self.show_totals(session, all_time)
        self.swarm_panel.set_policy(stats.get("policy_version"))
        rate = stats.get("tokens_per_s")
        if isinstance(rate, (int, float)) and not isinstance(rate, bool):
            self.throughput_chart.add_sample(float(rate))

    def show_totals(self, session: Mapping[str, float], all_time: Mapping[str, float]) -> None:
        for key, (_, _, fmt) in CARDS.items():
            self.cards[key].set_values(fmt(session[key]), fmt(all_time[key]))

    def show_swarm(self, swarm: Mapping[str, Any]) -> None:
        self.swarm_chart.set_data(swarm.get("eval"), swarm.get("reward"), task=swarm.get("task"))
        self.pipeline.set_stages(swarm.get("stages"))
        self.samples.show_swarm(swarm)
        self.swarm_panel.show_credit(swarm.get("credit"))
