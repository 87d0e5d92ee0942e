"""Turn a frozen bundle into what a user downloads, one function per OS.

- Linux: ``polis-<version>-linux-<arch>.tar.gz``: the onedir bundle plus
  ``polis.desktop``, the icon, ``install.sh`` (menu entry for this user; it checks the
  system libraries Qt's X11 plugin needs and prints the install line for what is missing)
  and ``SYSTEM-PACKAGES.txt`` (those packages, from ``app.qt_platform_check``).
  No AppImage: ``appimagetool`` is neither on PyPI nor in Debian, and fetching it
  at build time would make the build depend on a download.
- macOS: ``Polis-<version>-macos-arm64.dmg`` (``hdiutil``) holding ``Polis.app``
  and a link to ``/Applications``. The app is signed by PyInstaller (ad hoc, or
  with ``POLIS_CODESIGN_IDENTITY``); the .dmg is signed with that identity and
  notarised + stapled only when ``POLIS_NOTARY_APPLE_ID``, ``POLIS_NOTARY_TEAM_ID``
  and ``POLIS_NOTARY_PASSWORD`` (an app-specific password) are set; otherwise
  those steps are skipped and say so.
- Windows: ``Polis-<version>-windows-x64.zip`` of the folder bundle and, when
  Inno Setup's ``iscc`` is found, ``Polis-<version>-windows-x64-setup.exe`` from
  ``installer/windows/polis.iss``.

Knows nothing about PyInstaller or about what the app does.
"""

from __future__ import annotations

import io
import os
import platform
import shutil
import subprocess
import sys
import tarfile
from pathlib import Path

HERE = Path(__file__).resolve().parent
ICONS = HERE.parent / "resources" / "icons"


def frozen_executable(bundle: Path, *, console: bool = False) -> Path:
    """The executable inside ``bundle`` (on Windows the console one when ``console``)."""
    if sys.platform == "darwin":
        return bundle / "Contents" / "MacOS" / "Polis"
    if sys.platform == "win32":
        return bundle / ("polis-cli.exe" if console else "Polis.exe")
    return bundle / "polis"


def package_for_this_os(bundle: Path, dist: Path, version: str) -> list[Path]:
    """Package ``bundle`` into ``dist``; returns the artefacts."""
    if sys.platform == "darwin":
        return package_macos(bundle, dist, version)
    if sys.platform == "win32":
        return package_windows(bundle, dist, version)
    return package_linux(bundle, dist, version)


# -- Linux ----------------------------------------------------------------------------
def _tar_entry(info: tarfile.TarInfo) -> tarfile.TarInfo:
    info.uid = info.gid = 0
    info.uname = info.gname = ""
    return info


def linux_system_packages() -> str:
    """What the Linux download needs from the system (Qt's X11 plugin libraries), as install lines."""
    from app.qt_platform_check import DEBIAN_PACKAGES, FEDORA_PACKAGES

    return ("Polis needs these system packages for its window (X11/xcb libraries of Qt).\n"
            "install.sh checks them and prints what is missing.\n\n"
            f"Debian / Ubuntu:\n  sudo apt-get install {' '.join(DEBIAN_PACKAGES)}\n\n"
            f"Fedora:\n  sudo dnf install {' '.join(FEDORA_PACKAGES)}\n")


def package_linux(bundle: Path, dist: Path, version: str) -> list[Path]:
    top = f"polis-{version}-linux-{platform.machine()}"
    archive = dist / f"{top}.tar.gz"
    extras = {"polis.desktop": HERE / "linux" / "polis.desktop", "install.sh": HERE / "linux" / "install.sh",
              "polis-256.png": ICONS / "polis-256.png", "polis-512.png": ICONS / "polis-512.png"}
    with tarfile.open(archive, "w:gz", compresslevel=6) as tar:
        for path in sorted(bundle.iterdir()):
            tar.add(path, arcname=f"{top}/{path.name}", filter=_tar_entry)
        packages = linux_system_packages().encode("utf-8")
        info = _tar_entry(tarfile.TarInfo(f"{top}/SYSTEM-PACKAGES.txt"))
        info.size, info.mode = len(packages), 0o644
        tar.addfile(info, io.BytesIO(packages))
        for name, source in extras.items():
            info = _tar_entry(tar.gettarinfo(source, arcname=f"{top}/{name}"))
            info.mode = 0o755 if name.endswith(".sh") else 0o644
            with source.open("rb") as handle:
                tar.addfile(info, handle)
    return [archive]


