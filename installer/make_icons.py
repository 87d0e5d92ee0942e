"""Render the Polis app icon (drawn in code by ``app.icons``) to the files installers need.

Writes into ``resources/icons/``: ``polis-<N>.png`` (16 ... 1024 px), ``polis.ico``
(Windows: PNG-compressed entries 16-256 px) and ``polis.icns`` (macOS: PNG
entries 16-1024 px, retina variants included). ICO and ICNS are assembled here
from the PNGs (both formats are a small header and a table of PNG blobs), so no
image tool beyond Qt is needed and the output is the same on every OS. Run it
again whenever ``app.icons`` changes; the outputs are committed.

Usage: ``python installer/make_icons.py [--out DIR]``. Knows nothing about
PyInstaller.
"""

from __future__ import annotations

import argparse
import os
import struct
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
PNG_SIZES = (16, 24, 32, 48, 64, 128, 256, 512, 1024)
ICO_SIZES = (16, 24, 32, 48, 64, 128, 256)
#: ICNS entry type -> pixel size (PNG payloads; the "@2x" types reuse the doubled size)
ICNS_TYPES = (("icp4", 16), ("icp5", 32), ("ic11", 32), ("icp6", 64), ("ic12", 64), ("ic07", 128),
              ("ic08", 256), ("ic13", 256), ("ic09", 512), ("ic14", 512), ("ic10", 1024))
#: the colour of the middle node in the app mark (the same as ``app.icons.app_icon``)
MARK_ACCENT = "#A5B4FC"


def render_pngs(sizes: tuple[int, ...]) -> dict[int, bytes]:
    """PNG bytes of the app mark at each size, drawn by ``app.icons``."""
    os.environ.setdefault("QT_QPA_PLATFORM", "offscreen")
    sys.path.insert(0, str(ROOT))
    from PySide6.QtCore import QBuffer, QByteArray, QIODevice
    from PySide6.QtGui import QGuiApplication

    from app.icons import _draw_mark  # the one drawing of the mark; app_icon() stops at 256 px

    _app = QGuiApplication.instance() or QGuiApplication(["make_icons"])
    out: dict[int, bytes] = {}
    for size in sizes:
        data = QByteArray()
        buffer = QBuffer(data)
        buffer.open(QIODevice.OpenModeFlag.WriteOnly)
        if not _draw_mark(size, MARK_ACCENT, None).toImage().save(buffer, "PNG"):
            raise RuntimeError(f"Qt could not encode the {size} px icon as PNG")
        buffer.close()
        out[size] = bytes(data.data())
    return out


def build_ico(pngs: dict[int, bytes], sizes: tuple[int, ...] = ICO_SIZES) -> bytes:
    """A Windows .ico whose entries are PNG images (supported since Windows Vista)."""
    header = struct.pack("<HHH", 0, 1, len(sizes))
    offset = len(header) + 16 * len(sizes)
    directory, blobs = b"", b""
    for size in sizes:
        blob = pngs[size]
        dim = 0 if size >= 256 else size  # 0 means 256 in an ICONDIRENTRY
        directory += struct.pack("<BBBBHHII", dim, dim, 0, 0, 1, 32, len(blob), offset)
        offset += len(blob)
        blobs += blob
    return header + directory + blobs


def build_icns(pngs: dict[int, bytes], types: tuple[tuple[str, int], ...] = ICNS_TYPES) -> bytes:
    """A macOS .icns: the ``icns`` magic, the total length, then (type, length, PNG) entries."""
    body = b"".join(kind.encode("ascii") + struct.pack(">I", 8 + len(pngs[size])) + pngs[size]
                    for kind, size in types)
    return b"icns" + struct.pack(">I", 8 + len(body)) + body


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, default=ROOT / "resources" / "icons", help="output directory")
    args = parser.parse_args(argv)
    args.out.mkdir(parents=True, exist_ok=True)
    pngs = render_pngs(PNG_SIZES)
    for size, blob in pngs.items():
        (args.out / f"polis-{size}.png").write_bytes(blob)
    (args.out / "polis.ico").write_bytes(build_ico(pngs))
    (args.out / "polis.icns").write_bytes(build_icns(pngs))
    print(f"wrote {len(pngs)} PNGs, polis.ico and polis.icns to {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
