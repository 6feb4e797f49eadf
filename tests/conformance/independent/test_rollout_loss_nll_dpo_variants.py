"""The conformance kit's reach on the compute contracts ``rollout``, ``loss``, ``nll_loss`` and
``dpo_loss``, measured with one-bug variants written from the specs alone.

``tests/independent/{rollout,loss,nll_loss,dpo_loss}_variants.py`` hold one-bug variants of
correct designs, each a kind of bug real systems have shipped that the mutation table and the
other independent variants do not hold, naming the requirement whose sentence it breaks. Each
variant must FAIL (not ERROR, not blocked) that requirement; its ``demo_*`` function shows,
without the kit, that the bug is real. The one base written for these variants
(``loss_variants.HookedLoss``) must conform; the others are the designs of
``tests/independent/{rollouts,losses_sft_dpo}.py``, tested in their own files.

A variant the kit does not kill is a strict xfail in ``KIT_DEFECTS`` (the reason says what the
kit missed), so this file passes today and records the kit's reach; an entry is removed when
the kit kills its variant.

Tally: the 3 HookedLoss rows conform; 26 of 26 variants FAIL their requirement (rollout 7 of 7,
loss 9 of 9, nll_loss 5 of 5, dpo_loss 5 of 5); KIT_DEFECTS is empty.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any

import pytest

from posttrain.conformance import Report
from posttrain.conformance.runner import run
from posttrain.contracts import Implementation
from tests.independent import dpo_loss_variants as dv
from tests.independent import loss_variants as lv
from tests.independent import nll_loss_variants as nv
from tests.independent import rollout_variants as rv
from tests.independent_kit import assert_conforms, assert_fails_its_requirement, kit_params
from tests.outcomes import run_for

pytestmark = pytest.mark.reach  # make test-reach

_MODULES = {"rollout": rv, "loss": lv, "nll_loss": nv, "dpo_loss": dv}

BASES: dict[str, Implementation] = {
    f"{c}/{k}": v for c, m in _MODULES.items() for k, v in m.BASES.items()
}
VARIANTS: dict[str, tuple[str, Implementation]] = {
    f"{c}/{k}": v for c, m in _MODULES.items() for k, v in m.VARIANTS.items()
}
DEMOS: dict[str, Callable[[], bool]] = {
    f"{c}/{k}": v for c, m in _MODULES.items() for k, v in m.DEMOS.items()
}

# Variants the kit does not kill today (their requirement PASSes): what the kit missed.
KIT_DEFECTS: dict[str, str] = {}


@functools.cache
def _report(key: str) -> Report:
    if key in BASES:
        return run(BASES[key], timeout_s=60.0)
    expected, impl = VARIANTS[key]
    return run_for(impl, expected, timeout_s=60.0)  # its requirement and foundations only


def _params(keys: list[str]) -> list[Any]:
    return kit_params(keys, KIT_DEFECTS)


@pytest.mark.parametrize("key", _params(list(BASES)))
def test_base_design_conforms(key: str) -> None:
    assert_conforms(key, _report(key))


@pytest.mark.parametrize("key", _params(list(VARIANTS)))
def test_variant_fails_its_requirement(key: str) -> None:
    expected, _impl = VARIANTS[key]
    assert_fails_its_requirement(key, expected, _report(key))


@pytest.mark.parametrize("key", sorted(DEMOS))
def test_variant_bug_is_real_without_the_kit(key: str) -> None:
    assert DEMOS[key]() is True


def test_every_contract_has_five_variants_and_a_demo_each() -> None:
    for contract, module in _MODULES.items():
        assert len(module.VARIANTS) >= 5, contract
        assert set(module.DEMOS) == set(module.VARIANTS), contract
    for key, (expected, impl) in VARIANTS.items():
        assert impl.contract == key.split("/")[0], key
        assert expected.split("-")[0] in {"ROLL", "LOSS", "NLL", "DPO"}, key
