"""The kit's reach on bugs nobody listed: one-bug variants written from the specs alone.

Every module ``tests/independent/<contract>_variants_r3.py`` was written from that contract's
spec text without reading its suite or mutants: each variant is a correct design with one bug of
a kind no earlier issue, mutant or variant named. A variant must make its report fail, on the
requirement its docstring names (``BREAKS``) or, where the module says so (``OTHER_ID``), on a
foundation that blocks it; the same design without the bug (``BASES``) passes that requirement.
``DEMOS`` shows each bug with plain code, without the kit.

A variant the kit does not fail is a strict xfail from its module's ``KIT_DEFECTS``, whose
reason says what the kit's domain did not try: the entry goes once the kit catches the bug.
Each variant runs its requirement and that requirement's foundations only (``run_for``).
"""

from __future__ import annotations

import functools
from types import ModuleType

import pytest

from posttrain.conformance import Report, Status
from posttrain.contracts import Implementation, get_contract
from posttrain.contracts.requirements import Level
from tests.independent import (
    buffer_variants_r3,
    dpo_loss_variants_r3,
    generation_variants_r3,
    loss_variants_r3,
    metrics_variants_r3,
    nll_loss_variants_r3,
    rollout_variants_r3,
    weight_sync_variants_r3,
)
from tests.independent_kit import kit_params
from tests.outcomes import run_for

pytestmark = pytest.mark.reach  # make test-reach

_TIMEOUT_S = 60.0  # per requirement: a hang is a failed row, never a stalled run

MODULES: dict[str, ModuleType] = {
    "buffer": buffer_variants_r3,
    "rollout": rollout_variants_r3,
    "weight_sync": weight_sync_variants_r3,
    "generation": generation_variants_r3,
    "loss": loss_variants_r3,
    "nll_loss": nll_loss_variants_r3,
    "dpo_loss": dpo_loss_variants_r3,
    "metrics": metrics_variants_r3,
}
KEYS = sorted(f"{c}/{v}" for c, m in MODULES.items() for v in m.VARIANTS)
KIT_DEFECTS = {f"{c}/{v}": r for c, m in MODULES.items() for v, r in m.KIT_DEFECTS.items()}


def _parts(key: str) -> tuple[ModuleType, str]:
    contract, name = key.split("/", 1)
    return MODULES[contract], name


@functools.cache
def _cached(key: str, which: str) -> Report:
    module, name = _parts(key)
    impl: Implementation = getattr(module, which)[name]
    return run_for(impl, module.BREAKS[name], timeout_s=_TIMEOUT_S)


def _row(rep: Report, rid: str) -> str:
    row = {r.id: r for r in rep.results}[rid]
    return f"{row.status.value}{' (blocked)' if row.blocked else ''}: {row.message[:300]}"


# A variant whose shutdown raises does so in the kit's own helper thread.
@pytest.mark.filterwarnings("ignore::pytest.PytestUnhandledThreadExceptionWarning")
@pytest.mark.parametrize("key", kit_params(KEYS, KIT_DEFECTS))
def test_variant_fails_its_requirement(key: str) -> None:
    module, name = _parts(key)
    breaks = module.BREAKS[name]
    rep = _cached(key, "VARIANTS")
    rid = module.OTHER_ID.get(name, breaks)
    row = {r.id: r for r in rep.results}[rid]
    assert row.status is Status.FAIL, f"{key}: {rid} {_row(rep, rid)}"
    assert not row.blocked, f"{key}: {rid} {_row(rep, rid)}"
    if get_contract(module.VARIANTS[name].contract).requirement(rid).level is Level.MUST:
        assert not rep.ok, f"{key}: a failed MUST and the report conforms"


@pytest.mark.parametrize("key", KEYS)
def test_the_design_without_the_bug_passes_that_requirement(key: str) -> None:
    rep = _cached(key, "BASES")
    bad = {r.id: _row(rep, r.id) for r in rep.results if r.status in (Status.FAIL, Status.ERROR)}
    assert not bad, f"{key}'s base: {bad}"


@pytest.mark.parametrize("key", KEYS)
def test_variant_bug_is_real_without_the_kit(key: str) -> None:
    module, name = _parts(key)
    assert module.DEMOS[name]() is True


def test_every_variant_has_a_base_a_demo_and_a_requirement() -> None:
    for contract, m in MODULES.items():
        assert set(m.DEMOS) == set(m.VARIANTS) == set(m.BREAKS) == set(m.BASES), contract
        assert set(m.KIT_DEFECTS) | set(m.OTHER_ID) <= set(m.VARIANTS), contract
        for name, rid in m.BREAKS.items():
            get_contract(contract).requirement(rid)  # raises on an unknown id
            assert m.VARIANTS[name].contract == contract, name
