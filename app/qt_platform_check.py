"""Before Qt starts on Linux: are the system libraries of Qt's X11 (xcb) platform plugin there?

Qt aborts with a message that names ``libxcb-cursor0`` even when another library is
what is missing (on a stock Debian 12: ``libxcb-icccm4`` and ``libxcb-keysyms1``).
This module finds the ``libqxcb.so`` plugin of the installed PySide6, asks ``ldd``
which of its libraries (and those of ``libQt6XcbQpa``) cannot be found, adds
``libxcb-cursor.so.0`` (Qt loads it at run time), and turns the missing ones into
the exact package install line for this system (apt-get, dnf, zypper or pacman).
:func:`report` prints that line and, where a desktop helper exists (zenity,
kdialog, xmessage), shows it in a small dialog too.

It knows sonames and package names, nothing about the app's windows. It checks
nothing when Qt will not use xcb (``QT_QPA_PLATFORM`` set to something else, or a
Wayland session with the Wayland plugin), nor off Linux.
"""

from __future__ import annotations

import ctypes
import logging
import os
import re
import shutil
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

log = logging.getLogger(__name__)

#: soname -> (Debian/Ubuntu package, Fedora package). Qt 6's xcb plugin needs all of these.
PACKAGES: dict[str, tuple[str, str]] = {
    "libxcb-cursor.so.0": ("libxcb-cursor0", "xcb-util-cursor"),
    "libxcb-icccm.so.4": ("libxcb-icccm4", "xcb-util-wm"),
    "libxcb-keysyms.so.1": ("libxcb-keysyms1", "xcb-util-keysyms"),
    "libxcb-image.so.0": ("libxcb-image0", "xcb-util-image"),
    "libxcb-render-util.so.0": ("libxcb-render-util0", "xcb-util-renderutil"),
    "libxcb-util.so.1": ("libxcb-util1", "xcb-util"),
    "libxcb-randr.so.0": ("libxcb-randr0", "libxcb"),
    "libxcb-render.so.0": ("libxcb-render0", "libxcb"),
    "libxcb-shape.so.0": ("libxcb-shape0", "libxcb"),
    "libxcb-shm.so.0": ("libxcb-shm0", "libxcb"),
    "libxcb-sync.so.1": ("libxcb-sync1", "libxcb"),
    "libxcb-xfixes.so.0": ("libxcb-xfixes0", "libxcb"),
    "libxcb-xkb.so.1": ("libxcb-xkb1", "libxcb"),
    "libxcb.so.1": ("libxcb1", "libxcb"),
    "libxkbcommon-x11.so.0": ("libxkbcommon-x11-0", "libxkbcommon-x11"),
    "libxkbcommon.so.0": ("libxkbcommon0", "libxkbcommon"),
    "libX11-xcb.so.1": ("libx11-xcb1", "libX11-xcb"),
    "libX11.so.6": ("libx11-6", "libX11"),
    "libEGL.so.1": ("libegl1", "libglvnd-egl"),
    "libGL.so.1": ("libgl1", "libglvnd-glx"),
    "libGLX.so.0": ("libglx0", "libglvnd-glx"),
    "libfontconfig.so.1": ("libfontconfig1", "fontconfig"),
    "libfreetype.so.6": ("libfreetype6", "freetype"),
    "libdbus-1.so.3": ("libdbus-1-3", "dbus-libs"),
    "libglib-2.0.so.0": ("libglib2.0-0", "glib2"),
}
#: what the README and the Linux installer list (Debian/Ubuntu names), in one place.
DEBIAN_PACKAGES = tuple(dict.fromkeys(deb for deb, _ in PACKAGES.values()))
FEDORA_PACKAGES = tuple(dict.fromkeys(fed for _, fed in PACKAGES.values()))
_RUNTIME_LOADED = ("libxcb-cursor.so.0",)  # dlopen()ed by Qt >= 6.5, so ldd does not list it
_NOT_FOUND = re.compile(r"^\s*(\S+)\s*=>\s*not found", re.MULTILINE)


@dataclass(frozen=True)
class Missing:
    """The libraries Qt's xcb plugin cannot load, and the command that installs them."""

    sonames: tuple[str, ...]
    install_command: str


