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

from typing import Any

from posttrain._deprecated import deprecated_attr, moved_to

_MOVED = moved_to("posttrain.testing", "PROMPT_LEN", "item_uids", "llm_batch", "ragged_llm_batch")


def __getattr__(name: str) -> Any:
    return deprecated_attr(__name__, name, _MOVED)
