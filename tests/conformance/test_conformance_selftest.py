"""The kit's quality figure: every requirement has a broken implementation the suite fails with its id."""

from __future__ import annotations

import pytest
import torch

from posttrain.conformance import Status
from posttrain.conformance.registry import checks_for
from posttrain.conformance.runner import Session, run
from posttrain.contracts import CONTRACTS
from posttrain.contracts.implementation import Implementation
from posttrain.reference_impls import (
    GENERATION_SERVER,
    HF_ROLLOUT,
    IN_PROCESS_WEIGHT_SYNC,
    JSONL_SINK,
    PG_LOSSES,
    RING_BUFFER,
)
from posttrain.reference_impls.dpo_loss import DPO_LOSSES
from posttrain.reference_impls.nll_loss import NLL_LOSSES
from tests.mutants import (
    buffers,
    dpo_losses,
    generation,
    losses,
    nll_losses,
    rollouts,
    sinks,
    weight_syncs,
)
from tests.outcomes import run_for

MUTANTS: dict[str, dict[str, Implementation]] = {
    "buffer": buffers.MUTANTS,
    "loss": losses.MUTANTS,
    "rollout": rollouts.MUTANTS,
    "weight_sync": weight_syncs.MUTANTS,
    "metrics": sinks.MUTANTS,
    "generation": generation.MUTANTS,
    "nll_loss": nll_losses.MUTANTS,
    "dpo_loss": dpo_losses.MUTANTS,
}
REFERENCES = [
    RING_BUFFER,
    *PG_LOSSES.values(),
    HF_ROLLOUT,
    IN_PROCESS_WEIGHT_SYNC,
    JSONL_SINK,
    GENERATION_SERVER,
    *NLL_LOSSES,
    *DPO_LOSSES,
]
NEEDS_CUDA = {"BUF-021", "WS-009"}
NEEDS_RAY = {
    "BUF-023"
}  # run in tests/adapters/ray/test_ray.py, which owns the Ray cluster's lifetime


@pytest.mark.parametrize("impl", REFERENCES, ids=lambda i: i.name)
def test_reference_passes_every_applicable_requirement(impl: Implementation) -> None:
    rep = run(impl)
    bad = [r.message for r in rep.results if r.status not in (Status.PASS, Status.NOT_APPLICABLE)]
    assert not bad
    assert rep.ok


@pytest.mark.parametrize("contract", sorted(MUTANTS))
def test_every_requirement_has_a_check_and_a_mutant(contract: str) -> None:
    ids = sorted(r.id for r in CONTRACTS[contract].requirements)
    assert sorted(checks_for(contract)) == ids
    assert sorted(MUTANTS[contract]) == ids


@pytest.mark.parametrize(
    ("contract", "req_id"),
    [(c, r) for c, ms in sorted(MUTANTS.items()) for r in sorted(ms) if r not in NEEDS_RAY],
)
def test_mutant_fails_with_its_requirement_id(contract: str, req_id: str) -> None:
    if req_id in NEEDS_CUDA and not torch.cuda.is_available():
        pytest.skip(f"{req_id} needs a CUDA device to run (and to kill its mutant)")
    rep = run_for(MUTANTS[contract][req_id], req_id)
    row = {r.id: r for r in rep.results}[req_id]
    assert row.status in (Status.FAIL, Status.ERROR), f"{req_id} survived: {row}"
    assert row.message.startswith(f"{req_id}: ")
    assert "blocked by" not in row.message


@pytest.mark.parametrize(
    ("req_id", "impl"),
    [*buffers.EXTRA_MUTANTS, *losses.EXTRA_MUTANTS],
    ids=lambda x: x if isinstance(x, str) else x.name,
)
def test_extra_mutant_fails_with_its_requirement_id(req_id: str, impl: Implementation) -> None:
    row = {r.id: r for r in run_for(impl, req_id).results}[req_id]
    assert row.status in (Status.FAIL, Status.ERROR), f"{req_id} survived {impl.name}: {row}"
    assert row.message.startswith(f"{req_id}: ")


@pytest.mark.parametrize(
    ("req_id", "impl"),
    [
        *weight_syncs.EXTRA_MUTANTS,
        *rollouts.EXTRA_MUTANTS,
        *sinks.EXTRA_MUTANTS,
        *nll_losses.EXTRA_MUTANTS,
        *dpo_losses.EXTRA_MUTANTS,
    ],
    ids=lambda x: x if isinstance(x, str) else x.name,
)
def test_contract_extra_mutant_fails_with_its_requirement_id(
    req_id: str, impl: Implementation
) -> None:
    row = {r.id: r for r in run_for(impl, req_id).results}[req_id]
    assert row.status in (Status.FAIL, Status.ERROR), f"{req_id} survived {impl.name}: {row}"
    assert row.message.startswith(f"{req_id}: ")
    assert "blocked by" not in row.message


@pytest.mark.parametrize("impl", [*weight_syncs.CORRECT, *rollouts.CORRECT], ids=lambda i: i.name)
def test_other_correct_designs_pass(impl: Implementation) -> None:
    rep = run(impl)
    assert rep.ok, [r.message for r in rep.results if r.status is not Status.PASS]


@pytest.mark.parametrize("shift", sorted(rollouts.SHIFTED_MASKS))
def test_roll_005_names_a_shifted_mask_as_the_cause(shift: int) -> None:
    # Run alone: in a full run ROLL-001 fails first and ROLL-005 reports "blocked by".
    session = Session(rollouts.SHIFTED_MASKS[shift])
    row = session.run_one(session.contract.requirement("ROLL-005"))
    assert row.status is Status.FAIL
    assert f"the assistant mask is shifted by {shift:+d}" in row.message, row.message
    assert "old weights" not in row.message


@pytest.mark.parametrize(
    ("req_id", "impl"), generation.EXTRA_MUTANTS, ids=lambda x: x if isinstance(x, str) else x.name
)
def test_generation_extra_mutant_fails_with_its_requirement_id(
    req_id: str, impl: Implementation
) -> None:
    # Only the requirement and what it depends on: these servers hang or lose their worker,
    # and every other check would wait out its bound.
    session = Session(impl)
    wanted = {req_id, *session.contract.requirement(req_id).depends_on}
    for req in session.requirements():
        if req.id in wanted:
            session.run_one(req)
    row = session.results[req_id]
    assert row.status in (Status.FAIL, Status.ERROR), f"{req_id} survived {impl.name}: {row}"
    assert row.message.startswith(f"{req_id}: ")


def test_should_failure_does_not_fail_the_run() -> None:
    rep = run(buffers.MUTANTS["BUF-015"])
    assert rep.ok  # BUF-015 is a SHOULD
    failing = [r.id for r in rep.results if r.status in (Status.FAIL, Status.ERROR)]
    assert failing == ["BUF-015"]


def test_dependants_of_a_failed_foundation_are_blocked() -> None:
    rep = run(buffers.MUTANTS["BUF-001"])
    rows = {r.id: r for r in rep.results}
    assert rows["BUF-002"].message.startswith("BUF-002: blocked by BUF-001 (see ")
    assert rows["BUF-013"].status is Status.PASS  # independent of BUF-001


def test_every_contract_has_a_mutant_set() -> None:
    assert set(MUTANTS) == set(CONTRACTS)


def test_the_docs_carry_the_current_mutation_table() -> None:
    from tests.mutants import table

    assert table.in_docs() == table.render().strip("\n"), "run: python -m tests.mutants.table"
