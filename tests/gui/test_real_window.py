"""The real-window check (tests/gui/real_window.py) as a slow test: the app under Xvfb, alone on
the LAN, then the local demo until held-out accuracy rises; nothing it started is left."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from tests.gui.real_window import SHOTS, missing_tools

pytestmark = [pytest.mark.slow, pytest.mark.network, pytest.mark.timeout(1300)]
REPO = Path(__file__).resolve().parents[2]


@pytest.mark.skipif(not sys.platform.startswith("linux") or bool(missing_tools()),
                    reason=f"needs Linux with Xvfb and ImageMagick's import (missing: {', '.join(missing_tools())})")
def test_a_real_window_waits_alone_runs_the_demo_learns_and_leaves_no_process(tmp_path):
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    done = subprocess.run([sys.executable, str(REPO / "tests" / "gui" / "real_window.py"), "--out", str(tmp_path),
                           "--rise-timeout-s", "600"], cwd=REPO, env=env, capture_output=True, text=True,
                          timeout=1200)
    summary = json.loads(done.stdout.strip().splitlines()[-1])
    assert done.returncode == 0 and summary["ok"], summary
    assert all(summary["checks"].values()) and summary["processes_left"] == 0
    assert summary["time_to_window_s"] < summary["time_to_first_token_s"] < summary["time_to_first_rise_s"]
    assert all((tmp_path / name).stat().st_size > 10_000 for name in SHOTS)
