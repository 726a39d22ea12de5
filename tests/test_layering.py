"""Layering of ``src/mmgate`` (docs/architecture.md, "Layers"): no import cycle among its modules, and no
module outside ``mmgate.api`` imports ``mmgate.api`` (the entry points cli, launch, demo, config.docs and
``__main__`` aside).

Every import counts: top level, inside a function, under ``TYPE_CHECKING``.  The walk is the one of the
repository's layering hook: ``from a.b import c`` is an edge to ``a.b.c`` when that is a module, else to
``a.b`` (the nearest enclosing module); a package's ``__init__`` is not an edge of its own children.
"""

from __future__ import annotations

import ast
from pathlib import Path

PACKAGE = Path(__file__).resolve().parents[1] / "src" / "mmgate"
ENTRY_POINTS = ("cli", "launch", "demo", "docs", "__main__")  # matched within a module's last name, as the hook


def _modules(root: Path) -> dict[str, Path]:
    mods: dict[str, Path] = {}
    for path in root.rglob("*.py"):
        parts = list(path.relative_to(root.parent).with_suffix("").parts)
        if parts[-1] == "__init__":
            parts = parts[:-1]
        mods[".".join(parts)] = path
    return mods


def _resolve(name: str, mods: dict[str, Path]) -> str | None:
    while name:
        if name in mods:
            return name
        name = name.rpartition(".")[0]
    return None


def _imports(module: str, path: Path) -> list[str]:
    """Every dotted name ``module`` imports (relative imports resolved against it)."""
    names: list[str] = []
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            names += [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                here = module.split(".") if path.name == "__init__.py" else module.split(".")[:-1]
                here = here[: len(here) - (node.level - 1)]
                base = ".".join(here + ([node.module] if node.module else []))
            names += [base] + [f"{base}.{alias.name}" for alias in node.names]
    return names


def _edges(mods: dict[str, Path]) -> dict[str, set[str]]:
    pkg = PACKAGE.name
    edges: dict[str, set[str]] = {m: set() for m in mods}
    for module, path in mods.items():
        for name in _imports(module, path):
            if name.split(".")[0] != pkg:
                continue
            target = _resolve(name, mods)
            if target and target != module and not module.startswith(target + "."):
                edges[module].add(target)
    return edges


def _cycles(edges: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected groups of more than one module (Tarjan, iterative)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    groups: list[list[str]] = []
    for root in edges:
        if root in index:
            continue
        work = [(root, iter(sorted(edges[root])))]
        index[root] = low[root] = len(index)
        stack.append(root)
        on_stack.add(root)
        while work:
            node, children = work[-1]
            child = next(children, None)
            if child is not None:
                if child not in index:
                    index[child] = low[child] = len(index)
                    stack.append(child)
                    on_stack.add(child)
                    work.append((child, iter(sorted(edges[child]))))
                elif child in on_stack:
                    low[node] = min(low[node], index[child])
                continue
            work.pop()
            if work:
                low[work[-1][0]] = min(low[work[-1][0]], low[node])
            if low[node] == index[node]:
                group = []
                while True:
                    member = stack.pop()
                    on_stack.discard(member)
                    group.append(member)
                    if member == node:
                        break
                if len(group) > 1:
                    groups.append(sorted(group))
    return groups


def _upward(edges: dict[str, set[str]]) -> list[tuple[str, str]]:
    api = f"{PACKAGE.name}.api"

    def in_api(name: str) -> bool:
        return name == api or name.startswith(api + ".")

    return sorted((m, t) for m, targets in edges.items() for t in targets
                  if in_api(t) and not in_api(m) and not any(e in m.split(".")[-1] for e in ENTRY_POINTS))


def test_the_walk_sees_function_level_and_type_checking_imports(tmp_path: Path) -> None:
    pkg = tmp_path / "mmgate"
    (pkg / "api").mkdir(parents=True)
    (pkg / "__init__.py").write_text("")
    (pkg / "api" / "__init__.py").write_text("")
    (pkg / "api" / "app.py").write_text("from mmgate import low\n")
    (pkg / "low.py").write_text("from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from mmgate.api.app import X\n")
    (pkg / "mid.py").write_text("def f():\n    from .api import app\n")
    mods = _modules(pkg)
    edges = _edges(mods)
    # ``from .api import app`` names the package and its module: an edge to each
    assert edges["mmgate.low"] == {"mmgate.api.app"} and edges["mmgate.mid"] == {"mmgate.api", "mmgate.api.app"}
    assert _cycles(edges) == [["mmgate.api.app", "mmgate.low"]]
    assert _upward(edges) == [("mmgate.low", "mmgate.api.app"), ("mmgate.mid", "mmgate.api"),
                              ("mmgate.mid", "mmgate.api.app")]


def test_src_has_no_import_cycle() -> None:
    assert _cycles(_edges(_modules(PACKAGE))) == []


def test_nothing_below_the_endpoints_imports_api() -> None:
    assert _upward(_edges(_modules(PACKAGE))) == []
