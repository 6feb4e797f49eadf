"""Settling a ``concurrent.futures.Future`` that another party may already have settled."""

from __future__ import annotations

import contextlib
from concurrent.futures import Future, InvalidStateError
from typing import Any


def settle(fut: Future[Any], *, result: Any = None, error: BaseException | None = None) -> None:
    """Set ``fut``'s exception (``error``) or result, unless it is already done.

    A future cancelled by its caller, or already failed by a ``shutdown()``, keeps its outcome.

    Example:
        >>> from concurrent.futures import Future
        >>> f: Future[int] = Future()
        >>> settle(f, result=1); settle(f, error=RuntimeError("late"))
        >>> f.result()
        1
    """
    with contextlib.suppress(InvalidStateError):
        if error is not None:
            fut.set_exception(error)
        else:
            fut.set_result(result)
