"""The conformance kit: requirement-by-requirement checks of any implementation.

From the command line (any directory, no test files needed)::

    pytest --conformance=buffer --conformance-impl=posttrain.reference_impls:RING_BUFFER

From Python:

Example:
    >>> from posttrain.conformance import check
    >>> check("buffer", "reference-buffer").ok
    True
"""

from typing import TYPE_CHECKING, Any

from posttrain._deprecated import deprecated_attr
from posttrain.conformance.api import check
from posttrain.conformance.context import ConformanceError, Context, NotApplicable
from posttrain.conformance.outcome import Report, Result, Status
from posttrain.conformance.registry import requirement
from posttrain.conformance.target import TargetError, discover

if TYPE_CHECKING:  # the deprecated names below, typed for code that still uses them
    from posttrain.conformance.registry import checks_for as checks_for
    from posttrain.conformance.runner import Session as Session
    from posttrain.conformance.runner import run as run
    from posttrain.conformance.target import ENTRY_POINT_GROUP as ENTRY_POINT_GROUP
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


def __getattr__(name: str) -> Any:
    return deprecated_attr(__name__, name, _MOVED)