def qt_plugin_dir() -> Path | None:
    """The ``Qt/plugins`` folder of the installed PySide6 (no Qt import: it must work before Qt can)."""
    import importlib.util

    spec = importlib.util.find_spec("PySide6")
    if spec is None or not spec.submodule_search_locations:
        return None
    for base in spec.submodule_search_locations:
        for candidate in (Path(base) / "Qt" / "plugins", Path(base) / "plugins"):
            if candidate.is_dir():
                return candidate
    return None


def uses_xcb(env: dict[str, str] | None = None) -> bool:
    """Whether Qt will pick its xcb (X11) platform plugin in this environment."""
    env = os.environ if env is None else env
    if not sys.platform.startswith("linux"):
        return False
    platform = env.get("QT_QPA_PLATFORM", "").strip().lower()
    if platform:
        return platform.split(":")[0].split(";")[0] == "xcb"
    return not env.get("WAYLAND_DISPLAY")


def missing_sonames(plugin: Path) -> list[str]:
    """Sonames the xcb plugin (and its Qt helper library) need but this system lacks."""
    missing: list[str] = []
    targets = [plugin]
    qt_lib = plugin.parents[2] / "lib" / "libQt6XcbQpa.so.6"
    if qt_lib.exists():
        targets.append(qt_lib)
    ldd = shutil.which("ldd")
    if ldd:
        for target in targets:
            try:
                out = subprocess.run([ldd, str(target)], capture_output=True, text=True, timeout=20).stdout
            except (OSError, subprocess.SubprocessError) as exc:
                log.debug("ldd %s failed: %s", target, exc)
                continue
            missing += _NOT_FOUND.findall(out)
    else:  # no ldd: try to load each library the plugin is known to need
        missing += [name for name in PACKAGES if not _loadable(name)]
    missing += [name for name in _RUNTIME_LOADED if not _loadable(name)]
    return list(dict.fromkeys(missing))


def _loadable(soname: str) -> bool:
    try:
        ctypes.CDLL(soname)
        return True
    except OSError:
        return False


def install_command(sonames: list[str], manager: str | None = None) -> str:
    """The one command that installs the packages of ``sonames`` with this system's package manager."""
    manager = manager or next((m for m in ("apt-get", "dnf", "zypper", "pacman") if shutil.which(m)), "apt-get")
    if manager == "apt-get":
        packages = [PACKAGES.get(s, (s, s))[0] for s in sonames]
        return "sudo apt-get install " + " ".join(dict.fromkeys(packages))
    fedora = [PACKAGES.get(s, (s, s))[1] for s in sonames]
    if manager == "dnf":
        return "sudo dnf install " + " ".join(dict.fromkeys(fedora))
    if manager == "zypper":
        return "sudo zypper install " + " ".join(dict.fromkeys(fedora))
    return ("sudo pacman -S xcb-util-cursor xcb-util-wm xcb-util-keysyms xcb-util-image xcb-util-renderutil "
            "libxkbcommon-x11")


def check(env: dict[str, str] | None = None) -> Missing | None:
    """What is missing for Qt's xcb plugin, or None (nothing missing, or xcb not used)."""
    if not uses_xcb(env):
        return None
    plugins = qt_plugin_dir()
    plugin = plugins / "platforms" / "libqxcb.so" if plugins else None
    if plugin is None or not plugin.exists():
        return None
    sonames = missing_sonames(plugin)
    return Missing(tuple(sonames), install_command(sonames)) if sonames else None


def message(missing: Missing) -> str:
    return ("Polis cannot open its window: this computer lacks system libraries that Qt needs "
            f"({', '.join(missing.sonames)}).\nInstall them with:\n\n    {missing.install_command}\n\n"
            "then start Polis again.")


def report(missing: Missing) -> None:
    """Print the install line to stderr and show it in a dialog where a desktop helper exists."""
    text = message(missing)
    print(f"polis: {text}", file=sys.stderr, flush=True)
    if not os.environ.get("DISPLAY"):
        return
    for helper, argv in (("zenity", ["--error", "--title=Polis", "--no-markup", f"--text={text}"]),
                         ("kdialog", ["--title", "Polis", "--error", text]),
                         ("xmessage", ["-center", text])):
        path = shutil.which(helper)
        if path:
            try:
                subprocess.Popen([path, *argv], stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL,
                                 stderr=subprocess.DEVNULL, start_new_session=True)
            except OSError as exc:
                log.debug("could not show the message with %s: %s", helper, exc)
                continue
            return
