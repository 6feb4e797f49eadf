"""The conformance kit: requirement-by-requirement checks of any implementation.

From the command line (any directory, no test files needed)::

    pytest --conformance=buffer --conformance-impl=posttrain.reference_impls:RING_BUFFER

From Python:

Example:
    >>> from posttrain.conformance import check
    >>> check("weight_sync", "reference-weight-sync").ok  # doctest: +SKIP
    True
"""

import importlib
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:  # the lazy names below, for type checkers
    from posttrain.conformance.api import check as check
    from posttrain.conformance.context import ConformanceError as ConformanceError
    from posttrain.conformance.context import Context as Context
    from posttrain.conformance.context import NotApplicable as NotApplicable
    from posttrain.conformance.outcome import Report as Report
    from posttrain.conformance.outcome import Status as Status
    from posttrain.conformance.registry import requirement as requirement
    from posttrain.conformance.target import discover as discover

__all__ = [
    "ConformanceError",
    "Context",
    "NotApplicable",
    "Report",
    "Status",
    "check",
    "discover",
    "requirement",
]

# Imported on first use: ``import posttrain.conformance`` (the pytest plugin, the command line)
# costs nothing until a name is read; ``check`` and the suites pull in torch.
_LAZY = {
    "check": "posttrain.conformance.api",
    "ConformanceError": "posttrain.conformance.context",
    "Context": "posttrain.conformance.context",
    "NotApplicable": "posttrain.conformance.context",
    "Report": "posttrain.conformance.outcome",
    "Status": "posttrain.conformance.outcome",
    "requirement": "posttrain.conformance.registry",
    "discover": "posttrain.conformance.target",
}


def __getattr__(name: str) -> Any:
    home = _LAZY.get(name)
    if home is None:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    value = getattr(importlib.import_module(home), name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted({*globals(), *__all__})
