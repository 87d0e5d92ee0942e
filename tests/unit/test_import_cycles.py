"""No import cycles among the modules of ``engine/``: top-level, lazy (inside functions) and
``TYPE_CHECKING`` imports all count, since a lazy import is still a dependency both ways.

Imports of a package itself (its ``__init__``) are not edges: a package re-exporting its
modules is not a cycle. The cycle finder is checked on a made-up package first, so this test
can fail.
"""

from __future__ import annotations

import ast
from pathlib import Path

ENGINE = Path(__file__).resolve().parents[2] / "engine"


def module_graph(package_dir: Path) -> dict[str, set[str]]:
    """``{module: modules of the same tree it imports}`` for every ``.py`` file under ``package_dir``."""
    root = package_dir.parent
    files = {}
    for path in sorted(package_dir.rglob("*.py")):
        parts = path.relative_to(root).with_suffix("").parts
        name = ".".join(parts[:-1] if parts[-1] == "__init__" else parts)
        files[name] = path
    packages = {name for name, path in files.items() if path.name == "__init__.py"}
    graph: dict[str, set[str]] = {name: set() for name in files}
    for name, path in files.items():
        here = name if name in packages else name.rpartition(".")[0]
        for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
            if isinstance(node, ast.Import):
                targets = [alias.name for alias in node.names]
            elif isinstance(node, ast.ImportFrom):
                base = node.module or ""
                if node.level:
                    anchor = here.split(".")[: len(here.split(".")) - node.level + 1]
                    base = ".".join(anchor + ([base] if base else []))
                targets = [base] + [f"{base}.{alias.name}" for alias in node.names]
            else:
                continue
            graph[name].update(t for t in targets if t in files and t != name and t not in packages)
    return graph


def cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components with more than one module (iterative Kosaraju)."""
    order: list[str] = []
    seen: set[str] = set()
    for start in graph:
        if start in seen:
            continue
        seen.add(start)
        stack = [(start, iter(sorted(graph[start])))]
        while stack:
            node, children = stack[-1]
            child = next(children, None)
            if child is None:
                stack.pop()
                order.append(node)
            elif child not in seen:
                seen.add(child)
                stack.append((child, iter(sorted(graph[child]))))
    reverse: dict[str, set[str]] = {name: set() for name in graph}
    for name, targets in graph.items():
        for target in targets:
            reverse[target].add(name)
    found, assigned = [], set()
    for start in reversed(order):
        if start in assigned:
            continue
        component, todo = [], [start]
        assigned.add(start)
        while todo:
            node = todo.pop()
            component.append(node)
            for parent in reverse[node] - assigned:
                assigned.add(parent)
                todo.append(parent)
        if len(component) > 1:
            found.append(sorted(component))
    return sorted(found)


def test_the_cycle_finder_sees_direct_lazy_and_relative_cycles(tmp_path):
    pkg = tmp_path / "pkg"
    (pkg / "sub").mkdir(parents=True)
    (pkg / "__init__.py").write_text("from pkg import a\n")
    (pkg / "a.py").write_text("import pkg.b\n")
    (pkg / "b.py").write_text("def f():\n    from pkg.sub import c\n")  # lazy
    (pkg / "sub" / "__init__.py").write_text("")
    (pkg / "sub" / "c.py").write_text("from .. import a\nfrom . import d\n")  # relative
    (pkg / "sub" / "d.py").write_text("from pkg import sub\n")  # the package itself: no edge
    (pkg / "e.py").write_text("from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from pkg import f\n")
    (pkg / "f.py").write_text("import pkg.e\n")
    assert cycles(module_graph(pkg)) == [["pkg.a", "pkg.b", "pkg.sub.c"], ["pkg.e", "pkg.f"]]
    (pkg / "f.py").write_text("")
    (pkg / "b.py").write_text("")
    assert cycles(module_graph(pkg)) == []


def test_engine_has_no_import_cycles():
    found = cycles(module_graph(ENGINE))
    assert not found, "import cycles in engine/: " + "; ".join(" <-> ".join(c) for c in found)
