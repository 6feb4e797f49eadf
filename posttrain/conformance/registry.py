"""Which check function verifies which requirement, and where a contract's suite lives.

One mechanism: a check registers itself with ``@requirement("<ID>")``, under the contract whose
catalogue holds that id. A bundled contract's suite is the module
``posttrain.conformance.suites.<contract id>``, imported the first time its checks are asked
for; a suite outside the package registers the same way, by being imported.
"""

from __future__ import annotations

import importlib
import importlib.util
import sys
from collections.abc import Callable
from pathlib import Path

from posttrain.conformance.context import Context
from posttrain.contracts.registry import CONTRACTS, get_contract

Check = Callable[[Context], None]

SUITES_PACKAGE = "posttrain.conformance.suites"
"""Where a bundled contract's suite lives: ``<SUITES_PACKAGE>.<contract id>``."""

_CHECKS: dict[str, dict[str, Check]] = {}


def requirement(req_id: str) -> Callable[[Check], Check]:
    """Register the decorated function as the check of ``req_id`` (one check per requirement).

    The requirement's contract is found from its id, so a suite module needs no registration
    of its own.

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


def _import_bundled_suite(contract_id: str) -> None:
    name = f"{SUITES_PACKAGE}.{contract_id}"
    if name not in sys.modules and importlib.util.find_spec(name) is not None:
        importlib.import_module(name)


def checks_for(contract_id: str) -> dict[str, Check]:
    """The checks of one contract's suite, by requirement id (imports a bundled suite first).

    Example:
        >>> sorted(checks_for("buffer"))[:2]
        ['BUF-001', 'BUF-002']
    """
    get_contract(contract_id)
    _import_bundled_suite(contract_id)
    return dict(_CHECKS.get(contract_id, {}))


def suite_file(contract_id: str) -> Path | None:
    """The file that holds a contract's checks (the first requirement's), ``None`` if none.

    Example:
        >>> suite_file("loss").name
        'loss.py'
    """
    checks = checks_for(contract_id)
    for r in get_contract(contract_id).requirements:
        fn = checks.get(r.id)
        module = sys.modules.get(fn.__module__) if fn is not None else None
        if module is not None and getattr(module, "__file__", None):
            return Path(str(module.__file__))
    return None
