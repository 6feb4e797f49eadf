"""Deprecated: the tiny policies moved to :mod:`posttrain.testing` (removed in 0.3).

Example:
    >>> import warnings
    >>> with warnings.catch_warnings(record=True) as w:
    ...     warnings.simplefilter("always")
    ...     from posttrain.conformance.policy import tiny_causal_lm
    >>> str(w[0].message)
    'posttrain.conformance.policy.tiny_causal_lm moved to posttrain.testing.tiny_causal_lm; import it from there (this alias goes in 0.3)'
"""

from __future__ import annotations

import warnings
from typing import Any

from posttrain.testing import policies as _new

__all__: list[str] = []
_MOVED = ("forced_token_weights", "tiny_causal_lm", "tiny_reward_model")


def __getattr__(name: str) -> Any:
    if name in _MOVED:
        warnings.warn(
            f"posttrain.conformance.policy.{name} moved to posttrain.testing.{name}; "
            "import it from there (this alias goes in 0.3)",
            DeprecationWarning,
            stacklevel=2,
        )
        return getattr(_new, name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
