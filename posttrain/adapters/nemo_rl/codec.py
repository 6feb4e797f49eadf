"""Deprecated: split by what each part holds (removed in posttrain 0.2).

NeMo-RL's training data <-> the layout is :mod:`posttrain.adapters.nemo_rl.train_data`, its
batching helpers :mod:`~posttrain.adapters.nemo_rl.batching`, and the data plane's jagged wire
format :mod:`~posttrain.adapters.nemo_rl.wire`.

Example:
    >>> import warnings
    >>> with warnings.catch_warnings(record=True) as w:
    ...     warnings.simplefilter("always")
    ...     from posttrain.adapters.nemo_rl.codec import to_layout
    >>> str(w[0].message)
    'posttrain.adapters.nemo_rl.codec.to_layout is deprecated and will be removed in posttrain 0.2: import it from posttrain.adapters.nemo_rl.train_data'
"""

from __future__ import annotations

import importlib
import warnings
from typing import Any

_MOVED = {
    **dict.fromkeys(
        ("NEMO_KEY", "NemoFormatError", "batched_data_dict", "from_layout", "to_layout"),
        "train_data",
    ),
    **dict.fromkeys(("flatten_message_logs", "from_batches", "shard_by_batch_size"), "batching"),
    **dict.fromkeys(
        (
            "TOKEN_ALIGNED_FIELDS",
            "layout_to_wire",
            "materialize",
            "pack_jagged_fields",
            "wire_to_layout",
        ),
        "wire",
    ),
}


def __getattr__(name: str) -> Any:
    if name not in _MOVED:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    where = f"posttrain.adapters.nemo_rl.{_MOVED[name]}"
    warnings.warn(
        f"{__name__}.{name} is deprecated and will be removed in posttrain 0.2: "
        f"import it from {where}",
        DeprecationWarning,
        stacklevel=2,
    )
    return getattr(importlib.import_module(where), name)
