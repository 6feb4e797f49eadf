"""The conformance kit's reach on buffer, weight_sync, metrics and generation, tested from outside.

Every variant in ``tests/independent/{buffer,weight_sync,metrics,generation}_variants.py`` was
written from the specs alone, without the suites, the mutants or the reference
implementations: a correct design with exactly one bug, of a kind real systems have shipped and
not yet among the kit's mutants or the other independent variants. Each must FAIL, on its own
account, the requirement its docstring names (a failed SHOULD fails no report, so for a SHOULD
the row alone is asserted), and its ``demo_*`` function shows without the kit that the bug is
real. The correct designs written beside them must conform.

A variant runs only its requirement and that requirement's foundations (the rows that could
block it), in catalogue order, with the kit's seed: the row is the one a whole run reports,
at a fraction of the time. A variant the kit does not fail is a strict xfail in
``KIT_DEFECTS`` whose reason says what the kit missed: the file passes today and records the
kit's reach; an entry goes once the kit catches the bug.

Tally when written: 31 variants, 14 failed on their own requirement (buffer 3 of 8,
weight_sync 3 of 7, metrics 5 of 8, generation 3 of 8); 5 more are caught only under another
id or as ERROR; 12 pass the kit.
"""

from __future__ import annotations

import functools
from types import ModuleType
from typing import Any

import pytest

from posttrain.conformance import Report, Status
from posttrain.conformance.runner import run
from posttrain.contracts import Implementation, get_contract
from posttrain.contracts.requirements import Level
from tests.independent import (
    buffer_variants,
    generation_variants,
    metrics_variants,
    weight_sync_variants,
)
from tests.independent_kit import assert_conforms, assert_fails_its_requirement, kit_params
from tests.outcomes import run_for

pytestmark = pytest.mark.reach  # make test-reach

_TIMEOUT_S = 60.0  # per requirement: a hang is a failed row, never a stalled run

MODULES: dict[str, ModuleType] = {
    "buffer": buffer_variants,
    "weight_sync": weight_sync_variants,
    "metrics": metrics_variants,
    "generation": generation_variants,
}
BASES: dict[str, Implementation] = {
    f"{c}/{k}": impl for c, m in MODULES.items() for k, impl in m.BASES.items()
}
BUGGY: dict[str, tuple[str, Implementation]] = {
    f"{c}/{k}": v for c, m in MODULES.items() for k, v in m.VARIANTS.items()
}

# Variants the kit does not fail on the requirement their bug breaks: what the kit missed.
KIT_DEFECTS: dict[str, str] = {
    # Not caught at all.
}


# Variants whose behaviour the spec, asked, puts out of scope: the kit must pass them there.
SPEC_DECISIONS: dict[str, str] = {
    "buffer/sample_zero_fails": (
        "sample(0) is out of scope in buffer v1 (the contract's purpose: a buffer may return an "
        "empty batch or raise)"
    ),
}


@functools.cache
def _report(key: str) -> Report:
    if key in BASES:
        return run(BASES[key], timeout_s=_TIMEOUT_S)
    expected, impl = BUGGY[key]
    return run_for(impl, expected, timeout_s=_TIMEOUT_S)  # its requirement and foundations


def _params(keys: list[str]) -> list[Any]:
    return kit_params(keys, KIT_DEFECTS)


@pytest.mark.parametrize("key", _params(list(BASES)))
def test_base_design_conforms(key: str) -> None:
    assert_conforms(key, _report(key))


# A variant whose shutdown raises does so in the kit's own helper thread.
@pytest.mark.filterwarnings("ignore::pytest.PytestUnhandledThreadExceptionWarning")
@pytest.mark.parametrize("key", _params([k for k in BUGGY if k not in SPEC_DECISIONS]))
def test_variant_fails_its_requirement(key: str) -> None:
    expected, impl = BUGGY[key]
    rep = _report(key)
    if get_contract(impl.contract).requirement(expected).level is Level.SHOULD:
        row = {r.id: r for r in rep.results}[expected]
        assert row.status is Status.FAIL, f"{key}: {expected} is {row.status.value}"
        assert not row.blocked, row.message
        return
    assert_fails_its_requirement(key, expected, rep)


@pytest.mark.parametrize("key", sorted(BUGGY))
def test_variant_bug_is_real_without_the_kit(key: str) -> None:
    contract, name = key.split("/", 1)
    assert MODULES[contract].DEMOS[name]() is True


def test_every_variant_has_a_demo() -> None:
    for m in MODULES.values():
        assert set(m.DEMOS) == set(m.VARIANTS)


@pytest.mark.parametrize("key", sorted(SPEC_DECISIONS))
def test_variant_the_spec_puts_out_of_scope_passes(key: str) -> None:
    expected, _impl = BUGGY[key]
    row = {r.id: r for r in _report(key).results}[expected]
    assert row.status is Status.PASS, f"{key} ({SPEC_DECISIONS[key]}): {row.message}"
