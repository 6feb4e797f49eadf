"""Old public names kept for one minor version: the module ``__getattr__`` that warns, then answers.

A module that dropped or renamed a public name lists it in a ``{old name: (target, advice)}``
table, the target as ``"module:attribute"`` (imported on first use, so a shim pulls nothing in
before it is used), and defines::

    def __getattr__(name: str) -> Any:
        return deprecated_attr(__name__, name, _MOVED)

:func:`moved_to` writes the table for names that only changed module.
"""

from __future__ import annotations

import importlib
import warnings
from collections.abc import Mapping
from typing import Any

REMOVED_IN = "0.2"


def deprecated_attr(module: str, name: str, moved: Mapping[str, tuple[str, str]]) -> Any:
    """``moved[name]``'s target, with a DeprecationWarning pointing at the caller's line.

    Example:
        >>> import warnings
        >>> moved = {"old": ("posttrain.errors:PosttrainError", "use new")}
        >>> with warnings.catch_warnings(record=True) as w:
        ...     warnings.simplefilter("always")
        ...     deprecated_attr("m", "old", moved).__name__, str(w[0].message)
        ('PosttrainError', 'm.old is deprecated and will be removed in posttrain 0.2: use new')
    """
    if name not in moved:
        raise AttributeError(f"module {module!r} has no attribute {name!r}")
    target, advice = moved[name]
    warnings.warn(
        f"{module}.{name} is deprecated and will be removed in posttrain {REMOVED_IN}: {advice}",
        DeprecationWarning,
        stacklevel=3,  # the line that read module.name, past the module's __getattr__
    )
    where, attr = target.split(":")
    return getattr(importlib.import_module(where), attr)


def moved_to(module: str, *names: str) -> dict[str, tuple[str, str]]:
    """Table entries for ``names`` that now live, under the same names, in ``module``.

    Example:
        >>> moved_to("posttrain.testing", "llm_batch")
        {'llm_batch': ('posttrain.testing:llm_batch', 'import it from posttrain.testing')}
    """
    return {n: (f"{module}:{n}", f"import it from {module}") for n in names}
