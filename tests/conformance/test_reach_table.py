"""docs/conformance.md's reach table is what the specs-only variants' tests record."""

from __future__ import annotations

from tests.independent.reach import DOCS, END, START, render


def test_reach_table_is_in_step() -> None:
    text = DOCS.read_text()
    block = text.split(START, 1)[1].split(END, 1)[0].strip()
    assert block == render(), "run: python -m tests.independent.reach"