# -- macOS ----------------------------------------------------------------------------
def _run(*command: str) -> None:
    print("+", " ".join(command), flush=True)
    subprocess.run(command, check=True)


def package_macos(app: Path, dist: Path, version: str) -> list[Path]:
    identity = os.environ.get("POLIS_CODESIGN_IDENTITY")
    _run("codesign", "--verify", "--deep", "--strict", "--verbose=1", str(app))
    staging = dist / "dmg-staging"
    shutil.rmtree(staging, ignore_errors=True)
    staging.mkdir(parents=True)
    _run("ditto", str(app), str(staging / app.name))  # keeps symlinks and signatures intact
    (staging / "Applications").symlink_to("/Applications")
    dmg = dist / f"Polis-{version}-macos-{platform.machine()}.dmg"
    dmg.unlink(missing_ok=True)
    _run("hdiutil", "create", "-volname", "Polis", "-srcfolder", str(staging), "-fs", "HFS+",
         "-format", "UDZO", "-ov", str(dmg))
    shutil.rmtree(staging, ignore_errors=True)
    if identity:
        _run("codesign", "--sign", identity, "--timestamp", str(dmg))
    else:
        print("signing skipped: set POLIS_CODESIGN_IDENTITY (a 'Developer ID Application' identity) to sign")
    notary = [os.environ.get(k) for k in ("POLIS_NOTARY_APPLE_ID", "POLIS_NOTARY_TEAM_ID", "POLIS_NOTARY_PASSWORD")]
    if identity and all(notary):
        apple_id, team_id, password = notary
        _run("xcrun", "notarytool", "submit", str(dmg), "--apple-id", apple_id, "--team-id", team_id,
             "--password", password, "--wait")
        _run("xcrun", "stapler", "staple", str(dmg))
    else:
        print("notarisation skipped: needs POLIS_CODESIGN_IDENTITY and POLIS_NOTARY_APPLE_ID, "
              "POLIS_NOTARY_TEAM_ID, POLIS_NOTARY_PASSWORD")
    return [dmg]


# -- Windows --------------------------------------------------------------------------
def _find_iscc() -> str | None:
    found = shutil.which("iscc") or shutil.which("ISCC")
    if found:
        return found
    for base in (os.environ.get("ProgramFiles(x86)"), os.environ.get("ProgramFiles")):
        candidate = Path(base or "") / "Inno Setup 6" / "ISCC.exe"
        if base and candidate.exists():
            return str(candidate)
    return None


def package_windows(bundle: Path, dist: Path, version: str) -> list[Path]:
    stem = f"Polis-{version}-windows-x64"
    archive = Path(shutil.make_archive(str(dist / stem), "zip", root_dir=bundle.parent, base_dir=bundle.name))
    artefacts = [archive]
    iscc = _find_iscc()
    if iscc is None:
        print("Inno Setup installer skipped: iscc not found (install Inno Setup 6, then run build.py again)")
        return artefacts
    _run(iscc, "/Q", f"/DAppVersion={version}", f"/DSourceDir={bundle}", f"/DOutputDir={dist}",
         f"/DIconFile={ICONS / 'polis.ico'}", f"/DOutputName={stem}-setup", str(HERE / "windows" / "polis.iss"))
    artefacts.append(dist / f"{stem}-setup.exe")
    return artefacts
