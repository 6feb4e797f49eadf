"""Deprecated: the tiny policies moved to :mod:`posttrain.testing` (removed in posttrain 0.2).

Example:
    >>> import warnings
    >>> with warnings.catch_warnings(record=True) as w:
    ...     warnings.simplefilter("always")
    ...     from posttrain.conformance.policy import tiny_causal_lm
    >>> str(w[0].message)
    'posttrain.conformance.policy.tiny_causal_lm is deprecated and will be removed in posttrain 0.2: import it from posttrain.testing'
"""

from __future__ import annotations

import warnings
from typing import Any

from posttrain.testing import policies as _new

_MOVED = ("forced_token_weights", "tiny_causal_lm", "tiny_reward_model")


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
