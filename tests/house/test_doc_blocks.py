"""Every Python block of README.md and docs/ runs in the test suite and imports public names only.

Each block is run here (in a fresh namespace, with the stand-ins it names, such as the
``ourpkg.port`` module README's example checks), or by the test named in ``RUN_ELSEWHERE``
(which this file checks exists and reads that page), or is listed in ``NOT_RUN_YET`` with why.
A new block fails ``test_every_block_is_run_somewhere`` until it is one of the three. Public
names are what docs/api.md defines (``tests.house.test_docstrings.PUBLIC_PACKAGES`` and their
``__all__``). The pages under docs/reports/ are generated: their blocks are the repro scripts
of tests/torchrl_repros/, verbatim, run by the tests of their rows.
"""

from __future__ import annotations

import ast
import importlib
import re
import sys
import types
import warnings
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

from posttrain.contracts import Implementation
from posttrain.reference_impls import RingBuffer
from tests.house.test_docstrings import PUBLIC_PACKAGES
from tests.paths import ROOT

PAGES = [ROOT / "README.md", *sorted((ROOT / "docs").rglob("*.md"))]
GENERATED = ROOT / "docs" / "reports"
REPROS = ROOT / "tests" / "torchrl_repros"
_BLOCK = re.compile(r"^```python\n(.*?)^```", flags=re.S | re.M)


def blocks(page: Path) -> list[str]:
    """The page's fenced ``python`` blocks, in order."""
    return _BLOCK.findall(page.read_text())


def _key(page: Path, i: int) -> str:
    return f"{page.relative_to(ROOT)}#{i}"


def _every_block() -> dict[str, str]:
    return {
        _key(page, i): code
        for page in PAGES
        if not page.is_relative_to(GENERATED)
        for i, code in enumerate(blocks(page))
    }


# --- run here ------------------------------------------------------------------------------


def _make_buffer(capacity: int) -> RingBuffer:
    return RingBuffer(capacity)


def _readme_check(monkeypatch: pytest.MonkeyPatch) -> dict[str, Any]:
    # The page's own names: a module ourpkg.port with a make_buffer factory.
    port = types.ModuleType("ourpkg.port")
    port.make_buffer = _make_buffer  # type: ignore[attr-defined]
    monkeypatch.setitem(sys.modules, "ourpkg", types.ModuleType("ourpkg"))
    monkeypatch.setitem(sys.modules, "ourpkg.port", port)
    return {}


def _with_make_buffer(monkeypatch: pytest.MonkeyPatch) -> dict[str, Any]:
    return {"make_buffer": _make_buffer}


def _check_readme(ns: dict[str, Any]) -> None:
    assert ns["report"].ok
    assert ns["report"].run["target"] == "ourpkg.port:make_buffer"


def _check_declaration(ns: dict[str, Any]) -> None:
    impl = ns["OUR_BUFFER"]
    assert isinstance(impl, Implementation)
    assert impl.resolved_options()["sampling"] == "without_replacement"


RUN_HERE: dict[
    str,
    tuple[Callable[[pytest.MonkeyPatch], dict[str, Any]], Callable[[dict[str, Any]], None]],
] = {
    "README.md#0": (_readme_check, _check_readme),
    "docs/conformance.md#0": (_with_make_buffer, _check_declaration),
}
"""Blocks this file runs: the stand-ins each needs, and what must hold after it ran."""

RUN_ELSEWHERE = {
    "docs/loss.md#0": "tests/conformance/test_loss_accumulation.py::test_doc_gradient_accumulation_example_runs",
    "docs/loss.md#1": "tests/conformance/test_loss_accumulation.py::test_doc_two_rank_example_runs",
    "docs/loss.md#2": "tests/conformance/test_loss_precision.py::test_doc_precision_example_runs",
    "docs/loss.md#3": "tests/policy_loss/test_policy_loss.py::test_doc_declared_ratios_example_runs",
    "docs/loss.md#4": "tests/conformance/test_nll_dpo_contracts.py::test_doc_nll_example_runs",
    "docs/loss.md#5": "tests/conformance/test_nll_dpo_contracts.py::test_doc_dpo_example_runs",
}
"""Blocks another test runs as written (it asserts on what the block computes)."""

NOT_RUN_YET = {
    "docs/api.md#0": "a mypy illustration: ListBuffer's body is elided (`...`)",
    "docs/distributed.md#0": "a fragment: needs a Ray cluster and a `batch`",
    "docs/examples/trl.md#0": "a fragment: GRPOTrainer and GRPOConfig(...) elided",
    "docs/examples/trl.md#1": "a fragment: needs a tokenizer `tok`",
    "docs/examples/trl.md#2": "a fragment: OnlineDPOConfig(...) elided",
    "docs/observability.md#0": "a fragment of a training loop (batch, source, microbatches)",
    "docs/observability.md#1": "a fragment: GRPOTrainer(...) elided",
    "docs/observability.md#2": "a fragment of a training loop (batch, source, sink)",
    "docs/verl.md#0": "a fragment: needs a verl DataProto `proto`",
}
"""Blocks that are fragments of a larger program: each still has to import public names only."""

