"""What a frozen bundle weighs, and which parts dominate it (for build.py's report).

Sizes are apparent file sizes, counted once (symbolic links, such as the ones a
macOS ``.app`` keeps between ``Contents/Resources`` and ``Contents/Frameworks``,
are not followed). Parts are the first path component under the bundle's
library folder (``_internal/`` or ``Contents/Frameworks/``): a package such as
``torch`` or ``PySide6``, or a shared library PyInstaller put at the top.
Knows nothing about PyInstaller's options or the OS packages.
"""

from __future__ import annotations

from collections import Counter
from pathlib import Path


def _files(root: Path):
    for path in root.rglob("*"):
        if path.is_file() and not path.is_symlink():
            yield path


def tree_size(root: Path) -> int:
    """Bytes of every regular file under ``root`` (``root`` itself if it is a file)."""
    if root.is_file():
        return root.stat().st_size
    return sum(p.stat().st_size for p in _files(root))


def library_root(bundle: Path) -> Path:
    """The folder holding the bundled packages (where ``base_library.zip`` lives)."""
    marker = next(bundle.rglob("base_library.zip"), None)
    return marker.parent if marker is not None else bundle


def largest_parts(bundle: Path, count: int = 12) -> list[tuple[str, int]]:
    """The ``count`` heaviest parts of the bundle, heaviest first, as (name, bytes)."""
    base = library_root(bundle)
    sizes: Counter[str] = Counter()
    for path in _files(bundle):
        try:
            parts = path.relative_to(base).parts
        except ValueError:  # outside the library folder: the executables, Info.plist, ...
            parts = ("(executables and metadata)",)
        sizes[parts[0]] += path.stat().st_size
    return sizes.most_common(count)


def largest_files(bundle: Path, count: int = 8) -> list[tuple[str, int]]:
    """The ``count`` largest single files, as (path relative to the bundle, bytes)."""
    files = sorted(_files(bundle), key=lambda p: p.stat().st_size, reverse=True)[:count]
    return [(str(p.relative_to(bundle)), p.stat().st_size) for p in files]
