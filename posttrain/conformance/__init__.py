"""The conformance kit: requirement-by-requirement checks of any implementation.

From the command line (any directory, no test files needed)::

    pytest --conformance=buffer --conformance-impl=posttrain.reference_impls:RING_BUFFER

From Python:

Example:
    >>> from posttrain.conformance import check
    >>> check("buffer", "reference-buffer").ok
    True
"""

import importlib
from typing import TYPE_CHECKING, Any

from posttrain._deprecated import deprecated_attr

if TYPE_CHECKING:  # the lazy names below and the deprecated ones (_MOVED), for type checkers
    from posttrain.conformance.api import check as check
    from posttrain.conformance.context import ConformanceError as ConformanceError
    from posttrain.conformance.context import Context as Context
    from posttrain.conformance.context import NotApplicable as NotApplicable
    from posttrain.conformance.outcome import Report as Report
    from posttrain.conformance.outcome import Result as Result
    from posttrain.conformance.outcome import Status as Status
    from posttrain.conformance.registry import checks_for as checks_for
    from posttrain.conformance.registry import requirement as requirement
    from posttrain.conformance.runner import Session as Session
    from posttrain.conformance.runner import run as run
    from posttrain.conformance.target import ENTRY_POINT_GROUP as ENTRY_POINT_GROUP
    from posttrain.conformance.target import TargetError as TargetError
    from posttrain.conformance.target import discover as discover
    from posttrain.conformance.target import resolve as resolve
    from posttrain.contracts.implementation import Implementation as Implementation

__all__ = [
    "ConformanceError",
    "Context",
    "NotApplicable",
    "Report",
    "Result",
    "Status",
    "TargetError",
    "check",
    "discover",
    "requirement",
]

_MOVED = {
    "run": (
        "posttrain.conformance.runner:run",
        "use check(contract, implementation): it takes the Implementation itself",
    ),
    "Session": ("posttrain.conformance.runner:Session", "use check()"),
    "resolve": ("posttrain.conformance.target:resolve", "pass the target string to check()"),
    "checks_for": (
        "posttrain.conformance.registry:checks_for",
        "import it from posttrain.conformance.registry",
    ),
    "ENTRY_POINT_GROUP": (
        "posttrain.conformance.target:ENTRY_POINT_GROUP",
        "the group is the string 'posttrain.implementations'",
    ),
    "Implementation": (
        "posttrain.contracts.implementation:Implementation",
        "import it from posttrain.contracts",
    ),
}


# Imported on first use: ``import posttrain.conformance`` (the pytest plugin, the command line)
# costs nothing until a name is read; ``check`` and the suites pull in torch.
_LAZY = {
    "check": "posttrain.conformance.api",
    "ConformanceError": "posttrain.conformance.context",
    "Context": "posttrain.conformance.context",
    "NotApplicable": "posttrain.conformance.context",
    "Report": "posttrain.conformance.outcome",
    "Result": "posttrain.conformance.outcome",
    "Status": "posttrain.conformance.outcome",
    "requirement": "posttrain.conformance.registry",
    "TargetError": "posttrain.conformance.target",
    "discover": "posttrain.conformance.target",
}


def __getattr__(name: str) -> Any:
    home = _LAZY.get(name)
    if home is None:
        return deprecated_attr(__name__, name, _MOVED)
    value = getattr(importlib.import_module(home), name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted({*globals(), *__all__})
