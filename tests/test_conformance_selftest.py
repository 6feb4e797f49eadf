"""The kit's quality figure: every requirement has a broken buffer that the suite fails with its id."""

from __future__ import annotations

import pytest
import torch

from posttrain.conformance import Status, checks_for, run
from posttrain.contracts import BUFFER
from posttrain.reference_impls import RING_BUFFER
from tests.mutants.buffers import MUTANTS


def test_reference_buffer_passes_every_applicable_requirement() -> None:
    rep = run(RING_BUFFER)
    assert rep.ok
    assert {r.status for r in rep.results} <= {Status.PASS, Status.NOT_APPLICABLE}
    passed = {r.id for r in rep.results if r.status is Status.PASS}
    assert {"BUF-001", "BUF-009", "BUF-014", "BUF-018", "BUF-019"} <= passed


def test_every_requirement_has_a_check_and_a_mutant() -> None:
    ids = [r.id for r in BUFFER.requirements]
    assert sorted(checks_for("buffer")) == sorted(ids)
    assert sorted(MUTANTS) == sorted(ids)


@pytest.mark.parametrize("req_id", sorted(MUTANTS))
def test_mutant_fails_with_its_requirement_id(req_id: str) -> None:
    if req_id == "BUF-021" and not torch.cuda.is_available():
        pytest.skip("BUF-021 needs a CUDA device to run (and to kill its mutant)")
    rep = run(MUTANTS[req_id])
    row = {r.id: r for r in rep.results}[req_id]
    assert row.status in (Status.FAIL, Status.ERROR), f"{req_id} survived: {row}"
    assert row.message.startswith(f"{req_id}: ")
    assert "blocked by" not in row.message


def test_should_failure_does_not_fail_the_run() -> None:
    rep = run(MUTANTS["BUF-015"])
    assert rep.ok  # BUF-015 is a SHOULD
    assert [
        r.id for r in rep.results if not r.passed and r.status is not Status.NOT_APPLICABLE
    ] == ["BUF-015"]


def test_dependants_of_a_failed_foundation_are_blocked() -> None:
    rep = run(MUTANTS["BUF-001"])
    rows = {r.id: r for r in rep.results}
    assert rows["BUF-002"].message == "BUF-002: blocked by BUF-001"
    assert rows["BUF-013"].status is Status.PASS  # independent of BUF-001
