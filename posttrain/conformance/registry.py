"""Which check function verifies which requirement."""

from __future__ import annotations

import importlib
from collections.abc import Callable

from posttrain.conformance.context import Context
from posttrain.contracts.registry import CONTRACTS, get_contract

__all__ = ["Check", "checks_for", "requirement"]

Check = Callable[[Context], None]

_CHECKS: dict[str, dict[str, Check]] = {}
_SUITE_MODULES = {
    "buffer": "posttrain.conformance.suites.buffer",
    "loss": "posttrain.conformance.suites.loss",
    "rollout": "posttrain.conformance.suites.rollout",
    "weight_sync": "posttrain.conformance.suites.weight_sync",
    "metrics": "posttrain.conformance.suites.metrics",
    "generation": "posttrain.conformance.suites.generation",
}


def requirement(req_id: str) -> Callable[[Check], Check]:
    """Register the decorated function as the check of ``req_id`` (one check per requirement).

    Example:
        >>> @requirement("BUF-013")  # doctest: +SKIP
        ... def empty_sample_raises(ctx): ...
    """
    contract_id = _contract_of(req_id)

    def deco(fn: Check) -> Check:
        suite = _CHECKS.setdefault(contract_id, {})
        prev = suite.get(req_id)
        # A re-import of the same suite module (pytester restores sys.modules) re-registers.
        if prev is not None and (prev.__module__, prev.__qualname__) != (
            fn.__module__,
            fn.__qualname__,
        ):
            raise ValueError(f"{req_id} already has a check: {prev.__qualname__}")
        suite[req_id] = fn
        return fn

    return deco


def _contract_of(req_id: str) -> str:
    for c in CONTRACTS.values():
        if any(r.id == req_id for r in c.requirements):
            return c.id
    raise KeyError(f"no contract has a requirement {req_id!r}")


def checks_for(contract_id: str) -> dict[str, Check]:
    """The checks of one contract's suite, by requirement id (imports the suite on first use).

    Example:
        >>> sorted(checks_for("buffer"))[:2]
        ['BUF-001', 'BUF-002']
    """
    get_contract(contract_id)
    module = _SUITE_MODULES.get(contract_id)
    if module is not None:
        importlib.import_module(module)
    return dict(_CHECKS.get(contract_id, {}))
