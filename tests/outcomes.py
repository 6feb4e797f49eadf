"""What a conformance run failed, for tests that compare it with a declaration."""

from __future__ import annotations

from posttrain.conformance.outcome import Report
from posttrain.conformance.runner import run
from posttrain.contracts.implementation import Implementation


def own_failures(impl: Implementation) -> dict[str, str]:
    """Requirement id -> message for each check that itself failed or errored (as
    ``Report.failed_ids``: a row only blocked by another requirement's failure is left out)."""
    rep = run(impl)
    ids = rep.failed_ids()
    return {r.id: r.message for r in rep.results if r.id in ids}


def closure(contract_id: str, rid: str) -> set[str]:
    """``rid`` and every requirement it depends on, transitively."""
    from posttrain.contracts.registry import get_contract

    contract = get_contract(contract_id)
    seen: set[str] = set()
    todo = [rid]
    while todo:
        r = todo.pop()
        if r not in seen:
            seen.add(r)
            todo.extend(contract.requirement(r).depends_on)
    return seen


def run_for(
    impl: Implementation, rid: str, timeout_s: float | None = None, depth: int = 1
) -> Report:
    """The run of ``rid`` and its foundations only, in catalogue order: the row of ``rid`` is
    what a whole run reports for it (a failed foundation blocks it there too), without the
    time of every other check."""
    from posttrain.conformance.runner import Session

    s = Session(impl, timeout_s=timeout_s, depth=depth)
    wanted = closure(impl.contract, rid)
    for req in s.requirements():
        if req.id in wanted:
            s.run_one(req)
    return s.report()
