"""The one way a suite's check reports a broken requirement."""

from __future__ import annotations

from posttrain.conformance.context import ConformanceError


def fail(msg: str) -> ConformanceError:
    """The error a check raises: ``raise fail("extend of 3 items: expected len 3, found 2")``.

    Example:
        >>> str(fail("len is 3, expected 2"))
        'len is 3, expected 2'
    """
    return ConformanceError(msg)
