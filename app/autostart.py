"""Start Polis at login: writes or removes the platform's autostart entry.

Linux: a freedesktop ``.desktop`` file in ``$XDG_CONFIG_HOME/autostart`` (default
``~/.config/autostart``). macOS: a LaunchAgent plist in ``~/Library/LaunchAgents``.
Windows: a value under ``HKCU\\Software\\Microsoft\\Windows\\CurrentVersion\\Run``
(``winreg``). Each is touched only on its own platform. The entry opens the app
minimised to the tray and starts contributing (``polis gui --minimized --start``).
This module knows nothing about Qt or the settings store.
"""

from __future__ import annotations

import logging
import os
import plistlib
import shlex
import sys
from pathlib import Path

log = logging.getLogger(__name__)

ENTRY_NAME = "Polis"
LAUNCH_AGENT_LABEL = "org.polis.app"
_RUN_KEY = r"Software\Microsoft\Windows\CurrentVersion\Run"


class AutostartError(RuntimeError):
    """The autostart entry could not be written or removed (message is for the user)."""


def launch_command() -> list[str]:
    """The command line the login entry runs."""
    if getattr(sys, "frozen", False):
        return [sys.executable, "gui", "--minimized", "--start"]
    return [sys.executable, "-m", "engine.cli", "gui", "--minimized", "--start"]


def _linux_entry_path() -> Path:
    config_home = os.environ.get("XDG_CONFIG_HOME") or str(Path.home() / ".config")
    return Path(config_home) / "autostart" / "polis.desktop"


def _mac_entry_path() -> Path:
    return Path.home() / "Library" / "LaunchAgents" / f"{LAUNCH_AGENT_LABEL}.plist"


def entry_location(platform: str | None = None) -> str:
    """Where the entry lives on this platform, in words (for the settings dialog)."""
    platform = platform or sys.platform
    if platform.startswith("linux"):
        return str(_linux_entry_path())
    if platform == "darwin":
        return str(_mac_entry_path())
    if platform == "win32":
        return "HKEY_CURRENT_USER\\" + _RUN_KEY + "\\" + ENTRY_NAME
    return "not supported on this platform"


def is_supported(platform: str | None = None) -> bool:
    platform = platform or sys.platform
    return platform.startswith("linux") or platform in ("darwin", "win32")


def _desktop_exec(command: list[str]) -> str:
    # Desktop Entry spec: arguments with reserved characters are double-quoted.
    def quote(arg: str) -> str:
        if arg and not any(c in arg for c in ' \t\n"\'\\><~|&;$*?#()`'):
            return arg
        escaped = arg.replace("\\", "\\\\").replace('"', '\\"').replace("`", "\\`").replace("$", "\\$")
        return f'"{escaped}"'
    return " ".join(quote(a) for a in command)


def _set_linux(enabled: bool, command: list[str]) -> None:
    path = _linux_entry_path()
    if not enabled:
        path.unlink(missing_ok=True)
        return
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(
        "[Desktop Entry]\n"
        "Type=Application\n"
        f"Name={ENTRY_NAME}\n"
        "Comment=Contribute this computer to decentralised RL training\n"
        f"Exec={_desktop_exec(command)}\n"
        "Terminal=false\n"
        "X-GNOME-Autostart-enabled=true\n",
        encoding="utf-8",
    )


def _set_mac(enabled: bool, command: list[str]) -> None:
    path = _mac_entry_path()
    if not enabled:
        path.unlink(missing_ok=True)
        return
    path.parent.mkdir(parents=True, exist_ok=True)
    with path.open("wb") as fh:
        plistlib.dump({"Label": LAUNCH_AGENT_LABEL, "ProgramArguments": command,
                       "RunAtLoad": True, "ProcessType": "Interactive"}, fh)


def _set_windows(enabled: bool, command: list[str]) -> None:
    import subprocess
    import winreg  # type: ignore[import-not-found]  # Windows only

    with winreg.OpenKey(winreg.HKEY_CURRENT_USER, _RUN_KEY, 0, winreg.KEY_SET_VALUE) as key:
        if enabled:
            winreg.SetValueEx(key, ENTRY_NAME, 0, winreg.REG_SZ, subprocess.list2cmdline(command))
        else:
            try:
                winreg.DeleteValue(key, ENTRY_NAME)
            except FileNotFoundError:
                pass


def _windows_enabled() -> bool:
    import winreg  # type: ignore[import-not-found]

    try:
        with winreg.OpenKey(winreg.HKEY_CURRENT_USER, _RUN_KEY) as key:
            winreg.QueryValueEx(key, ENTRY_NAME)
            return True
    except FileNotFoundError:
        return False


def set_start_at_login(enabled: bool, command: list[str] | None = None) -> None:
    """Write (``enabled``) or remove the login entry; raises :class:`AutostartError`."""
    command = command or launch_command()
    try:
        if sys.platform.startswith("linux"):
            _set_linux(enabled, command)
        elif sys.platform == "darwin":
            _set_mac(enabled, command)
        elif sys.platform == "win32":
            _set_windows(enabled, command)
        else:
            raise AutostartError(f"Start at login is not supported on {sys.platform}.")
    except OSError as exc:
        raise AutostartError(f"Could not {'create' if enabled else 'remove'} the login entry at "
                             f"{entry_location()}: {exc.strerror or exc}") from None
    log.info("start at login %s (%s); command: %s", "enabled" if enabled else "disabled",
             entry_location(), shlex.join(command))


def is_start_at_login_enabled() -> bool:
    """Whether the login entry exists on this platform."""
    if sys.platform.startswith("linux"):
        return _linux_entry_path().exists()
    if sys.platform == "darwin":
        return _mac_entry_path().exists()
    if sys.platform == "win32":
        try:
            return _windows_enabled()
        except OSError:
            return False
    return False
