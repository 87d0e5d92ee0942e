"""The window shows what the coordinator credits this node with (work it observed or verified) apart
from the contribution cards (this computer's own count), from the node's ``swarm`` event."""

from __future__ import annotations

from app.widgets.overview import OverviewPage
from engine import control_protocol
from engine.swarm.node_status import _credit

ROW = {"role": "trainer", "tokens_generated": 1234, "microbatches_trained": 5, "microbatches_forward": 2,
       "steps_applied": 1, "self_reported": {"bytes_sent": 9e9}}


def test_the_swarm_panel_shows_the_coordinators_verified_credit_and_a_dash_without_one(qtbot):
    page = OverviewPage()
    qtbot.addWidget(page)
    line = control_protocol.encode_event("swarm", policy_version=3, eval=[], reward=[], stages=[],
                                         credit=_credit(ROW))
    page.show_swarm(control_protocol.parse_event(line))
    shown = page.swarm_panel.values["credit"]
    assert shown.text() == "1.23 k tokens · 5 micro-batches · 1 steps"
    assert "coordinator itself saw" in shown.toolTip()
    assert "Credited" in page.cards["points"].toolTip()  # the Points card says it is this computer's own count
    page.show_swarm(control_protocol.parse_event(control_protocol.encode_event(
        "swarm", policy_version=3, eval=[], reward=[], stages=[])))
    assert shown.text() == "–"
