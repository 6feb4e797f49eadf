"""Conformance without pytest, for notebooks and scripts."""

from __future__ import annotations

from posttrain.conformance.outcome import Report
from posttrain.conformance.runner import run
from posttrain.conformance.target import resolve
from posttrain.contracts.implementation import Implementation

__all__ = ["check"]


def check(contract: str, target: str | Implementation, *, seed: int = 0) -> Report:
    """Run ``contract``'s suite against ``target``; return the report (it never raises on FAIL).

    Example:
        >>> rep = check("buffer", "posttrain.reference_impls:RING_BUFFER")
        >>> rep.ok, rep.counts()["FAIL"]
        (True, 0)
    """
    if isinstance(target, Implementation):
        impl, name = target, target.name
    else:
        impl, name = resolve(target, contract), target
    if impl.contract != contract:
        raise ValueError(f"target {name!r} implements {impl.contract!r}, not {contract!r}")
    return run(impl, target=name, seed=seed)
