"""Deprecated: the batch builders moved to :mod:`posttrain.testing` (removed in posttrain 0.2).

Example:
    >>> import warnings
    >>> with warnings.catch_warnings(record=True) as w:
    ...     warnings.simplefilter("always")
    ...     from posttrain.conformance.data import llm_batch
    >>> str(w[0].message)
    'posttrain.conformance.data.llm_batch is deprecated and will be removed in posttrain 0.2: import it from posttrain.testing'
"""

from __future__ import annotations

import warnings
from typing import Any

from posttrain.testing import batches as _new

_MOVED = ("PROMPT_LEN", "item_uids", "llm_batch", "ragged_llm_batch")


def __getattr__(name: str) -> Any:
    if name in _MOVED:
        warnings.warn(
            f"{__name__}.{name} is deprecated and will be removed in posttrain 0.2: "
            "import it from posttrain.testing",
            DeprecationWarning,
            stacklevel=2,
        )
        return getattr(_new, name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
