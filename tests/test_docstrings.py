"""Every public name has a docstring with a short example (the brief's standard).

Read from the source, so optional dependencies need not be importable: a name is public when a
module outside ``_private`` files lists it in ``__all__``; it is checked in the module that
defines it (re-exports are skipped there). The examples themselves run as doctests
(``--doctest-modules`` in pyproject.toml).
"""

from __future__ import annotations

import ast
from pathlib import Path

PKG = Path(__file__).resolve().parent.parent / "posttrain"


def _public_modules() -> list[Path]:
    return [
        p
        for p in sorted(PKG.rglob("*.py"))
        if not any(part.startswith("_") and part != "__init__.py" for part in p.parts[-3:])
    ]


def _exported(tree: ast.Module) -> list[str]:
    for node in tree.body:
        if (
            isinstance(node, ast.Assign)
            and any(isinstance(t, ast.Name) and t.id == "__all__" for t in node.targets)
            and isinstance(node.value, ast.List | ast.Tuple)
        ):
            return [
                e.value
                for e in node.value.elts
                if isinstance(e, ast.Constant) and isinstance(e.value, str)
            ]
    return []


def _undocumented() -> list[str]:
    out = []
    for path in _public_modules():
        tree = ast.parse(path.read_text())
        defined = {
            n.name: n
            for n in tree.body
            if isinstance(n, ast.FunctionDef | ast.AsyncFunctionDef | ast.ClassDef)
        }
        for name in _exported(tree):
            node = defined.get(name)
            if node is None:
                continue  # a re-export, or a constant: checked where it is defined
            doc = ast.get_docstring(node) or ""
            if ">>>" not in doc:
                where = path.relative_to(PKG.parent).with_suffix("")
                out.append(
                    f"{'.'.join(where.parts)}.{name}: {'no example' if doc else 'no docstring'}"
                )
    return out


def test_every_public_function_and_class_has_a_docstring_with_an_example() -> None:
    assert _undocumented() == []


def test_the_check_sees_public_names() -> None:
    # Guards the check itself: were the walk to find nothing, the test above would pass vacuously.
    names = [n for p in _public_modules() for n in _exported(ast.parse(p.read_text()))]
    assert {"RingBuffer", "validate", "llm_batch"} <= set(names)
