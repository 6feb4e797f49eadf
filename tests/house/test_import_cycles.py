"""No import circle between posttrain's modules, counting every import the source holds:
module-level, inside functions and under ``if TYPE_CHECKING:`` alike (a function-local import
only postpones a circle, it does not remove it). Read with ``ast``; nothing is imported."""

from __future__ import annotations

import ast
from collections.abc import Mapping

from tests.paths import ROOT


def _sources() -> dict[str, str]:
    """``{dotted module name: source}`` of every module of the package."""
    out = {}
    for path in sorted((ROOT / "posttrain").rglob("*.py")):
        rel = path.relative_to(ROOT).with_suffix("").as_posix()
        out[rel.replace("/", ".").removesuffix(".__init__")] = path.read_text(encoding="utf-8")
    return out


def _targets(name: str, source: str, modules: set[str], is_package: bool) -> set[str]:
    """The package's modules that ``source`` imports anywhere in its body."""
    package = name if is_package else name.rpartition(".")[0]
    found: set[str] = set()
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Import):
            found |= {a.name for a in node.names if a.name in modules}
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                parts = package.split(".")
                base = parts[: len(parts) - node.level + 1]
                mod = ".".join([*base, *([node.module] if node.module else [])])
            else:
                mod = node.module or ""
            found |= {m for m in [mod, *(f"{mod}.{a.name}" for a in node.names)] if m in modules}
    found.discard(name)
    return found


def import_graph(
    sources: Mapping[str, str], packages: set[str] | None = None
) -> dict[str, set[str]]:
    """``{module: modules it imports}``; ``packages`` are the names that are ``__init__``s."""
    modules = set(sources)
    packages = (
        packages
        if packages is not None
        else {m for m in modules if any(o.startswith(m + ".") for o in modules)}
    )
    return {m: _targets(m, src, modules, m in packages) for m, src in sources.items()}


def cycles(graph: Mapping[str, set[str]]) -> list[list[str]]:
    """One circle per strongly connected group of modules, as ``[a, b, ..., a]``."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    groups: list[list[str]] = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        for w in sorted(graph[v]):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            group = []
            while True:
                w = stack.pop()
                group.append(w)
                if w == v:
                    break
            if len(group) > 1:
                groups.append(sorted(group))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return [_circle(graph, g) for g in groups]


def _circle(graph: Mapping[str, set[str]], group: list[str]) -> list[str]:
    """A path from the group's first module back to itself, inside the group."""
    start, members = group[0], set(group)
    paths = {start: [start]}
    frontier = [start]
    while frontier:
        nxt = []
        for v in frontier:
            for w in sorted(graph[v] & members):
                if w == start:
                    return [*paths[v], start]
                if w not in paths:
                    paths[w] = [*paths[v], w]
                    nxt.append(w)
        frontier = nxt
    raise AssertionError(f"{group} is not a circle")


def test_no_import_circle_between_posttrain_modules() -> None:
    found = cycles(import_graph(_sources()))
    assert found == [], "import circles:\n" + "\n".join(" -> ".join(c) for c in found)


def test_the_walk_sees_function_local_and_type_checking_imports() -> None:
    sources = {
        "p": "",
        "p.a": "from p.b import x\n",
        "p.b": "def f():\n    from p import c\n",
        "p.c": "from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from .a import y\n",
        "p.d": "import p.a\n",
    }
    graph = import_graph(sources)
    assert graph["p.b"] == {"p", "p.c"}
    assert graph["p.c"] == {"p.a"}
    assert cycles(graph) == [["p.a", "p.b", "p.c", "p.a"]]
