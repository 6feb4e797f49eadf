"""What a conformance run failed, for tests that compare it with a declaration."""

from __future__ import annotations

from posttrain.conformance.runner import run
from posttrain.contracts.implementation import Implementation


def own_failures(impl: Implementation) -> dict[str, str]:
    """Requirement id -> message for each check that itself failed or errored (as
    ``Report.failed_ids``: a row only blocked by another requirement's failure is left out)."""
    rep = run(impl)
    ids = rep.failed_ids()
    return {r.id: r.message for r in rep.results if r.id in ids}