IMPORTS_NOT_PUBLIC_YET = {
    "docs/observability.md#1": "posttrain.adapters.trl.callback.install and "
    "posttrain.observability.sinks (the package exports CatalogueCallback and MlflowSink)",
    "docs/loss.md#3": "posttrain.policy_loss: the configurable loss is not public",
    "docs/verl.md#0": "posttrain.adapters.verl.data: posttrain.adapters.verl is not public",
}
"""Blocks that still import from a module docs/api.md calls non-public, and what they import."""


def test_every_block_is_run_somewhere() -> None:
    found = set(_every_block())
    listed = set(RUN_HERE) | set(RUN_ELSEWHERE) | set(NOT_RUN_YET)
    assert not set(RUN_HERE) & set(RUN_ELSEWHERE), "expected each block run by one test"
    assert sorted(found - listed) == [], "expected each block in RUN_HERE or RUN_ELSEWHERE"
    assert sorted(listed - found) == [], "expected each listed block on its page (moved?)"


@pytest.mark.parametrize("key", sorted(RUN_ELSEWHERE))
def test_the_test_that_runs_a_block_exists_and_reads_its_page(key: str) -> None:
    path, _, name = RUN_ELSEWHERE[key].partition("::")
    source = (ROOT / path).read_text()
    assert re.search(rf"^def {re.escape(name)}\(", source, flags=re.M), RUN_ELSEWHERE[key]
    assert Path(key.partition("#")[0]).name in source


@pytest.mark.parametrize("key", sorted(RUN_HERE))
def test_the_block_runs(key: str, monkeypatch: pytest.MonkeyPatch) -> None:
    stand_ins, check = RUN_HERE[key]
    ns = {"__name__": "__doc_block__", **stand_ins(monkeypatch)}
    with warnings.catch_warnings():
        # A block may not lean on a deprecated name: its warning is an error here.
        warnings.simplefilter("error", DeprecationWarning)
        exec(compile(_every_block()[key], key, "exec"), ns)
    check(ns)


def _imports(code: str) -> list[tuple[str, list[str]]]:
    out: list[tuple[str, list[str]]] = []
    for node in ast.walk(ast.parse(code)):
        if isinstance(node, ast.ImportFrom) and (node.module or "").split(".")[0] == "posttrain":
            out.append((node.module or "", [a.name for a in node.names]))
        elif isinstance(node, ast.Import):
            out += [(a.name, []) for a in node.names if a.name.split(".")[0] == "posttrain"]
    return out


def non_public_imports(code: str) -> list[str]:
    """``module.name`` for each posttrain import of ``code`` outside docs/api.md's public names."""
    bad = []
    for module, names in _imports(code):
        if module not in PUBLIC_PACKAGES:
            bad.append(f"{module} ({', '.join(names) or 'the module'})")
            continue
        exported = set(importlib.import_module(module).__all__)
        bad += [f"{module}.{n}" for n in names if n not in exported]
    return bad


def test_blocks_import_public_names_only() -> None:
    bad = {
        key: found
        for key, code in _every_block().items()
        if (found := non_public_imports(code)) and key not in IMPORTS_NOT_PUBLIC_YET
    }
    assert bad == {}, f"expected public names only (docs/api.md), found {bad}"
    still = [k for k in IMPORTS_NOT_PUBLIC_YET if not non_public_imports(_every_block()[k])]
    assert still == [], f"expected these to import a non-public name (else unlist them): {still}"


def test_the_check_catches_a_non_public_import() -> None:
    code = "from posttrain.contracts.implementation import Implementation\n"
    code += "from posttrain.reference_impls import RING_BUFFER, RingBuffer\n"
    assert non_public_imports(code) == [
        "posttrain.contracts.implementation (Implementation)",
        "posttrain.reference_impls.RING_BUFFER",
    ]


def test_generated_pages_hold_the_repro_scripts_verbatim() -> None:
    scripts = {p.read_text().rstrip() for p in REPROS.glob("[a-z]*.py")}
    pages = sorted(GENERATED.glob("torchrl-*.md"))
    assert pages
    for page in pages:
        for i, code in enumerate(blocks(page)):
            assert code.rstrip() in scripts, f"{_key(page, i)}: not a script of {REPROS}"
