"""The installer's small parts, without freezing anything: icon files, the Linux archive and
its menu-entry script, the size report, and the CLI's answer for a command a build leaves out."""

from __future__ import annotations

import os
import shutil
import stat
import struct
import subprocess
import sys
import tarfile
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
INSTALLER = ROOT / "installer"
ICONS = ROOT / "resources" / "icons"
sys.path.insert(0, str(INSTALLER))

import bundle_report  # noqa: E402
import make_icons  # noqa: E402
import os_packages  # noqa: E402

PNG_MAGIC = b"\x89PNG\r\n\x1a\n"


def _png_size(blob: bytes) -> tuple[int, int]:
    assert blob[:8] == PNG_MAGIC
    return struct.unpack(">II", blob[16:24])  # IHDR width, height


def test_committed_ico_holds_png_entries_of_the_declared_sizes():
    data = (ICONS / "polis.ico").read_bytes()
    reserved, kind, count = struct.unpack("<HHH", data[:6])
    assert (reserved, kind) == (0, 1) and count == len(make_icons.ICO_SIZES)
    for i in range(count):
        width, height, _, _, planes, bits, length, offset = struct.unpack("<BBBBHHII", data[6 + 16 * i: 22 + 16 * i])
        declared = width or 256
        assert (height or 256) == declared and planes == 1 and bits == 32
        assert _png_size(data[offset: offset + length]) == (declared, declared)


def test_committed_icns_holds_png_entries_of_the_declared_sizes():
    data = (ICONS / "polis.icns").read_bytes()
    assert data[:4] == b"icns" and struct.unpack(">I", data[4:8])[0] == len(data)
    expected = dict(make_icons.ICNS_TYPES)
    seen, pos = {}, 8
    while pos < len(data):
        kind, length = data[pos: pos + 4].decode("ascii"), struct.unpack(">I", data[pos + 4: pos + 8])[0]
        seen[kind] = _png_size(data[pos + 8: pos + length])[0]
        pos += length
    assert pos == len(data) and seen == expected


def test_ico_and_icns_builders_index_every_image_they_are_given():
    fake = {s: PNG_MAGIC + b"\0\0\0\rIHDR" + struct.pack(">II", s, s) + bytes(s % 7) for s in (16, 256, 1024)}
    ico = make_icons.build_ico(fake, sizes=(16, 256))
    assert struct.unpack("<H", ico[4:6])[0] == 2 and ico[6] == 16 and ico[22] == 0  # 0 encodes 256
    icns = make_icons.build_icns(fake, types=(("icp4", 16), ("ic10", 1024)))
    assert struct.unpack(">I", icns[4:8])[0] == len(icns) == 8 + 2 * 8 + len(fake[16]) + len(fake[1024])


def _fake_bundle(tmp_path: Path) -> Path:
    bundle = tmp_path / "bundle" / "polis"
    (bundle / "_internal" / "torch" / "lib").mkdir(parents=True)
    (bundle / "_internal" / "base_library.zip").write_bytes(b"z" * 10)
    (bundle / "_internal" / "torch" / "lib" / "libtorch_cpu.so").write_bytes(b"t" * 5000)
    (bundle / "_internal" / "libpython3.so").write_bytes(b"p" * 300)
    exe = bundle / "polis"
    exe.write_text("#!/bin/sh\necho polis\n")
    exe.chmod(0o755)
    return bundle


def test_size_report_names_the_heaviest_package_first(tmp_path):
    bundle = _fake_bundle(tmp_path)
    parts = bundle_report.largest_parts(bundle)
    assert parts[0] == ("torch", 5000)
    assert dict(parts)["(executables and metadata)"] == len((bundle / "polis").read_bytes())
    assert bundle_report.tree_size(bundle) == sum(size for _, size in parts)
    assert bundle_report.largest_files(bundle, 1) == [("_internal/torch/lib/libtorch_cpu.so", 5000)]


@pytest.mark.skipif(sys.platform == "win32", reason="the Linux archive and its shell script")
def test_linux_archive_holds_the_bundle_desktop_entry_icons_and_install_script(tmp_path):
    bundle = _fake_bundle(tmp_path)
    (archive,) = os_packages.package_linux(bundle, tmp_path, "9.8.7")
    assert archive.name.startswith("polis-9.8.7-linux-") and archive.name.endswith(".tar.gz")
    with tarfile.open(archive) as tar:
        members = {m.name.split("/", 1)[1]: m for m in tar.getmembers() if "/" in m.name}
        desktop = tar.extractfile(members["polis.desktop"]).read().decode()
    assert {"polis", "install.sh", "polis.desktop", "polis-256.png", "polis-512.png",
            "_internal/torch/lib/libtorch_cpu.so"} <= set(members)
    assert members["polis"].mode & stat.S_IXUSR and members["install.sh"].mode & stat.S_IXUSR
    assert all(m.uid == 0 and m.uname == "" for m in members.values())
    assert "Exec=polis" in desktop and "Icon=polis" in desktop and "Type=Application" in desktop


@pytest.mark.skipif(shutil.which("sh") is None or sys.platform == "win32", reason="needs a POSIX shell")
def test_install_script_adds_a_menu_entry_pointing_at_the_unpacked_app_and_removes_it(tmp_path):
    (archive,) = os_packages.package_linux(_fake_bundle(tmp_path), tmp_path, "1.0")
    target = tmp_path / "apps dir"  # a space in the path must survive the Exec line
    with tarfile.open(archive) as tar:
        tar.extractall(target, filter="tar") if hasattr(tarfile, "data_filter") else tar.extractall(target)
    folder = next(target.iterdir())
    home = tmp_path / "home"
    env = {"HOME": str(home), "PATH": os.environ.get("PATH", "/usr/bin:/bin")}
    subprocess.run([str(folder / "install.sh")], env=env, check=True, capture_output=True)
    entry = home / ".local" / "share" / "applications" / "polis.desktop"
    text = entry.read_text()
    assert f'Exec="{folder}/polis"' in text and f"TryExec={folder}/polis" in text
    assert (home / ".local" / "share" / "icons" / "hicolor" / "256x256" / "apps" / "polis.png").exists()
    assert os.readlink(home / ".local" / "bin" / "polis") == str(folder / "polis")
    subprocess.run([str(folder / "install.sh"), "--uninstall"], env=env, check=True, capture_output=True)
    assert not entry.exists() and not (home / ".local" / "bin" / "polis").exists()
    assert (folder / "polis").exists()  # the app itself stays until the user deletes the folder


def test_a_command_whose_package_the_build_left_out_says_so_instead_of_crashing(monkeypatch, capsys):
    from engine import cli

    monkeypatch.setitem(cli.REQUIRES, "engine.model.sharded_check", ("polis_no_such_package",))
    assert cli.main(["check-model"]) == 2
    err = capsys.readouterr().err
    assert "polis check-model" in err and "polis_no_such_package" in err and "leaves out" in err
