"""Argument checks shared by every constructor and call that takes a count or a size.

One behaviour everywhere: any integral number is accepted (``int``, numpy integers, 0-d
integer tensors: whatever ``operator.index`` takes) and returned as a plain ``int``; ``bool`` is
refused (``True`` as a size is a bug, not 1), and so are floats, even whole ones. A refusal is a
``ValueError`` naming the argument, what was expected and what was found.
"""

from __future__ import annotations

import operator
from typing import Any


def as_count(value: Any) -> int | None:
    """``value`` as an int >= 0 (numpy and 0-d integer tensors too); None for anything else.

    Example:
        >>> import numpy as np
        >>> as_count(3), as_count(np.int64(2)), as_count(True), as_count(2.0), as_count(-1)
        (3, 2, None, None, None)
    """
    if isinstance(value, bool):
        return None
    try:
        n = operator.index(value)
    except TypeError:
        return None
    return n if n >= 0 else None


def non_negative_int(name: str, value: Any) -> int:
    """``value`` as an int >= 0, or a ValueError naming ``name``.

    Example:
        >>> non_negative_int("total_batches", 0)
        0
        >>> non_negative_int("total_batches", -1)
        Traceback (most recent call last):
        ...
        ValueError: total_batches: expected an int >= 0, found -1
    """
    n = as_count(value)
    if n is None:
        raise ValueError(f"{name}: expected an int >= 0, found {value!r}")
    return n


def positive_int(name: str, value: Any) -> int:
    """``value`` as an int >= 1, or a ValueError naming ``name``.

    Example:
        >>> import numpy as np
        >>> positive_int("capacity", np.int64(4))
        4
        >>> positive_int("capacity", True)
        Traceback (most recent call last):
        ...
        ValueError: capacity: expected a positive int, found True
    """
    n = as_count(value)
    if n is None or n == 0:
        raise ValueError(f"{name}: expected a positive int, found {value!r}")
    return n


def token_prompts(prompts: Any) -> list[list[int]]:
    """A rollout source's ``prompts``: a non-empty list of non-empty token-id lists, copied.

    Example:
        >>> token_prompts([[5, 6], (7,)])
        [[5, 6], [7]]
        >>> token_prompts([[5], []])
        Traceback (most recent call last):
        ...
        ValueError: prompts: expected a non-empty list of non-empty token lists
    """
    if not prompts or any(not p for p in prompts):
        raise ValueError("prompts: expected a non-empty list of non-empty token lists")
    return [list(map(int, p)) for p in prompts]
