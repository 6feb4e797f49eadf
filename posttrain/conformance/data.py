"""Deprecated: the batch builders moved to :mod:`posttrain.testing` (removed in 0.3).

Example:
    >>> import warnings
    >>> with warnings.catch_warnings(record=True) as w:
    ...     warnings.simplefilter("always")
    ...     from posttrain.conformance.data import llm_batch
    >>> str(w[0].message)
    'posttrain.conformance.data.llm_batch moved to posttrain.testing.llm_batch; import it from there (this alias goes in 0.3)'
"""

from __future__ import annotations

import warnings
from typing import Any

from posttrain.testing import batches as _new

__all__: list[str] = []
_MOVED = ("PROMPT_LEN", "item_uids", "llm_batch", "ragged_llm_batch")


def __getattr__(name: str) -> Any:
    if name in _MOVED:
        warnings.warn(
            f"posttrain.conformance.data.{name} moved to posttrain.testing.{name}; "
            "import it from there (this alias goes in 0.3)",
            DeprecationWarning,
            stacklevel=2,
        )
        return getattr(_new, name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
