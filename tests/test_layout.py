"""The code's layout rules: no import circle (a lazy import counts), the converter never
imports the loader or torch, and modules and their docstrings stay short."""

from __future__ import annotations

import ast
import sys
from pathlib import Path

from fixtures import REPO

PACKAGES = ("ingest", "loader")
MAX_LINES = 400  # a module longer than this holds more than one concept
MAX_DOCSTRING = 20  # a module docstring says what and why; figures go to docs/design.md


def modules() -> dict[str, Path]:
    """Every module of the two packages by dotted name (a package by its own name)."""
    out = {}
    for top in PACKAGES:
        for path in sorted((REPO / top).rglob("*.py")):
            parts = path.relative_to(REPO).with_suffix("").parts
            out[".".join(parts[:-1] if parts[-1] == "__init__" else parts)] = path
    return out


def imports(path: Path, known: dict[str, Path]) -> set[str]:
    """The modules of ours that ``path`` imports anywhere in it (at the top or lazily)."""
    found = set()
    for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
        if isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            for alias in node.names:
                name = f"{node.module}.{alias.name}"
                found.add(name if name in known else node.module)
        elif isinstance(node, ast.Import):
            found.update(alias.name for alias in node.names)
    return {name for name in found if name in known}


def circles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components of more than one module (Tarjan's algorithm)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    out: list[list[str]] = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        for w in graph[v]:
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            comp = []
            while (w := stack.pop()) != v:
                comp.append(w)
            if comp:
                out.append(sorted([v, *comp]))

    limit = sys.getrecursionlimit()
    sys.setrecursionlimit(max(limit, 10_000))
    try:
        for v in graph:
            if v not in index:
                visit(v)
    finally:
        sys.setrecursionlimit(limit)
    return out


def test_circles_are_found():
    assert circles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]
    assert circles({"a": {"b"}, "b": set()}) == []


def test_no_import_circle():
    known = modules()
    graph = {name: imports(path, known) - {name} for name, path in known.items()}
    assert circles(graph) == []


def test_the_converter_imports_neither_the_loader_nor_torch():
    for name, path in modules().items():
        if name.split(".")[0] != "ingest":
            continue
        tree = ast.parse(path.read_text(encoding="utf-8"))
        for node in ast.walk(tree):
            names = (
                [node.module or ""]
                if isinstance(node, ast.ImportFrom)
                else [a.name for a in node.names]
                if isinstance(node, ast.Import)
                else []
            )
            for imported in names:
                assert imported.split(".")[0] not in ("loader", "torch", "torchvision"), (
                    f"{name} imports {imported}"
                )


def test_modules_and_their_docstrings_are_short():
    long = {}
    for name, path in modules().items():
        text = path.read_text(encoding="utf-8")
        doc = ast.get_docstring(ast.parse(text)) or ""
        lines, doc_lines = text.count("\n"), doc.count("\n") + 1
        if lines > MAX_LINES or doc_lines > MAX_DOCSTRING:
            long[name] = (lines, doc_lines)
    assert long == {}
