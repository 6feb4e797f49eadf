"""docs/extending.md stays true: its checklists, followed here, give a working requirement and
a working contract.

Each step edits only what the doc names; the edits to package files are stood in for by
``monkeypatch`` (the contract's entry in ``CONTRACTS``) and by modules written to ``tmp_path``
(the contract module, the suite module, the implementations and their mutants).
"""

from __future__ import annotations

import importlib.util
import json
import re
import sys
import textwrap
from pathlib import Path
from types import ModuleType

import pytest

from posttrain.conformance import Status, check, registry
from posttrain.contracts import CONTRACTS, Requirement
from posttrain.contracts.requirements import Level
from posttrain.specgen import render_markdown
from tests.paths import ROOT

pytest_plugins = ["pytester"]

DOC = ROOT / "docs" / "extending.md"


def _load(monkeypatch: pytest.MonkeyPatch, path: Path, source: str) -> ModuleType:
    """Write ``source`` to ``path`` and import it as a module (removed again after the test)."""
    path.write_text(textwrap.dedent(source))
    spec = importlib.util.spec_from_file_location(path.stem, path)
    assert spec is not None
    assert spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    monkeypatch.setitem(sys.modules, path.stem, module)
    spec.loader.exec_module(module)
    return module


@pytest.fixture
def own_registry(monkeypatch: pytest.MonkeyPatch) -> None:
    """The checks registered during a test leave with it (the bundled suites stay imported)."""
    for contract_id in CONTRACTS:
        registry.checks_for(contract_id)
    monkeypatch.setattr(registry, "_CHECKS", {k: dict(v) for k, v in registry._CHECKS.items()})


def _section(title: str) -> str:
    text = DOC.read_text()
    start = text.index(f"## {title}")
    end = text.find("\n## ", start + 1)
    return text[start : end if end != -1 else len(text)]


def test_each_checklist_names_only_files_that_exist() -> None:
    root = DOC.parent.parent
    for title in (
        "Adding a requirement",
        "Adding a contract",
        "Adding a framework adapter",
        "Adding a bundled implementation",
    ):
        body = _section(title)
        paths = re.findall(r"`((?:posttrain|tests|specs|docs)/[\w/.<>-]+)`", body)
        assert paths, f"{title}: expected the files to touch, found none"
        for p in paths:
            if "<" not in p:  # a template such as posttrain/contracts/<id>.py names a new file
                assert (root / p).exists(), f"{title}: names {p}, which does not exist"


def test_a_new_contract_touches_three_package_places() -> None:
    steps = re.findall(r"^\d+\. ", _section("Adding a contract"), re.M)
    assert len(steps) <= 3, f"expected <= 3 places for a new contract, found {len(steps)}"


