"""The reference ring's storage: every item one row of a uint8 matrix that packs all its keys.

A column says where one key's bytes sit inside a row; typed views reinterpret a whole matrix
(the ring, or a gather of its rows) as one tensor per key without copying.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
from tensordict import TensorDict

from posttrain.contracts.schema import ItemSchema

ALIGN = 8
"""Rows are padded to a multiple of this many bytes."""


@dataclass(frozen=True)
class Column:
    """Where one key's item sits in a row: its dtype, trailing shape and bytes."""

    dtype: torch.dtype
    shape: tuple[int, ...]  # trailing (per-item) shape
    offset: int  # byte offset inside a row
    nbytes: int

    def strides(self, row_bytes: int) -> tuple[int, ...]:
        """Element strides of ``[n, *shape]`` inside rows of ``row_bytes`` bytes."""
        inner: list[int] = []
        step = 1
        for size in reversed(self.shape):
            inner.insert(0, step)
            step *= size
        return (row_bytes // self.dtype.itemsize, *inner)


Columns = dict[tuple[str, ...], Column]


def layout(schema: ItemSchema) -> Columns:
    """Each key's column in a row holding one item of ``schema``."""
    cols: Columns = {}
    offset = 0
    # Widest dtypes first keeps every column aligned to its element size.
    for k, c in sorted(schema.columns.items(), key=lambda kc: -kc[1].dtype.itemsize):
        nbytes = int(torch.Size(c.shape).numel()) * c.dtype.itemsize
        cols[k] = Column(c.dtype, c.shape, offset, nbytes)
        offset += nbytes
    return cols


def views(rows: torch.Tensor, columns: Columns | None) -> dict[tuple[str, ...], torch.Tensor]:
    """One typed view per key of byte ``rows`` laid out as ``columns`` (no copy)."""
    # One reinterpreting view per dtype, then one as_strided per key: a third of the time
    # of slicing and viewing each column (~11 us against ~34 us for the LLM layout), which
    # is a fifth of a B=64, T=512 sample.
    assert columns is not None
    assert rows.stride(1) == 1  # byte rows, each contiguous (the ring, or a gather of it)
    n, row_bytes = rows.shape[0], rows.stride(0)
    bases: dict[torch.dtype, torch.Tensor] = {}
    out = {}
    for k, c in columns.items():
        base = bases.get(c.dtype)
        if base is None:
            base = bases[c.dtype] = rows.view(c.dtype)
        out[k] = base.as_strided(
            (n, *c.shape),
            c.strides(row_bytes),
            base.storage_offset() + c.offset // c.dtype.itemsize,
        )
    return out


def used_bytes(columns: Columns) -> int:
    """The bytes of a row the columns fill (the rest is padding)."""
    return sum(c.nbytes for c in columns.values())


def row_bytes(columns: Columns) -> int:
    """One item's bytes in the ring: every column, rounded up to the alignment."""
    return -(-used_bytes(columns) // ALIGN) * ALIGN


def new_rows(n: int, columns: Columns, device: torch.device) -> torch.Tensor:
    """``n`` rows laid out as ``columns``, their padding zero: no write ever fills it, and a
    checkpoint must not carry whatever memory the allocator handed back (rows past ``len``
    are never saved)."""
    rows = torch.empty(n, row_bytes(columns), dtype=torch.uint8, device=device)
    used = used_bytes(columns)
    if used < rows.shape[1]:
        rows[:, used:].zero_()
    return rows


def nesting(
    keys: list[tuple[str, ...]],
) -> Callable[[dict[tuple[str, ...], torch.Tensor]], dict[str, Any]]:
    """A function turning ``{("a", "b"): x}`` into ``{"a": {"b": x}}`` for these keys."""

    def nest(flat: dict[tuple[str, ...], torch.Tensor]) -> dict[str, Any]:
        out: dict[str, Any] = {}
        for k in keys:
            d = out
            for part in k[:-1]:
                d = d.setdefault(part, {})
            d[k[-1]] = flat[k]
        return out

    return nest


def as_tensordict(nested: dict[str, Any], n: int, device: torch.device) -> TensorDict:
    """The views ``nested`` (each ``[n, ...]``) as a TensorDict of batch size ``[n]``."""
    # The checked constructor re-validates every leaf against the batch size (~30 us for the
    # LLM layout, as long as the gather); these views are [n, ...] by construction.
    unsafe = getattr(TensorDict, "_new_unsafe", None)
    if unsafe is not None:
        out: TensorDict = unsafe(nested, batch_size=torch.Size([n]), device=device)
        return out
    return TensorDict(nested, batch_size=[n], device=device)
