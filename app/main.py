"""``polis`` / ``polis gui``: opens the desktop app (QApplication, main window, tray icon).

On Linux it first checks that the system libraries of Qt's X11 plugin are
installed (``app.qt_platform_check``) and, if not, prints the install line and
exits 1. Then it sets up the per-user settings store, the contribution totals file and the log
files in the user data directory, then runs the Qt event loop. The node itself
runs as a child process (see ``app.node_controller``). ``--screenshot`` saves an
image of the window after a delay and exits (used for the README screenshot).
"""

from __future__ import annotations

import argparse
import logging
import logging.handlers
import signal
import sys
from pathlib import Path

log = logging.getLogger(__name__)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--minimized", action="store_true",
                        help="start hidden in the system tray (used by the start-at-login entry)")
    parser.add_argument("--start", action="store_true",
                        help="start contributing right away (only if first-run consent was given)")
    parser.add_argument("--screenshot", type=Path, default=None, metavar="PNG",
                        help="save a picture of the window to PNG after --screenshot-after-s seconds, then quit")
    parser.add_argument("--screenshot-after-s", type=float, default=8.0)
    parser.add_argument("--size", default=None, metavar="WxH", help="window size in pixels, e.g. 1200x860")
    parser.add_argument("--check-system", action="store_true",
                        help="check the system libraries the window needs (Linux), print what to install, exit")


def _log_to_file(log_dir: Path) -> None:
    log_dir.mkdir(parents=True, exist_ok=True)
    handler = logging.handlers.RotatingFileHandler(log_dir / "app.log", maxBytes=2_000_000, backupCount=2,
                                                   encoding="utf-8")
    handler.setFormatter(logging.Formatter("%(asctime)s %(levelname)s %(name)s: %(message)s"))
    root = logging.getLogger()
    root.addHandler(handler)
    if root.level > logging.INFO or root.level == logging.NOTSET:
        root.setLevel(logging.INFO)


def build_window(args: argparse.Namespace):
    """The QApplication and the main window as ``polis`` opens them (shown unless ``--minimized``).

    The real-window check (``tests/gui/real_window.py``) builds the window through this too.
    """
    from PySide6.QtWidgets import QApplication

    from app.contribution import ContributionLedger
    from app.main_window import MainWindow
    from app.power_policy import IdleDetector
    from app.settings import APPLICATION, ORGANIZATION, open_qsettings
    from engine.paths import user_data_dir

    app = QApplication.instance() or QApplication(sys.argv[:1])
    app.setOrganizationName(ORGANIZATION)
    app.setApplicationName(APPLICATION)
    app.setQuitOnLastWindowClosed(False)
    data_dir = user_data_dir()
    log_dir = data_dir / "logs"
    _log_to_file(log_dir)
    window = MainWindow(open_qsettings(), ledger=ContributionLedger(data_dir / "contribution.json"),
                        log_dir=log_dir, idle_detector=IdleDetector())
    if args.size:
        width, height = (int(v) for v in args.size.lower().split("x"))
        window.resize(width, height)
    if not (args.minimized and window.tray.available):
        window.show()
    return app, window


def run(args: argparse.Namespace) -> int:
    from app import qt_platform_check

    missing = qt_platform_check.check()
    if args.check_system:
        print(qt_platform_check.message(missing) if missing else "All the system libraries the Polis window needs "
              "are installed.")
        return 1 if missing else 0
    if missing is not None:  # Qt would abort with a misleading message: say what to install instead
        qt_platform_check.report(missing)
        return 1
    from PySide6.QtCore import QTimer

    app, window = build_window(args)
    if args.start and window.settings.consent_given:
        window.start_node()
    elif args.start:
        window.show()
        window.request_start()
    # Let Ctrl+C in a terminal quit cleanly: Python handles signals only while it runs code.
    signal.signal(signal.SIGINT, lambda *_: window.quit_app())
    ticker = QTimer(window)
    ticker.timeout.connect(lambda: None)
    ticker.start(300)
    app.aboutToQuit.connect(window.controller.kill_now)
    if args.screenshot is not None:
        def grab() -> None:
            window.grab().save(str(args.screenshot))
            log.info("saved screenshot to %s", args.screenshot)
            window.quit_app()
        QTimer.singleShot(int(args.screenshot_after_s * 1000), grab)
    return int(app.exec())
