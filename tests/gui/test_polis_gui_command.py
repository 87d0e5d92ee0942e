"""`polis gui` as a user runs it: a real process opens the window, starts the (scripted) node,
saves a screenshot, and on quit stops the node cleanly."""

from __future__ import annotations

import os
import shlex
import subprocess
import sys
from pathlib import Path

from PySide6.QtGui import QImage

REPO = Path(__file__).resolve().parents[2]


def test_polis_gui_opens_the_window_runs_the_node_and_quits_cleanly(tmp_path: Path, isolated_user: Path,
                                                                 node_command):
    config = isolated_user / ".config" / "Polis"
    config.mkdir(parents=True)
    (config / "Polis.ini").write_text("[first_run]\nconsent_given=true\n")
    env = {**os.environ, "QT_QPA_PLATFORM": "offscreen",
           "POLIS_NODE_COMMAND": shlex.join(node_command())}
    shot = tmp_path / "window.png"
    result = subprocess.run([sys.executable, "-m", "engine.cli", "gui", "--start", "--screenshot", str(shot),
                             "--screenshot-after-s", "2.5"],
                            cwd=REPO, env=env, capture_output=True, text=True, timeout=60)
    assert result.returncode == 0, result.stderr[-2000:]
    image = QImage(str(shot))
    assert not image.isNull() and image.width() > 600
    node_log = (tmp_path / "data" / "logs" / "node.log").read_text()
    assert "scripted node: swarm=lan" in node_log and "node exited (code 0)" in node_log
    totals = (tmp_path / "data" / "contribution.json").read_text()
    assert '"tokens_generated": 0.0' not in totals  # the node contributed and it was recorded
