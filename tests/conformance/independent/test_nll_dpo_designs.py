"""The conformance kit, tested from outside on the ``nll_loss`` and ``dpo_loss`` contracts.

Every implementation in ``tests/independent/losses_sft_dpo.py`` was written from the specs
alone, without the suites, the mutants or the reference implementations. The correct ones must
conform (no FAIL or ERROR); each one-bug variant must FAIL (not ERROR) the requirement its
docstring names, and its ``demo_*`` function shows without the kit that the bug is real.

Tally: 10 correct rows (2 NLL designs x 3 aggregations, 2 DPO designs x 2 reductions) conform;
all 17 one-bug variants (8 NLL, 9 DPO) FAIL their expected requirement. One kit defect these
designs found is fixed: DPO-006 had no pair whose chosen row is empty beside a rejected answer,
so a loss counting a pair when either row holds a token passed.
"""

from __future__ import annotations

import functools
from typing import Any

import pytest

from posttrain.conformance import Report
from posttrain.conformance.runner import run
from posttrain.contracts import Implementation
from tests.independent import losses_sft_dpo as sd
from tests.independent_kit import assert_conforms, assert_fails_its_requirement, kit_params
from tests.outcomes import run_for

CORRECT: dict[str, Implementation] = {
    **{f"nll/{k}": v for k, v in sd.CORRECT_NLL.items()},
    **{f"dpo/{k}": v for k, v in sd.CORRECT_DPO.items()},
}
BUGGY: dict[str, tuple[str, Implementation]] = dict(sd.VARIANTS)

# Where the kit's verdict differs from the spec sentence (none at present).
KIT_DEFECTS: dict[str, str] = {}


@functools.cache
def _report(key: str) -> Report:
    if key in CORRECT:
        return run(CORRECT[key], timeout_s=60.0)
    expected, impl = BUGGY[key]
    return run_for(impl, expected, timeout_s=60.0)  # its requirement and foundations only


def _params(keys: list[str]) -> list[Any]:
    return kit_params(keys, KIT_DEFECTS)


@pytest.mark.parametrize("key", _params(list(CORRECT)))
def test_correct_implementation_conforms(key: str) -> None:
    rep = _report(key)
    assert_conforms(key, rep)


@pytest.mark.parametrize("key", _params(list(BUGGY)))
def test_buggy_variant_fails_expected_requirement(key: str) -> None:
    expected, _impl = BUGGY[key]
    assert_fails_its_requirement(key, expected, _report(key))


@pytest.mark.parametrize("key", sorted(BUGGY))
def test_variant_bug_is_real_without_the_kit(key: str) -> None:
    assert getattr(sd, f"demo_{key}")() is True
