"""Size limits of the package: no module over 900 lines, no function over 80, and every
reference implementation under 300 (it is meant to be read whole).

An offender being split right now sits in an allow-list with the reason; an entry that is no
longer an offender fails too, so the lists only ever shrink.
"""

from __future__ import annotations

import ast

from tests.paths import ROOT

PACKAGE = ROOT / "posttrain"
MAX_MODULE_LINES = 900
MAX_FUNCTION_LINES = 80
MAX_REFERENCE_LINES = 300
REFERENCE_IMPLS = "posttrain/reference_impls/"

ALLOWED: dict[str, str] = {
    # Modules by path ("posttrain/x.py"), functions by qualified name ("posttrain.x.f").
}
"""Offenders of the module and function limits: ``{path or qualified name: reason}``."""

ALLOWED_REFERENCE: dict[str, str] = {}
"""Reference implementations over the reference limit: ``{path: reason}``."""


def _modules() -> list[tuple[str, str, list[str]]]:
    """(path from the repository root, dotted module name, lines) of every package module."""
    out = []
    for path in sorted(PACKAGE.rglob("*.py")):
        rel = path.relative_to(ROOT).as_posix()
        name = rel.removesuffix(".py").replace("/", ".").removesuffix(".__init__")
        out.append((rel, name, path.read_text(encoding="utf-8").splitlines()))
    return out


def _functions(tree: ast.AST, prefix: str) -> list[tuple[str, int]]:
    """(qualified name, lines from ``def`` to its last line) of every function, nested ones too."""
    out: list[tuple[str, int]] = []
    for node in ast.iter_child_nodes(tree):
        if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef):
            name = f"{prefix}.{node.name}"
            assert node.end_lineno is not None
            out.append((name, node.end_lineno - node.lineno + 1))
            out += _functions(node, name)
        elif isinstance(node, ast.ClassDef):
            out += _functions(node, f"{prefix}.{node.name}")
        else:
            out += _functions(node, prefix)
    return out


def _offenders() -> dict[str, str]:
    """Every module and function over its limit: ``{path or qualified name: how long}``."""
    found: dict[str, str] = {}
    for rel, name, lines in _modules():
        if len(lines) > MAX_MODULE_LINES:
            found[rel] = f"{len(lines)} lines (limit {MAX_MODULE_LINES})"
        for qualname, n in _functions(ast.parse("\n".join(lines), rel), name):
            if n > MAX_FUNCTION_LINES:
                found[qualname] = f"{n} lines (limit {MAX_FUNCTION_LINES})"
    return found


def _reference_offenders() -> dict[str, str]:
    return {
        rel: f"{len(lines)} lines (limit {MAX_REFERENCE_LINES})"
        for rel, _, lines in _modules()
        if rel.startswith(REFERENCE_IMPLS) and len(lines) > MAX_REFERENCE_LINES
    }


def _verdict(found: dict[str, str], allowed: dict[str, str]) -> list[str]:
    problems = [f"{k}: {v}" for k, v in sorted(found.items()) if k not in allowed]
    problems += [
        f"{k}: allow-listed ({allowed[k]}) but within the limit now: drop it from the list"
        for k in sorted(allowed)
        if k not in found
    ]
    return problems


def test_no_module_over_900_lines_and_no_function_over_80() -> None:
    problems = _verdict(_offenders(), ALLOWED)
    assert not problems, "size limits:\n" + "\n".join(problems)


def test_every_reference_implementation_is_under_300_lines() -> None:
    problems = _verdict(_reference_offenders(), ALLOWED_REFERENCE)
    assert not problems, "reference implementations:\n" + "\n".join(problems)


def test_the_walk_finds_nested_functions_and_methods() -> None:
    tree = ast.parse(
        "def f():\n    def g():\n        pass\n\nclass C:\n    async def m(self):\n"
        "        x = 1\n        return x\n"
    )
    assert _functions(tree, "m") == [("m.f", 3), ("m.f.g", 2), ("m.C.m", 3)]


def test_a_stale_allow_list_entry_is_an_offence() -> None:
    assert _verdict({"a": "901 lines"}, {"a": "x", "b": "y"}) == [
        "b: allow-listed (y) but within the limit now: drop it from the list"
    ]
    assert _verdict({"a": "901 lines"}, {}) == ["a: 901 lines"]
