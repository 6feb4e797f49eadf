"""Conformance without pytest, for notebooks and scripts."""

from __future__ import annotations

from posttrain.conformance.outcome import Report
from posttrain.conformance.runner import DEFAULT_TIMEOUT_S, run
from posttrain.conformance.target import resolve
from posttrain.contracts.implementation import Implementation


def check(
    contract: str,
    target: str | Implementation,
    *,
    seed: int = 0,
    timeout_s: float | None = DEFAULT_TIMEOUT_S,
    depth: int = 1,
) -> Report:
    """Run ``contract``'s suite against ``target``; return the report (it never raises on FAIL).

    ``target`` is ``module:attr``, an entry-point name or the :class:`Implementation` itself
    (its rows' repro commands then name the module attribute that holds it, if one does).
    ``depth`` multiplies the generated inputs and random call sequences each check tries.

    Example:
        >>> rep = check("weight_sync", "posttrain.reference_impls:IN_PROCESS_WEIGHT_SYNC")  # doctest: +SKIP
        >>> rep.ok, rep.counts()["FAIL"]  # doctest: +SKIP
        (True, 0)
    """
    if isinstance(target, Implementation):
        impl, name = target, ""
    else:
        impl, name = resolve(target, contract), target
    if impl.contract != contract:
        raise ValueError(
            f"target {name or impl.name!r} implements {impl.contract!r}, not {contract!r}"
        )
    return run(impl, target=name, seed=seed, timeout_s=timeout_s, depth=depth)
