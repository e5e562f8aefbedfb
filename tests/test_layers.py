"""The import graph is the one docs/architecture.md draws: every module of ``unirl`` sits in one layer of
the page's diagram, every import (at module level or inside a function, not under ``TYPE_CHECKING``) goes
to the same layer or a lower one, and no two modules import each other in a circle (a registry that imports
its shipped entries on use keeps them apart from the module they register into).

The layers are read from the diagram itself, so the page and the code cannot drift apart. On a failure
the message names each import that goes up (file, line, both layers) or each circle."""

from __future__ import annotations

import ast
import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PATH = re.compile(r"unirl/[A-Za-z0-9_/]+(?:\.py)?")


def _layers() -> list[tuple[str, list[str]]]:
    """(layer name, the paths its rows name), top to bottom, from the first diagram of the page."""
    text = (ROOT / "docs" / "architecture.md").read_text()
    start = text.index("```\n") + 4
    block = text[start:text.index("```", start)]
    layers: list[tuple[str, list[str]]] = []
    for line in block.splitlines():
        stripped = line.strip()
        if not stripped or stripped == "|":
            continue
        paths = [p.rstrip("/") for p in PATH.findall(line)]
        if not stripped.startswith("|") and not stripped.startswith("unirl/"):
            layers.append((stripped.split("  ")[0], paths))  # a new layer: its name, then its paths
        else:
            layers[-1][1].extend(paths)
    return layers


def _modules() -> dict[str, Path]:
    out = {}
    for path in sorted((ROOT / "unirl").rglob("*.py")):
        parts = list(path.relative_to(ROOT).with_suffix("").parts)
        out[".".join(parts[:-1] if parts[-1] == "__init__" else parts)] = path
    return out


def _layer_of(path: Path, layers) -> int | None:
    rel, best = path.relative_to(ROOT).as_posix(), None
    for i, (_, paths) in enumerate(layers):
        for p in paths:
            if (rel == p or rel.startswith(p + "/")) and (best is None or len(p) > best[1]):
                best = (i, len(p))
    return None if best is None else best[0]


def _imports(module: str, path: Path, modules) -> list[tuple[str, int, bool]]:
    """(imported module, line, at module level) for every import of ``unirl`` in the file."""
    package = module if path.name == "__init__.py" else module.rpartition(".")[0]

    def resolve(name: str) -> str | None:
        while name and name not in modules:
            name = name.rpartition(".")[0]
        return name or None

    found = []

    def visit(node, top: bool):
        for child in ast.iter_child_nodes(node):
            if isinstance(child, ast.If) and "TYPE_CHECKING" in ast.unparse(child.test):
                continue  # annotations only: not an import at run time
            names = []
            if isinstance(child, ast.Import):
                names = [alias.name for alias in child.names]
            elif isinstance(child, ast.ImportFrom):
                base = child.module or ""
                if child.level:
                    up = package.split(".")[: len(package.split(".")) - child.level + 1]
                    base = ".".join(up + ([base] if base else []))
                # ``from a import b``: the module a.b when it is one, else the module a
                names = [f"{base}.{a.name}" if f"{base}.{a.name}" in modules else base for a in child.names]
            for name in names:
                target = resolve(name) if name.split(".")[0] == "unirl" else None
                if target and target != module:
                    found.append((target, child.lineno, top))
            visit(child, top and not isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef)))

    visit(ast.parse(path.read_text()), True)
    return found


def test_every_module_has_a_layer_on_the_page():
    layers, modules = _layers(), _modules()
    assert [name for name, _ in layers][0] == "entry points" and layers[-1][0] == "core", layers
    unplaced = [str(p.relative_to(ROOT)) for p in modules.values() if _layer_of(p, layers) is None]
    assert not unplaced, f"modules in no layer of docs/architecture.md's diagram: {unplaced}"


def test_imports_go_down_the_layers():
    layers, modules = _layers(), _modules()
    upward = []
    for module, path in modules.items():
        here = _layer_of(path, layers)
        for target, line, _ in _imports(module, path, modules):
            there = _layer_of(modules[target], layers)
            if here is not None and there is not None and there < here:
                upward.append(f"{path.relative_to(ROOT)}:{line} ({layers[here][0]}) imports {target} ({layers[there][0]})")
    assert not upward, "imports back up the layers:\n" + "\n".join(upward)


def test_no_import_circles():
    modules = _modules()
    graph = {m: {t for t, _, _ in _imports(m, p, modules)} for m, p in modules.items()}
    # Tarjan's strongly connected components: a component of two or more modules is a circle.
    index, low, stack, on_stack, circles, counter = {}, {}, [], set(), [], [0]

    def connect(v):
        index[v] = low[v] = counter[0]
        counter[0] += 1
        stack.append(v)
        on_stack.add(v)
        for w in graph[v]:
            if w not in index:
                connect(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                component.append(w)
                if w == v:
                    break
            if len(component) > 1:
                circles.append(sorted(component))

    for v in graph:
        if v not in index:
            connect(v)
    assert not circles, f"modules importing each other in a circle: {circles}"
