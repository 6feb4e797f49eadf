"""`make report`: a row failing other than its declared known failures fails the report."""

from __future__ import annotations

from pathlib import Path

import pytest

from posttrain.adapters.torchrl import implementations as trl_impls
from posttrain.conformance import Status
from posttrain.conformance import matrix as matrix_mod
from posttrain.conformance.outcome import Report, Result
from posttrain.conformance.target import discover
from posttrain.contracts.implementation import Implementation
from posttrain.reference_impls import make_ring_buffer

IDS = ["BUF-009", "BUF-010", "BUF-013", "BUF-016", "BUF-018"]


def _report(known: list[str], fails: dict[str, str]) -> Report:
    rows = [
        Result(rid, "MUST", "t", Status.FAIL, f"{rid}: {fails[rid]}")
        if rid in fails
        else Result(rid, "MUST", "t", Status.PASS)
        for rid in IDS
    ]
    return Report(run={"contract": "buffer", "known_failures": known}, results=rows)


def test_declared_failures_are_expected_and_anything_else_is_not() -> None:
    as_declared = _report(["BUF-009"], {"BUF-009": "accepted", "BUF-016": "blocked by BUF-009"})
    assert as_declared.failed_ids() == {"BUF-009"}  # a blocked row is not its own failure
    assert as_declared.surprises() == []
    new = _report(["BUF-009"], {"BUF-009": "x", "BUF-010": "y"})
    fixed_upstream = _report(["BUF-009", "BUF-018"], {"BUF-009": "x"})
    assert new.surprises() == ["BUF-010 failed (not a declared known failure)"]
    assert fixed_upstream.surprises() == ["BUF-018 declared a known failure but did not fail"]
    reports = {"raw": as_declared, "new": new, "fixed": fixed_upstream, "ok": _report([], {})}
    assert matrix_mod.exit_status({"raw": as_declared, "ok": reports["ok"]}) == 0
    assert matrix_mod.exit_status(reports) == 1
    md = matrix_mod.render_markdown(reports)
    assert "| DOES NOT CONFORM (as declared) |" in md
    assert "| DOES NOT CONFORM, UNEXPECTED |" in md
    assert "- **fixed** BUF-018 declared a known failure but did not fail" in md


def test_main_returns_1_on_an_unexpected_row(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    wrong = Implementation("buffer", make_ring_buffer, name="ring", known_failures={"BUF-013"})
    monkeypatch.setattr(matrix_mod, "discover", lambda: {"ring": _EntryPoint(wrong)})
    assert matrix_mod.main(["--out", str(tmp_path)]) == 1
    assert (
        "BUF-013 declared a known failure but did not fail"
        in (tmp_path / "conformance.md").read_text()
    )


class _EntryPoint:
    def __init__(self, obj: Implementation) -> None:
        self.obj, self.value = obj, "test:obj"

    def load(self) -> Implementation:
        return self.obj


def test_a_declared_failure_that_did_not_run_says_why() -> None:
    blocked = _report(["BUF-016"], {"BUF-009": "x", "BUF-016": "blocked by BUF-009"})
    assert blocked.surprises() == [
        "BUF-009 failed (not a declared known failure)",
        "BUF-016 declared a known failure but did not run (blocked)",
    ]


def test_known_failures_name_requirements_of_the_contract() -> None:
    with pytest.raises(TypeError, match="found the string 'BUF-009'"):
        Implementation("buffer", make_ring_buffer, known_failures="BUF-009")  # type: ignore[arg-type]
    with pytest.raises(KeyError, match=r"buffer v.* has no requirement 'LOSS-001'"):
        Implementation("buffer", make_ring_buffer, known_failures={"LOSS-001"})


def test_only_raw_upstream_rows_and_should_failures_declare_known_failures() -> None:
    declared = {n: ep.load().known_failures for n, ep in discover().items()}
    with_failures = {n for n, k in declared.items() if k}
    assert with_failures == {n for n in declared if "-raw-" in n} | {
        "torchrl-wandb-logger",
        "torchrl-csv-logger",  # MET-007, a SHOULD
        "torchrl-tensorboard-logger",  # MET-007, a SHOULD
        "mlflow-sink",
    }
    assert "BUF-018" in trl_impls.RAW_LAZY_STACK.known_failures


def test_every_declared_torchrl_failure_has_a_published_repro() -> None:
    # The declarations are the tests' expectations; this ties them to an independent source:
    # the deviations published with repros in docs/reports (posttrain.adapters.torchrl.deviations).
    from posttrain.adapters.torchrl import deviations as dev

    repros = [
        d
        for group in (
            dev.DEVIATIONS,
            dev.LOSS_DEVIATIONS,
            dev.ROLLOUT_DEVIATIONS,
            dev.WEIGHT_SYNC_DEVIATIONS,
            dev.GENERATION_DEVIATIONS,
            dev.RAY_DEVIATIONS,
            dev.LOGGER_DEVIATIONS,
        )
        for d in group
    ]
    declared = {
        r
        for n, ep in discover().items()
        if n.startswith("torchrl-")
        for r in ep.load().known_failures
    }
    assert declared <= {r for d in repros for r in d.requirements}
    # A repro whose requirements a declared failure blocks in a full run still belongs to the row.
    assert [d.title for d in repros if not {*d.requirements, *d.blocked_by} & declared] == []
