"""Dtype and layout names as posttrain's messages and saved states write them: ``float32``,
not ``torch.float32``; and back from a name to the dtype."""

from __future__ import annotations

import torch

DTYPES: dict[str, torch.dtype] = {
    str(dt).removeprefix("torch."): dt
    for dt in (
        torch.bool,
        torch.uint8,
        torch.int8,
        torch.int16,
        torch.int32,
        torch.int64,
        torch.float16,
        torch.bfloat16,
        torch.float32,
        torch.float64,
        torch.complex64,
        torch.complex128,
    )
}
"""The dtypes a name may stand for: ``'float32'`` -> ``torch.float32`` and so on.

Also the one allowlist of what a buffer stores: a first write of another dtype (``uint16``,
``float8_e4m3fn``...) is refused, as the load of a checkpoint naming one is, so nothing is
saved that cannot be loaded back."""

STORABLE: frozenset[torch.dtype] = frozenset(DTYPES.values())
"""The dtypes of :data:`DTYPES`, for a membership test on the write path."""


def dtype_name(dtype: torch.dtype | torch.layout) -> str:
    """``torch.float32`` -> ``'float32'`` (a layout too: ``torch.sparse_coo`` -> ``'sparse_coo'``).

    Example:
        >>> dtype_name(torch.bfloat16), dtype_name(torch.strided)
        ('bfloat16', 'strided')
    """
    return str(dtype).removeprefix("torch.")
