"""Inside the real-window check (``tests/gui/real_window.py``): opens the app's window on the
Xvfb display and walks it through the scenario step by step, checking what it shows.

Runs in its own process (started by ``real_window.py`` with an isolated user and a
marker in its environment); writes a JSON summary; exit code 0 only if every step held.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import time
from pathlib import Path
from typing import Any, Callable

T0 = float(os.environ.get("POLIS_REAL_WINDOW_T0") or time.time())  # when `polis` was launched
SHOT_NAMES = ("real-window-1-ready.png", "real-window-2-alone-waiting.png", "real-window-3-demo-contributing.png",
              "real-window-4-learning.png", "real-window-5-log.png")


def _since_launch() -> float:
    return round(time.time() - T0, 1)


class Scenario:
    """The steps, each a (name, condition, action, timeout_s); polled on a Qt timer."""

    def __init__(self, app, window, out: Path, rise_timeout_s: float, learn_for_s: float = 0.0) -> None:
        self.app, self.window, self.out = app, window, out
        self.summary: dict[str, Any] = {"ok": False, "checks": {}, "screenshots": []}
        self.evals: list[dict] = []
        self.versions: list[int] = []
        window.controller.swarm_received.connect(self._on_swarm)
        self.steps: list[tuple[str, Callable[[], bool], Callable[[], None], float]] = [
            ("window shown", lambda: window.isVisible() and window.windowHandle() is not None
             and window.windowHandle().isExposed(), self._ready, 60),
            ("alone on the LAN: waiting for stage 2", lambda: window.display_state == "waiting_for_peers",
             self._alone, 180),
            ("demo: first tokens", lambda: window.ledger.session["tokens_generated"] > 0, self._first_token, 420),
            ("demo: contributing (green)", lambda: window.display_state == "contributing", self._contributing, 120),
            ("policy version moved and held-out accuracy rose", self._risen, self._rose, rise_timeout_s),
            (f"learning until {learn_for_s:.0f} s after the demo click",
             lambda: _since_launch() - self.summary["demo_clicked_s"] >= learn_for_s, self._learning,
             learn_for_s + 60),
        ]
        self.step_started = time.monotonic()

    # -- helpers ---------------------------------------------------------------------------

    def shot(self, index: int) -> None:
        from PySide6.QtTest import QTest

        QTest.qWait(400)  # let the last paint reach the X server
        path = self.out / SHOT_NAMES[index]
        subprocess.run(["import", "-window", "root", str(path)], check=True, timeout=30)
        self.summary["screenshots"].append(str(path))

    def click(self, widget) -> None:
        from PySide6.QtCore import Qt
        from PySide6.QtTest import QTest

        QTest.mouseClick(widget, Qt.MouseButton.LeftButton)

    def check(self, name: str, condition: bool, detail: str = "") -> None:
        self.summary["checks"][name] = bool(condition)
        if not condition:
            raise AssertionError(f"{name}: {detail}")

    def _on_swarm(self, swarm: dict) -> None:
        version = swarm.get("policy_version")
        if isinstance(version, int):
            self.versions.append(version)
        evals = swarm.get("eval")
        if isinstance(evals, list):
            self.evals = evals

    def _risen(self) -> bool:
        first = next((e for e in self.evals if e.get("version") == 0), None)
        later = [e for e in self.evals if isinstance(e.get("version"), int) and e["version"] > 0]
        if first is None or not later or len(set(self.versions)) < 2:
            return False
        return later[-1]["accuracy"] >= first["accuracy"] + 0.05

    # -- actions ---------------------------------------------------------------------------

    def _ready(self) -> None:
        self.window.move(0, 0)
        self.summary["time_to_window_s"] = _since_launch()
        self.check("ready: not green, offers Start", self.window.view.color != "good"
                   and self.window.view.button == "start")
        self.shot(0)
        self.click(self.window.hero.button)
        self.summary["start_clicked_s"] = _since_launch()

    def _alone(self) -> None:
        from PySide6.QtTest import QTest

        QTest.qWait(6000)  # a few stats events with nothing to do: still amber, no time counted
        view = self.window.view
        self.summary["alone_headline"] = view.headline
        self.check("alone: headline names stage 2 and the network",
                   view.headline == "Waiting for a computer to serve stage 2 — none found on your network",
                   view.headline)
        self.check("alone: never green", view.color != "good", view.color)
        self.check("alone: no time counted", self.window.ledger.session["uptime_s"] == 0,
                   str(self.window.ledger.session["uptime_s"]))
        self.check("alone: offers the local demo", self.window.hero.action_button.isVisible())
        self.shot(1)
        self.click(self.window.hero.action_button)
        self.summary["demo_clicked_s"] = _since_launch()

    def _first_token(self) -> None:
        self.summary["time_to_first_token_s"] = _since_launch()
        self.summary["first_token_after_demo_click_s"] = round(_since_launch() - self.summary["demo_clicked_s"], 1)

    def _contributing(self) -> None:
        from PySide6.QtTest import QTest

        QTest.qWait(15000)  # let the cards, the throughput chart and the pipeline fill
        panel = self.window.swarm_panel.values
        self.summary["contributing_labels"] = {key: label.text() for key, label in panel.items()}
        self.check("demo: swarm card says the demo", panel["swarm"].text().startswith("Local demo swarm"),
                   panel["swarm"].text())
        replicas = sum(stage.replicas for stage in self.window.pipeline.stages)
        self.check("demo: peers agree with the pipeline", panel["peers"].text() == str(replicas - 1),
                   f"{panel['peers'].text()} vs {replicas} replicas")
        self.check("demo: four nodes in the pipeline", replicas == 4, str(replicas))
        self.shot(2)

    def _rose(self) -> None:
        self.summary["time_to_first_rise_s"] = _since_launch()
        self.summary["first_rise_after_demo_click_s"] = round(_since_launch() - self.summary["demo_clicked_s"], 1)
        self.summary["first_rise"] = [[e["version"], e["accuracy"]] for e in self.evals[-1:]]

    def _learning(self) -> None:
        from PySide6.QtTest import QTest

        QTest.qWait(3000)
        self.summary["eval_curve"] = [[e["version"], e["accuracy"]] for e in self.evals]
        self.summary["learned_for_s"] = round(_since_launch() - self.summary["demo_clicked_s"], 1)
        self.check("learning: the window is green", self.window.display_state == "contributing",
                   self.window.view.headline)
        self.check("learning: the chart labels the latest values", len(self.window.swarm_chart.latest_labels) == 2)
        self.shot(3)
        self.window.tabs.setCurrentWidget(self.window.log_view)
        shown = self.window.log_view.shown_lines()
        self.check("log: no stream prefix, library chatter or false errors",
                   not any("STDERR" in line.upper() or "aioice" in line or "Error:" in line for line in shown),
                   "\n".join(shown[-20:]))
        self.shot(4)
        self.window.tabs.setCurrentIndex(0)
        self.summary["ok"] = True

    # -- the loop --------------------------------------------------------------------------

    def poll(self) -> None:
        if not self.steps:
            return
        name, condition, action, timeout_s = self.steps[0]
        try:
            if condition():
                self.steps.pop(0)
                action()
                self.step_started = time.monotonic()
            elif time.monotonic() - self.step_started > timeout_s:
                raise AssertionError(f"timed out after {timeout_s:.0f} s waiting for: {name} "
                                     f"(window says: {self.window.view.headline})")
        except Exception as exc:  # noqa: BLE001 - any failure ends the run with a picture and the reason
            self.summary["error"] = str(exc)
            self.steps.clear()
            try:
                subprocess.run(["import", "-window", "root", str(self.out / "real-window-failed.png")], timeout=30)
            except (OSError, subprocess.SubprocessError):
                pass
        if not self.steps:
            self.quit()

    def quit(self) -> None:
        self.summary["quit_clicked_s"] = _since_launch()
        self.window.quit_app()


def drive(out: Path, summary_path: Path, rise_timeout_s: float, learn_for_s: float = 0.0) -> int:
    from PySide6.QtCore import QTimer

    from app.main import add_arguments, build_window

    parser = argparse.ArgumentParser()
    add_arguments(parser)
    app, window = build_window(parser.parse_args(["--size", "1440x900"]))
    scenario = Scenario(app, window, out, rise_timeout_s, learn_for_s)
    timer = QTimer(window)
    timer.timeout.connect(scenario.poll)
    timer.start(250)
    app.aboutToQuit.connect(window.controller.kill_now)
    app.exec()
    scenario.summary["exited_s"] = _since_launch()
    summary_path.write_text(json.dumps(scenario.summary))
    return 0 if scenario.summary["ok"] else 1
