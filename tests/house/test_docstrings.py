"""The public API is what the package ``__init__`` modules export; each name has a docstring
with a short example (the brief's standard), and there are few of them.

Every other module is an implementation detail: it has no ``__all__`` of its own. The examples
themselves run as doctests (``--doctest-modules`` in pyproject.toml).

The count: ``.venv/bin/python -c "from tests.house.test_docstrings import public_names as p; print(len(p()))"``
"""

from __future__ import annotations

import ast
import importlib
import inspect
from pathlib import Path
from typing import Any

from tests.paths import ROOT

PKG = ROOT / "posttrain"

PUBLIC_PACKAGES = (
    "posttrain",
    "posttrain.contracts",
    "posttrain.conformance",
    "posttrain.reference_impls",
    "posttrain.observability",
    "posttrain.testing",
    "posttrain.adapters.torchrl",
    "posttrain.adapters.trl",
    "posttrain.adapters.nemo_rl",
    "posttrain.adapters.ray",
)
# The core (contracts, kit, reference implementations, observability, testing) is what every
# user reads, so it is capped as a whole; an adapter package serves one framework's users, who
# read only it, so each is capped on its own.
CORE_PACKAGES = PUBLIC_PACKAGES[:6]
MAX_CORE_NAMES = 70
MAX_ADAPTER_NAMES = 16
# Every package together: a user who reads them all reads at most this many names.
MAX_PUBLIC_NAMES = 100

# Implementation modules that still list an ``__all__`` while another change reworks them.
_ALL_PENDING: set[str] = set()


# Public constants whose docstring lives in a file another change is reworking.
_DOC_PENDING: set[str] = set()


def public_names() -> dict[str, list[str]]:
    """``{name: [packages exporting it]}`` over every public package's ``__all__``."""
    out: dict[str, list[str]] = {}
    for pkg in PUBLIC_PACKAGES:
        for name in importlib.import_module(pkg).__all__:
            out.setdefault(name, []).append(pkg)
    return out


def _attribute_doc(module: Any, name: str) -> str:
    """The string literal right after ``name = ...`` in ``module``'s source (a constant's doc)."""
    tree = ast.parse(Path(inspect.getfile(module)).read_text())
    for prev, node in zip(tree.body, tree.body[1:], strict=False):
        targets = (
            prev.targets
            if isinstance(prev, ast.Assign)
            else [prev.target]
            if isinstance(prev, ast.AnnAssign)
            else []
        )
        if any(isinstance(t, ast.Name) and t.id == name for t in targets):
            if isinstance(node, ast.Expr) and isinstance(node.value, ast.Constant):
                return str(node.value.value)
            return ""
    return ""


def _doc(pkg: str, name: str) -> str:
    obj = getattr(importlib.import_module(pkg), name)
    if inspect.isclass(obj) or inspect.isfunction(obj):
        return inspect.getdoc(obj) or ""
    # A constant: its doc follows its assignment in the module its package imports it from.
    tree = ast.parse(Path(inspect.getfile(importlib.import_module(pkg))).read_text())
    for node in tree.body:
        if isinstance(node, ast.ImportFrom) and any(a.name == name for a in node.names):
            return _attribute_doc(importlib.import_module(node.module or ""), name)
    return _attribute_doc(importlib.import_module(pkg), name)


def test_every_public_name_has_a_docstring_with_an_example() -> None:
    bad = []
    for name, pkgs in sorted(public_names().items()):
        doc = _doc(pkgs[0], name)
        if ">>>" not in doc and f"{pkgs[0]}.{name}" not in _DOC_PENDING:
            bad.append(f"{pkgs[0]}.{name}: {'no example' if doc else 'no docstring'}")
    assert bad == [], f"expected a docstring with an example for each, found {bad}"


def test_the_public_api_is_small_and_each_name_has_one_home() -> None:
    names = public_names()
    assert len(names) <= MAX_PUBLIC_NAMES, (
        f"expected <= {MAX_PUBLIC_NAMES} public names, found {len(names)}"
    )
    assert {"RingBuffer", "LLM_LAYOUT_V1", "llm_batch", "PosttrainError"} <= set(names)
    core = [n for n, pkgs in names.items() if pkgs[0] in CORE_PACKAGES]
    assert len(core) <= MAX_CORE_NAMES, (
        f"expected <= {MAX_CORE_NAMES} core names, found {len(core)}"
    )
    for pkg in PUBLIC_PACKAGES[len(CORE_PACKAGES) :]:
        n = len(importlib.import_module(pkg).__all__)
        assert n <= MAX_ADAPTER_NAMES, f"expected <= {MAX_ADAPTER_NAMES} names in {pkg}, found {n}"
    twice = {n: p for n, p in names.items() if len(p) > 1}
    assert twice == {}, f"expected each public name exported by one package, found {twice}"


def test_implementation_modules_have_no_all() -> None:
    listed = []
    for path in sorted(PKG.rglob("*.py")):
        rel = str(path.relative_to(PKG.parent))
        package = ".".join(path.relative_to(PKG.parent).parent.parts)
        if (path.name == "__init__.py" and package in PUBLIC_PACKAGES) or rel in _ALL_PENDING:
            continue
        tree = ast.parse(path.read_text())
        if any(
            isinstance(n, ast.Assign | ast.AnnAssign)
            and any(
                isinstance(t, ast.Name) and t.id == "__all__"
                for t in (n.targets if isinstance(n, ast.Assign) else [n.target])
            )
            for n in tree.body
        ):
            listed.append(rel)
    assert listed == [], (
        f"expected no __all__ outside the public packages' __init__s, found {listed}"
    )


def test_no_entry_point_declaration_is_exported() -> None:
    # Entry points name module attributes; the RAW_*/ADAPTED_* rows are not API.
    exported = [
        n for n in public_names() if n.startswith(("RAW_", "ADAPTED_", "PG_LOSS")) or n.isupper()
    ]
    assert set(exported) <= {"AGGREGATIONS", "CONTRACTS", "LLM_LAYOUT_V1", "PROMPT_LEN"}
