"""The nll_loss and dpo_loss contracts' docs: docs/loss.md's two examples run as written."""

from __future__ import annotations

import re
from typing import Any

import pytest

from tests.paths import ROOT

_DOC = ROOT / "docs" / "loss.md"


def _block_under(heading: str) -> str:
    text = _DOC.read_text()
    start = text.index(heading)
    found = re.search(r"```python\n(.*?)```", text[start:], flags=re.S)
    assert found is not None, f"no python example under {heading!r}"
    return found.group(1)


def test_doc_nll_example_runs() -> None:
    ns: dict[str, Any] = {}
    exec(compile(_block_under("## The supervised (NLL) loss"), str(_DOC), "exec"), ns)
    assert ns["report"].ok
    assert ns["nll_gap"] <= 1e-5


def test_doc_dpo_example_runs() -> None:
    ns: dict[str, Any] = {}
    exec(compile(_block_under("## The preference (DPO) loss"), str(_DOC), "exec"), ns)
    assert 0.0 <= ns["dpo_accuracy"] <= 1.0
    assert ns["counts"].sequences == 8


@pytest.mark.parametrize("name", ["reference-nll-loss-token-mean", "reference-dpo-loss-mean"])
def test_entry_points_resolve_to_the_new_contracts(name: str) -> None:
    from posttrain.conformance import discover

    impl = discover()[name].load()
    assert impl.contract in ("nll_loss", "dpo_loss")
