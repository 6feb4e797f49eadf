"""Counts given by callers: sizes, steps. Private to the contracts' helpers."""

from __future__ import annotations

import operator
from typing import Any


def as_count(value: Any) -> int | None:
    """``value`` as an int >= 0 (numpy and 0-d integer tensors too); None for anything else.

    A bool is refused: ``True`` as a size or a step is a bug, not 1.

    Example:
        >>> as_count(3), as_count(True), as_count(2.5), as_count(-1)
        (3, None, None, None)
    """
    if isinstance(value, bool):
        return None
    try:
        n = operator.index(value)
    except TypeError:
        return None
    return n if n >= 0 else None
