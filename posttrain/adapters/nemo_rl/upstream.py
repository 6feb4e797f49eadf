"""Which class an adapter uses: ``nemo_rl``'s own where it imports, else posttrain's mirror.

The adapters speak NeMo-RL's formats either way; this is the one place that chooses between
NeMo-RL's class and the copy in :mod:`posttrain.adapters.nemo_rl.mirror` (for code that runs
without NeMo-RL, which is not on the package index).
"""

from __future__ import annotations

import importlib
from typing import Any

UPSTREAM = {
    "BatchedDataDict": "nemo_rl.distributed.batched_data_dict",
    "LossType": "nemo_rl.algorithms.loss.interfaces",
    "LossInputType": "nemo_rl.algorithms.loss.interfaces",
}
"""Each NeMo-RL name an adapter uses where ``nemo_rl`` imports: the module defining it (7ea279a)."""

MIRRORED = {
    "BatchedDataDict": (
        UPSTREAM["BatchedDataDict"],
        "posttrain.adapters.nemo_rl.mirror.batched_data_dict",
    ),
}
"""Each mirrored name: (the ``nemo_rl`` module defining it, the mirror module copying it).

The loss enums have no mirror: without ``nemo_rl`` the loss wrappers carry their string values."""


def from_nemo_rl(name: str) -> Any | None:
    """``nemo_rl``'s own object ``name`` (a key of :data:`UPSTREAM`), or ``None`` where it does not import.

    Looked up at each call, so a ``nemo_rl`` installed later is picked up; an unknown
    ``name`` raises ``KeyError`` naming the known ones.

    Example:
        >>> from_nemo_rl("BatchedDataDict") is None  # nemo_rl is not installed here
        True
    """
    if name not in UPSTREAM:
        raise KeyError(f"name: expected one of {sorted(UPSTREAM)}, found {name!r}")
    try:
        module = importlib.import_module(UPSTREAM[name])
    except ImportError:
        return None
    return getattr(module, name)


def nemo_rl_or_mirror(name: str) -> Any:
    """``nemo_rl``'s own object ``name`` where it imports (:func:`from_nemo_rl`), else the mirror's.

    Example:
        >>> nemo_rl_or_mirror("BatchedDataDict").__module__  # nemo_rl is not installed here
        'posttrain.adapters.nemo_rl.mirror.batched_data_dict'
    """
    if name not in MIRRORED:
        raise KeyError(f"name: expected one of {sorted(MIRRORED)}, found {name!r}")
    found = from_nemo_rl(name)
    if found is not None:
        return found
    return getattr(importlib.import_module(MIRRORED[name][1]), name)
