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

from typing import Any

from posttrain._deprecated import deprecated_attr, moved_to

_MOVED = {
    **moved_to(
        "posttrain.adapters.nemo_rl.train_data",
        *("NEMO_KEY", "NemoFormatError", "batched_data_dict", "from_layout", "to_layout"),
    ),
    **moved_to(
        "posttrain.adapters.nemo_rl.batching",
        *("flatten_message_logs", "from_batches", "shard_by_batch_size"),
    ),
    **moved_to(
        "posttrain.adapters.nemo_rl.wire",
        *("TOKEN_ALIGNED_FIELDS", "layout_to_wire", "materialize", "pack_jagged_fields"),
        "wire_to_layout",
    ),
}


def __getattr__(name: str) -> Any:
    return deprecated_attr(__name__, name, _MOVED)