def test_a_toy_requirement_joins_an_existing_contract(
    pytester: pytest.Pytester, monkeypatch: pytest.MonkeyPatch, own_registry: None
) -> None:
    # Step 1: the requirement, in the contract's catalogue, with a new minor version.
    buffer = CONTRACTS["buffer"]
    major, minor = buffer.version.split(".")
    new = f"{major}.{int(minor) + 1}"
    toy = Requirement(
        id="BUF-900",
        level=Level.MUST,
        title="toy: holds what one extend wrote",
        text="After one extend of n <= capacity items into an empty buffer, len MUST be n.",
        since=new,
    )
    monkeypatch.setitem(
        CONTRACTS,
        "buffer",
        buffer.model_copy(update={"version": new, "requirements": (*buffer.requirements, toy)}),
    )
    # Step 2: its check, decorated with the id (in the suite module of the contract).
    _load(
        monkeypatch,
        pytester.path / "toy_buffer_checks.py",
        """
        from posttrain.conformance import ConformanceError, requirement
        from posttrain.testing import llm_batch

        @requirement("BUF-900")
        def holds_one_extend(ctx):
            rb = ctx.make(8)
            rb.extend(llm_batch(3))
            if len(rb) != 3:
                raise ConformanceError(f"extend of 3 into an empty buffer: len is {len(rb)}, expected 3")
        """,
    )
    # Step 3: a mutant it kills, with its id.
    (pytester.path / "toy_buffers.py").write_text(
        textwrap.dedent(
            """
            from posttrain.contracts import Implementation
            from posttrain.reference_impls import RingBuffer

            class ForgetsTheFirstItem(RingBuffer):
                def __len__(self):
                    return max(0, super().__len__() - 1)

            GOOD = Implementation("buffer", RingBuffer, name="ring")
            MUTANT = Implementation("buffer", ForgetsTheFirstItem, name="forgets")
            """
        )
    )
    assert "BUF-900" in registry.checks_for("buffer")
    assert "**BUF-900**" in render_markdown(CONTRACTS["buffer"])  # what `make specs` writes
    for target, status in (("GOOD", "PASS"), ("MUTANT", "FAIL")):
        report = pytester.path / f"{target}.json"
        pytester.runpytest_inprocess(
            "--conformance=buffer",
            f"--conformance-impl=toy_buffers:{target}",
            f"--conformance-report={report}",
            "-k",
            "BUF-900",
        )
        rows = {r["id"]: r for r in json.loads(report.read_text())["reports"][0]["results"]}
        assert rows["BUF-900"]["status"] == status, rows["BUF-900"]


def test_a_toy_contract_runs_through_the_kit(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, own_registry: None
) -> None:
    # Step 1: the contract module (a Protocol and its catalogue).
    contract = _load(
        monkeypatch,
        tmp_path / "toy_contract.py",
        """
        from typing import Protocol

        from posttrain.contracts import Contract, Requirement

        class CounterV1(Protocol):
            def add(self, n: int) -> None: ...
            def total(self) -> int: ...

        TOY = Contract(
            id="toy",
            version="1.0",
            title="Counter",
            purpose="Counts what it is given.",
            protocol=CounterV1,
            factory="make() -> CounterV1",
            requirements=(
                Requirement(
                    id="TOY-001",
                    level="MUST",
                    title="adds up",
                    text="After add(a) then add(b), total() MUST be a + b.",
                ),
            ),
        )
        """,
    )
    # Step 2: its entry in CONTRACTS (posttrain/contracts/registry.py).
    monkeypatch.setitem(CONTRACTS, "toy", contract.TOY)
    # Step 3: its suite, found by the contract id of its requirements.
    _load(
        monkeypatch,
        tmp_path / "toy_suite.py",
        """
        from posttrain.conformance import ConformanceError, requirement

        @requirement("TOY-001")
        def adds_up(ctx):
            c = ctx.make()
            c.add(2)
            c.add(3)
            if c.total() != 5:
                raise ConformanceError(f"add(2) then add(3): total() is {c.total()}, expected 5")
        """,
    )
    impls = _load(
        monkeypatch,
        tmp_path / "toy_counters.py",
        """
        from posttrain.contracts import Implementation

        class Counter:
            def __init__(self):
                self.n = 0
            def add(self, n):
                self.n += n
            def total(self):
                return self.n

        class KeepsTheLast(Counter):
            def add(self, n):
                self.n = n

        GOOD = Implementation("toy", Counter, name="counter")
        MUTANT = Implementation("toy", KeepsTheLast, name="keeps-the-last")
        """,
    )
    assert registry.suite_file("toy") == tmp_path / "toy_suite.py"
    good = check("toy", impls.GOOD)
    assert good.ok
    assert [(r.id, r.status) for r in good.results] == [("TOY-001", Status.PASS)]
    bad = check("toy", impls.MUTANT)
    assert [(r.id, r.status) for r in bad.results] == [("TOY-001", Status.FAIL)]
    assert "total() is 3, expected 5" in bad.results[0].message
    assert "**TOY-001**" in render_markdown(contract.TOY)  # what `make specs` writes
