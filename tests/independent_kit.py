"""The harness the specs-only implementation tests share (tests/conformance/independent/)."""

from __future__ import annotations

from typing import Any

import pytest

from posttrain.conformance import Report, Status


def kit_params(keys: list[str], defects: dict[str, str]) -> list[Any]:
    """One pytest param per key, sorted; a known kit defect is a strict xfail naming it."""
    return [
        pytest.param(
            k,
            marks=[pytest.mark.xfail(strict=True, reason=defects[k])] if k in defects else [],
            id=k,
        )
        for k in sorted(keys)
    ]


def assert_conforms(key: str, rep: Report) -> None:
    """No FAIL or ERROR in ``rep``, and the report says it conforms."""
    bad = {r.id: r.message for r in rep.results if r.status in (Status.FAIL, Status.ERROR)}
    assert not bad, f"{key}: {bad}"
    assert rep.ok


def assert_fails_its_requirement(key: str, expected: str, rep: Report) -> None:
    """``expected`` is FAIL in ``rep`` on its own account (not blocked by another row), and the
    report does not conform."""
    row = {r.id: r for r in rep.results}[expected]
    assert row.status is Status.FAIL, f"{key}: {expected} is {row.status.value}: {row.message}"
    assert "blocked by" not in row.message[:40], row.message
    assert not rep.ok


def assert_caught(key: str, expected: str, rep: Report) -> None:
    """``expected`` is FAIL or ERROR in ``rep``, on its own account or blocked by a foundation
    (how the first rounds counted a variant as caught)."""
    rows = [r for r in rep.results if r.id == expected]
    assert rows, f"{key}: {expected} is not in the report"
    failed = sorted(r.id for r in rep.results if r.status in (Status.FAIL, Status.ERROR))
    assert rows[0].status in (Status.FAIL, Status.ERROR), (
        f"{key}: {expected} is {rows[0].status.value}; failed ids: {failed}"
    )
