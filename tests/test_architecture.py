"""docs/architecture.md's claims, read from the source: dependencies point down (no import circle among the modules
of src/dturbo, lazy and type-only imports counted), a method's package is reached only through the registry, and no
source file grows past 600 lines."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

SRC = Path(__file__).resolve().parents[1] / "src" / "dturbo"
METHODS = ("dturbo", "fedavg", "fedpaq", "dssm", "stc", "fedpm", "feddst", "point")


def modules() -> dict[str, tuple[Path, bool]]:
    """Every module of the package by dotted name: (its file, whether it is a package's __init__)."""
    out = {}
    for path in SRC.rglob("*.py"):
        parts = list(path.relative_to(SRC.parent).with_suffix("").parts)
        is_pkg = parts[-1] == "__init__"
        out[".".join(parts[:-1] if is_pkg else parts)] = (path, is_pkg)
    return out


def imports_of(name: str, path: Path, is_pkg: bool, known: set[str]) -> set[str]:
    """The package's modules ``name`` imports anywhere in its file (top level, functions, TYPE_CHECKING blocks):
    ``from a.b import c`` names a.b.c when that is a module, else a.b."""
    out = set()
    for node in ast.walk(ast.parse(path.read_text())):
        targets: list[str] = []
        if isinstance(node, ast.Import):
            targets = [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                here = name.split(".") if is_pkg else name.split(".")[:-1]
                here = here[: len(here) - (node.level - 1)]
                base = ".".join(here + ([node.module] if node.module else []))
            targets = [f"{base}.{a.name}" if f"{base}.{a.name}" in known else base for a in node.names]
        for target in targets:
            while target and target not in known:
                target = target.rpartition(".")[0]
            if target and target != name:
                out.add(target)
    return out


def graph() -> dict[str, set[str]]:
    mods = modules()
    return {name: imports_of(name, path, is_pkg, set(mods)) for name, (path, is_pkg) in mods.items()}


def circles(edges: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components of more than one module (Tarjan), each sorted."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on: set[str] = set()
    found: list[list[str]] = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on.add(v)
        for w in sorted(edges[v]):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            comp = []
            while True:
                w = stack.pop()
                on.discard(w)
                comp.append(w)
                if w == v:
                    break
            if len(comp) > 1:
                found.append(sorted(comp))

    for v in sorted(edges):
        if v not in index:
            visit(v)
    return found


def test_the_circle_finder_finds_a_circle_and_only_circles() -> None:
    assert circles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]
    assert circles({"a": {"b"}, "b": set(), "c": {"a", "b"}}) == []


def test_relative_imports_resolve_to_modules(tmp_path: Path) -> None:
    edges = graph()
    assert "dturbo.config" in edges["dturbo.algorithms.registry"]
    assert "dturbo.algorithms.dturbo.turbo" in edges["dturbo.algorithms.dturbo.server"]
    assert "dturbo.rounds" in edges["dturbo.flower.strategy"]


def test_no_import_circle() -> None:
    found = circles(graph())
    assert not found, "import circles: " + "; ".join(" <-> ".join(c) for c in found)


@pytest.mark.parametrize("lower", ["dturbo.config", "dturbo.protocol", "dturbo.ledger", "dturbo.codec",
                                   "dturbo.nn.shapes"])
def test_the_floors_below_the_methods_import_no_method(lower: str) -> None:
    """config, protocol, ledger, codec and the shared layer shapes never reach up into algorithms/."""
    edges = graph()
    seen, todo = set(), [lower]
    while todo:
        for w in edges[todo.pop()] - seen:
            seen.add(w)
            todo.append(w)
    assert not {m for m in seen if m.startswith("dturbo.algorithms")}, lower


def test_only_the_algorithms_import_a_methods_package() -> None:
    packages = tuple(f"dturbo.algorithms.{m}" for m in METHODS)
    bad = {f"{name} -> {t}" for name, targets in graph().items() if not name.startswith("dturbo.algorithms")
           for t in targets if t.startswith(packages)}
    assert not bad, sorted(bad)


def test_no_source_file_over_600_lines() -> None:
    long = {str(p.relative_to(SRC)): n for p in SRC.rglob("*.py") if (n := len(p.read_text().splitlines())) > 600}
    assert not long, long
