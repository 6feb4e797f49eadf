"""The conformance kit: requirement-by-requirement checks of any implementation.

From the command line (any directory, no test files needed)::

    pytest --conformance=buffer --conformance-impl=posttrain.reference_impls:RING_BUFFER

From Python:

Example:
    >>> from posttrain.conformance import check
    >>> check("buffer", "reference-buffer").ok
    True
"""

from posttrain.conformance.api import check
from posttrain.conformance.context import ConformanceError, Context, NotApplicable
from posttrain.conformance.outcome import Report, Result, Status
from posttrain.conformance.registry import checks_for, requirement
from posttrain.conformance.runner import Session, run
from posttrain.conformance.target import ENTRY_POINT_GROUP, TargetError, discover, resolve
from posttrain.contracts.implementation import Implementation

__all__ = [
    "ENTRY_POINT_GROUP",
    "ConformanceError",
    "Context",
    "Implementation",
    "NotApplicable",
    "Report",
    "Result",
    "Session",
    "Status",
    "TargetError",
    "check",
    "checks_for",
    "discover",
    "requirement",
    "resolve",
    "run",
]
