"""The window against a REAL node in a real local swarm (coordinator + one helper node over WebRTC).

Start launches ``polis node --control stdio --coordinator URL`` as a child process;
the cards and charts fill from its events; the upload cap set in the settings holds
the node's measured upload rate under the cap; Pause ends the node cleanly.
"""

from __future__ import annotations

import time
from dataclasses import replace

import pytest
from PySide6.QtCore import Qt

from app.contribution import ContributionLedger
from app.main_window import MainWindow
from app.node_controller import NodeController
from app.settings import load_settings, save_settings
from engine.control_protocol import LIMIT_FIELDS
from engine.self_command import polis_command
from tests.integration.swarm_harness import Swarm

pytestmark = [pytest.mark.network, pytest.mark.slow]

UPLOAD_CAP_MBPS = 0.4


def test_start_runs_a_real_node_whose_events_fill_the_window_under_the_upload_cap(qtbot, tmp_path, store):
    swarm = Swarm(tmp_path / "swarm", settings=["prompts_per_step=4", "eval_every_versions=2"])
    (tmp_path / "swarm").mkdir()
    try:
        swarm.start_coordinator()
        swarm.start_node("helper")
        limits = {name: None for name in LIMIT_FIELDS} | {"upload_mbps": UPLOAD_CAP_MBPS, "cpu_threads": 1}
        settings = replace(load_settings(store), consent_given=True, swarm_mode="coordinator",
                           coordinator_url=swarm.url, limits=limits)
        save_settings(store, settings)
        controller = NodeController(polis_command("node"), log_path=tmp_path / "logs" / "node.log",
                                    stop_timeout_s=10.0, kill_timeout_s=3.0)
        window = MainWindow(store, controller=controller, ledger=ContributionLedger(tmp_path / "c.json"),
                            log_dir=tmp_path / "logs", tray_available=False, schedule_interval_s=60.0)
        qtbot.addWidget(window)
        window.show()
        stats = []
        controller.stats_received.connect(stats.append)
        qtbot.mouseClick(window.hero.button, Qt.MouseButton.LeftButton)
        qtbot.waitUntil(lambda: window.display_state == "contributing", timeout=120_000)
        qtbot.waitUntil(lambda: window.ledger.session["tokens_generated"] > 0, timeout=120_000)
        qtbot.waitUntil(lambda: window.swarm_chart.point_count() > 0 and bool(window.pipeline.stages),
                        timeout=120_000)
        assert window.controller.hello["backend"] in ("torch", "mlx")
        assert window.swarm_panel.values["stage"].text().startswith("layers")
        assert sum(stage.mine for stage in window.pipeline.stages) == 1

        # the cap holds: upload rate over a window of steady work stays under it (plus the burst allowance)
        first = stats[-1]
        start = time.monotonic()
        qtbot.wait(15_000)
        last = stats[-1]
        rate_mbps = 8 * (last["bytes_sent"] - first["bytes_sent"]) / 1e6 / (time.monotonic() - start)
        assert last["bytes_sent"] > first["bytes_sent"]
        assert rate_mbps <= UPLOAD_CAP_MBPS * 1.3, f"upload {rate_mbps:.2f} Mbit/s over a {UPLOAD_CAP_MBPS} cap"

        qtbot.mouseClick(window.hero.button, Qt.MouseButton.LeftButton)  # Pause
        qtbot.waitUntil(lambda: not window.controller.is_running, timeout=30_000)
        window.controller.kill_now()
    finally:
        swarm.stop()
