"""The launch check for Qt's xcb libraries (app.qt_platform_check) names the packages to install."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from app import qt_platform_check as check


def test_xcb_is_checked_only_where_qt_will_use_it(monkeypatch):
    monkeypatch.setattr(sys, "platform", "linux")
    assert check.uses_xcb({"DISPLAY": ":0"})
    assert check.uses_xcb({"QT_QPA_PLATFORM": "xcb"})
    assert not check.uses_xcb({"QT_QPA_PLATFORM": "offscreen"})
    assert not check.uses_xcb({"WAYLAND_DISPLAY": "wayland-0"})
    monkeypatch.setattr(sys, "platform", "darwin")
    assert not check.uses_xcb({"DISPLAY": ":0"})


def test_the_install_line_names_the_debian_and_fedora_packages():
    missing = ["libxcb-icccm.so.4", "libxcb-keysyms.so.1", "libxcb-cursor.so.0"]
    assert check.install_command(missing, "apt-get") == \
        "sudo apt-get install libxcb-icccm4 libxcb-keysyms1 libxcb-cursor0"
    assert check.install_command(missing, "dnf") == "sudo dnf install xcb-util-wm xcb-util-keysyms xcb-util-cursor"


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="the xcb plugin exists on Linux only")
def test_missing_libraries_reported_by_ldd_become_the_install_line(tmp_path, monkeypatch):
    fake_ldd = tmp_path / "ldd"
    fake_ldd.write_text("#!/bin/sh\necho '\tlibxcb-icccm.so.4 => not found'\necho '\tlibc.so.6 => /lib/libc.so.6'\n")
    fake_ldd.chmod(0o755)
    monkeypatch.setenv("PATH", f"{tmp_path}{os.pathsep}{os.environ['PATH']}")
    found = check.check({"QT_QPA_PLATFORM": "xcb"})
    assert found is not None and "libxcb-icccm.so.4" in found.sonames
    assert found.install_command == check.install_command(list(found.sonames))
    assert found.install_command in check.message(found)


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="the xcb plugin exists on Linux only")
def test_polis_prints_the_install_line_instead_of_qts_abort(tmp_path):
    fake_ldd = tmp_path / "ldd"
    fake_ldd.write_text("#!/bin/sh\necho '\tlibxcb-keysyms.so.1 => not found'\n")
    fake_ldd.chmod(0o755)
    env = {**os.environ, "PATH": f"{tmp_path}{os.pathsep}{os.environ['PATH']}", "QT_QPA_PLATFORM": "xcb",
           "HOME": str(tmp_path), "XDG_DATA_HOME": str(tmp_path / "data"), "XDG_CONFIG_HOME": str(tmp_path / "cfg")}
    env.pop("DISPLAY", None)
    done = subprocess.run([sys.executable, "-m", "engine.cli", "gui"], env=env, capture_output=True, text=True,
                          timeout=60, cwd=Path(__file__).resolve().parents[2])
    assert done.returncode == 1
    assert "libxcb-keysyms.so.1" in done.stderr
    assert check.install_command(["libxcb-keysyms.so.1"]) in done.stderr


def test_the_linux_download_declares_the_same_packages_the_launch_check_knows(tmp_path):
    import tarfile

    sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "installer"))
    import os_packages

    bundle = tmp_path / "bundle"
    bundle.mkdir()
    (bundle / "polis").write_text("#!/bin/sh\necho polis\n")
    (archive,) = os_packages.package_linux(bundle, tmp_path, "1.0")
    with tarfile.open(archive) as tar:
        name = next(n for n in tar.getnames() if n.endswith("/SYSTEM-PACKAGES.txt"))
        text = tar.extractfile(name).read().decode()
    assert f"sudo apt-get install {' '.join(check.DEBIAN_PACKAGES)}" in text
    assert "libxcb-icccm4" in text and "libxcb-keysyms1" in text and "libxcb-cursor0" in text
    assert f"sudo dnf install {' '.join(check.FEDORA_PACKAGES)}" in text
    script = (Path(__file__).resolve().parents[2] / "installer" / "linux" / "install.sh").read_text()
    assert "--check-system" in script
