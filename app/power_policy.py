"""When may the node contribute? Battery and user-idle checks, and the rule that combines them.

Reads the machine: AC/battery through ``psutil.sensors_battery()``; seconds since
the last keyboard/mouse input through the platform's own API — X11
(``XScreenSaverQueryInfo`` from libXss), GNOME on Wayland (Mutter's IdleMonitor
over ``gdbus``), Windows (``GetLastInputInfo``), macOS (``HIDIdleTime`` from
``ioreg``). Where none works, idle detection is reported as unsupported with the
reason, never guessed. :func:`may_run` is a pure function of settings and a
:class:`MachineState`. This module knows nothing about Qt or the node process.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import logging
import os
import re
import shutil
import subprocess
import sys
from dataclasses import dataclass
from typing import Callable, Protocol

log = logging.getLogger(__name__)


class _ScheduleSettings(Protocol):
    run_only_when_idle: bool
    idle_after_min: float
    run_only_on_ac_power: bool


@dataclass(frozen=True)
class MachineState:
    """A snapshot of what the schedule depends on; ``None`` = not known on this machine."""

    on_battery: bool | None
    battery_percent: float | None
    idle_s: float | None


def battery_state() -> tuple[bool | None, float | None]:
    """(on battery?, charge percent); (None, None) on machines without a battery or sensor."""
    try:
        import psutil

        battery = psutil.sensors_battery()
    except Exception as exc:  # psutil raises platform-specific errors on odd machines
        log.debug("battery sensor unavailable: %s", exc)
        return None, None
    if battery is None:
        return None, None
    plugged = battery.power_plugged
    return (None if plugged is None else not plugged), float(battery.percent)


# -- idle time probes (each returns seconds, or raises OSError when it cannot work) ----------

class _XScreenSaverInfo(ctypes.Structure):
    _fields_ = [("window", ctypes.c_ulong), ("state", ctypes.c_int), ("kind", ctypes.c_int),
                ("til_or_since", ctypes.c_ulong), ("idle", ctypes.c_ulong), ("event_mask", ctypes.c_ulong)]


class _X11IdleProbe:
    def __init__(self) -> None:
        if not os.environ.get("DISPLAY"):
            raise OSError("no X11 display (DISPLAY is not set)")
        x11_name, xss_name = ctypes.util.find_library("X11"), ctypes.util.find_library("Xss")
        if not x11_name or not xss_name:
            raise OSError("libX11/libXss not found (install libxss1)")
        self._x11, self._xss = ctypes.CDLL(x11_name), ctypes.CDLL(xss_name)
        self._x11.XOpenDisplay.restype = ctypes.c_void_p
        self._x11.XOpenDisplay.argtypes = [ctypes.c_char_p]
        self._x11.XDefaultRootWindow.restype = ctypes.c_ulong
        self._x11.XDefaultRootWindow.argtypes = [ctypes.c_void_p]
        self._x11.XFree.argtypes = [ctypes.c_void_p]
        self._xss.XScreenSaverAllocInfo.restype = ctypes.POINTER(_XScreenSaverInfo)
        self._xss.XScreenSaverQueryInfo.argtypes = [ctypes.c_void_p, ctypes.c_ulong,
                                                    ctypes.POINTER(_XScreenSaverInfo)]
        self._display = self._x11.XOpenDisplay(None)
        if not self._display:
            raise OSError("cannot open the X11 display")
        self._root = self._x11.XDefaultRootWindow(self._display)
        self()  # fails now rather than on every poll when the extension is missing

    def __call__(self) -> float:
        info = self._xss.XScreenSaverAllocInfo()
        try:
            if not self._xss.XScreenSaverQueryInfo(self._display, self._root, info):
                raise OSError("the X server has no MIT-SCREEN-SAVER extension")
            return info.contents.idle / 1000.0
        finally:
            self._x11.XFree(info)


def _gnome_wayland_probe() -> Callable[[], float]:
    gdbus = shutil.which("gdbus")
    if not gdbus or not os.environ.get("WAYLAND_DISPLAY"):
        raise OSError("not a GNOME Wayland session with gdbus")
    command = [gdbus, "call", "--session", "--dest", "org.gnome.Mutter.IdleMonitor",
               "--object-path", "/org/gnome/Mutter/IdleMonitor/Core",
               "--method", "org.gnome.Mutter.IdleMonitor.GetIdletime"]

    def probe() -> float:
        out = subprocess.run(command, capture_output=True, text=True, timeout=2, check=False).stdout
        match = re.search(r"uint64 (\d+)", out)
        if not match:
            raise OSError("Mutter IdleMonitor did not answer")
        return int(match.group(1)) / 1000.0

    probe()
    return probe


def _windows_probe() -> Callable[[], float]:
    class LastInputInfo(ctypes.Structure):
        _fields_ = [("cbSize", ctypes.c_uint), ("dwTime", ctypes.c_uint)]

    user32, kernel32 = ctypes.windll.user32, ctypes.windll.kernel32  # type: ignore[attr-defined]

    def probe() -> float:
        info = LastInputInfo(cbSize=ctypes.sizeof(LastInputInfo))
        if not user32.GetLastInputInfo(ctypes.byref(info)):
            raise OSError("GetLastInputInfo failed")
        return ((kernel32.GetTickCount() - info.dwTime) & 0xFFFFFFFF) / 1000.0

    probe()
    return probe


def _mac_probe() -> Callable[[], float]:
    ioreg = shutil.which("ioreg") or "/usr/sbin/ioreg"

    def probe() -> float:
        out = subprocess.run([ioreg, "-c", "IOHIDSystem", "-d", "4"], capture_output=True, text=True,
                             timeout=2, check=False).stdout
        match = re.search(r'"HIDIdleTime"\s*=\s*(\d+)', out)
        if not match:
            raise OSError("ioreg reported no HIDIdleTime")
        return int(match.group(1)) / 1e9

    probe()
    return probe


class IdleDetector:
    """Seconds since the last user input, from the first probe that works on this platform."""

    def __init__(self) -> None:
        self._probe: Callable[[], float] | None = None
        reasons: list[str] = []
        if sys.platform == "win32":
            candidates = [("Windows", _windows_probe)]
        elif sys.platform == "darwin":
            candidates = [("macOS", _mac_probe)]
        else:
            candidates = [("X11", _X11IdleProbe), ("GNOME Wayland", _gnome_wayland_probe)]
        for name, make in candidates:
            try:
                self._probe = make()
                self.method = name
                break
            except Exception as exc:  # any probe failure just means "try the next one"
                reasons.append(f"{name}: {exc}")
        if self._probe is None:
            self.method = None
        self.unsupported_reason = ("" if self._probe else
                                   "Idle detection is not supported on this platform (" + "; ".join(reasons) + ").")

    @property
    def supported(self) -> bool:
        return self._probe is not None

    def idle_seconds(self) -> float | None:
        if self._probe is None:
            return None
        try:
            return self._probe()
        except Exception as exc:
            log.warning("idle probe %s failed: %s", self.method, exc)
            return None


def read_machine_state(idle: IdleDetector | None) -> MachineState:
    on_battery, percent = battery_state()
    return MachineState(on_battery=on_battery, battery_percent=percent,
                        idle_s=idle.idle_seconds() if idle is not None else None)


def may_run(settings: _ScheduleSettings, state: MachineState) -> tuple[bool, str]:
    """Whether the schedule allows contributing now, and why not (plain words) when it does not.

    Unknown facts never block: a desktop without a battery counts as on AC power, and
    "only when idle" without a working idle probe is ignored (the settings dialog says so).
    """
    if settings.run_only_on_ac_power and state.on_battery:
        charge = f" ({state.battery_percent:.0f}% charged)" if state.battery_percent is not None else ""
        return False, f"Paused: running on battery{charge}. Polis resumes when you plug in."
    if settings.run_only_when_idle and state.idle_s is not None:
        needed_s = settings.idle_after_min * 60.0
        if state.idle_s < needed_s:
            return False, (f"Waiting: the computer is in use. Polis resumes after "
                           f"{settings.idle_after_min:g} min without keyboard or mouse input.")
    return True, ""
