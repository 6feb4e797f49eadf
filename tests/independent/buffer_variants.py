"""One-bug replay buffers written from ``specs/buffer-v1.md`` alone, to measure the kit's reach.

Each variant subclasses a correct design of :mod:`tests.independent.buffers`
(:class:`ListFifoBuffer`, declared here with ``read`` only, or :class:`KeyedArrayBuffer`) and
changes one thing. Its docstring names the bug, a system that shipped a bug of that kind (or
says it is plausible), and the requirement sentence it breaks; ``demo_<name>()`` shows the bug
with plain code against that sentence (True when the bug shows).

Example:
    >>> sorted(VARIANTS)[0]
    'empty_first_extend_fixes_schema'
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
from tensordict import TensorDict, TensorDictBase

from posttrain.contracts import Implementation
from tests.independent.buffers import (
    Key,
    KeyedArrayBuffer,
    ListFifoBuffer,
    Schema,
    _check,
    _leaves,
    _rows,
    _schema_of,
)

__all__ = ["BASES", "DEMOS", "VARIANTS"]


def _td(**cols: torch.Tensor) -> TensorDict:
    n = next(iter(cols.values())).shape[0]
    return TensorDict(dict(cols), batch_size=[n])


# ---------------------------------------------------------------------------------------------
# The variants


class RandintHighExclusiveBuffer(ListFifoBuffer):
    """BUG: draws ``randrange(len - 1)``: the upper bound written as if it were inclusive
    (Python's ``random.randint`` habit carried over to NumPy's exclusive
    ``randint(0, len(memory) - 1)``), so the item in the last occupied slot is never drawn.
    Plausible; a slip seen in hand-written DQN replay buffers.

    Breaks BUF-007 ("repeated sampling MUST reach every stored item").
    """

    def _draw(self, n: int) -> list[int]:
        size = len(self._slots)
        return [self._rng.randrange(max(size - 1, 1)) for _ in range(n)]


def demo_randint_high_exclusive() -> bool:
    rb = RandintHighExclusiveBuffer(4)
    rb.extend(_td(x=torch.arange(4)))
    seen = {int(v) for _ in range(50) for v in rb.sample(40)["x"]}
    return seen != {0, 1, 2, 3}


class NanScrubbingBuffer(ListFifoBuffer):
    """BUG: float columns are cleaned with ``nan_to_num`` on the way in (TorchRL writes NaN
    outside the assistant mask, NeMo-RL writes 0; a buffer "normalising" one to the other),
    so a sampled item is no longer the item written. Plausible; the layout leaves those values
    unspecified for consumers, but the buffer must store them as written.

    Breaks BUF-006 ("Every sampled item MUST be bit-exactly an item that was written").
    """

    def _copy_rows(self, data: TensorDictBase) -> tuple[TensorDictBase, ...]:
        clean = data.clone().apply(lambda v: v.nan_to_num(0.0) if v.is_floating_point() else v)
        rows: tuple[TensorDictBase, ...] = clean.unbind(0)
        return rows


def demo_nan_scrubbing() -> bool:
    rb = NanScrubbingBuffer(2)
    rb.extend(_td(lp=torch.tensor([float("nan"), -0.5])))
    return not bool(torch.isnan(rb.read(torch.tensor([0]))["lp"]).all())


class OversizeReturnsSurvivorsBuffer(KeyedArrayBuffer):
    """BUG: a batch longer than the capacity returns only the indices of the rows that
    survive (the last ``capacity``), not one index per item written: the caller's
    ``update_priority(extend(batch), td_error)`` then pairs priorities with the wrong rows.
    Plausible (a "deduplicate the scatter targets" fix applied to the return value too).

    Breaks BUF-001 ("return a 1-D integer tensor of the N storage indices written, in order").
    """

    def extend(self, data: TensorDictBase, /) -> torch.Tensor:
        """Write every row; return the slots of the rows still stored."""
        idx = super().extend(data)
        return idx[max(idx.numel() - self.capacity, 0) :]


def demo_oversize_returns_survivors() -> bool:
    rb = OversizeReturnsSurvivorsBuffer(3)
    return rb.extend(_td(x=torch.arange(5))).numel() != 5


class EmptyFirstExtendFixesSchemaBuffer(KeyedArrayBuffer):
    """BUG: an ``extend`` of 0 items into a fresh buffer fixes the schema (storage allocated
    on the first call, as lazy storages do), although no item was written: a later first real
    batch whose dtypes differ from that empty one is refused. Plausible.

    Breaks BUF-015 ("extend of a batch with N = 0 SHOULD be a no-op").
    """

    def extend(self, data: TensorDictBase, /) -> torch.Tensor:
        """Allocate on the first call, then write as usual."""
        if self._schema is None and _rows(data) == 0:
            self._schema = _schema_of(_leaves(data))
            self._cols = {
                k: torch.empty((self.capacity, *shape), dtype=dtype)
                for k, (dtype, shape) in self._schema.items()
            }
            return torch.empty(0, dtype=torch.int64)
        return super().extend(data)


def demo_empty_first_extend_fixes_schema() -> bool:
    rb = EmptyFirstExtendFixesSchemaBuffer(4)
    rb.extend(_td(x=torch.zeros(0, dtype=torch.float64)))
    try:
        rb.extend(_td(x=torch.zeros(2, dtype=torch.float32)))
    except (TypeError, ValueError, KeyError):
        return True
    return False


def _check_key_order(schema: Schema, leaves: dict[Key, torch.Tensor]) -> None:
    _check(schema, leaves)
    if list(leaves) != list(schema):
        raise KeyError(f"extend: keys {list(leaves)} differ from the stored schema")


class KeyOrderSchemaBuffer(ListFifoBuffer):
    """BUG: the schema check compares the *list* of keys, so a batch with the stored keys in
    another insertion order (built by a different code path, or after ``td.update``) is
    refused. Plausible (``list(td.keys()) == schema_keys`` instead of a set or dict match).

    Breaks BUF-001 ("extend(data) with batch dims [N] MUST store the N items").
    """

    def extend(self, data: TensorDictBase, /) -> torch.Tensor:
        """Check the key order too, then store."""
        if self._schema is not None:
            _check_key_order(self._schema, _leaves(data))
        return super().extend(data)


def demo_key_order_schema() -> bool:
    rb = KeyOrderSchemaBuffer(4)
    rb.extend(TensorDict({"a": torch.zeros(1), "b": torch.ones(1)}, batch_size=[1]))
    try:
        rb.extend(TensorDict({"b": torch.ones(1), "a": torch.zeros(1)}, batch_size=[1]))
    except KeyError:
        return True
    return False


def _wrapping_indices(indices: Any, length: int) -> list[int]:
    idx = torch.as_tensor(indices)
    if idx.numel() == 0:
        return []
    if idx.dtype == torch.bool or idx.is_floating_point() or idx.is_complex():
        raise TypeError(f"read: expected integer indices, found {idx.dtype}")
    out = [int(i) for i in idx.reshape(-1).tolist()]
    bad = [i for i in out if i >= length]  # the lower bound forgotten: Python wraps -1
    if bad:
        raise IndexError(f"read: index {bad[0]} holds no item ({length} stored)")
    return out


class NegativeReadWrapsBuffer(ListFifoBuffer):
    """BUG: ``read`` checks only the upper bound of each index, and a negative one indexes the
    Python list from its end, as ``storage[index]`` does in TorchRL's list storage: index -1
    returns the last slot instead of raising.

    Breaks BUF-022 ("MUST raise an error naming the index for one that holds no item").
    """

    def read(self, indices: torch.Tensor, /) -> Any:
        """The items at ``indices`` (negative ones wrap)."""
        with self._lock:
            idx = _wrapping_indices(indices, len(self._slots))
            if not idx and not self._slots:
                return TensorDict({}, batch_size=[0])
            return self._stack(idx)


def demo_negative_read_wraps() -> bool:
    rb = NegativeReadWrapsBuffer(4)
    rb.extend(_td(x=torch.arange(2)))
    try:
        rb.read(torch.tensor([-1]))
    except IndexError:
        return False
    return True


class SampleZeroFailsBuffer(ListFifoBuffer):
    """BUG: ``sample(0)`` stacks an empty list and ``torch.stack`` raises ("stack expects a
    non-empty TensorList"); a loop whose batch size is computed (``len(buffer) // k``,
    a last partial epoch) crashes. Plausible.

    Breaks BUF-004 ("sample(n) MUST return a TensorDict with batch size [n]").
    """

    def _stack(self, idx: list[int]) -> TensorDictBase:
        out: TensorDictBase = torch.stack([self._slots[i] for i in idx])
        return out


def demo_sample_zero_fails() -> bool:
    rb = SampleZeroFailsBuffer(4)
    rb.extend(_td(x=torch.arange(2)))
    try:
        return tuple(rb.sample(0).batch_size) != (0,)
    except RuntimeError:
        return True


def _raw(v: torch.Tensor) -> torch.Tensor:
    # The element run starting at v's offset, read with contiguous strides: v's own strides
    # are ignored (a raw-buffer copy, as into a memory map or a packed wire buffer).
    out = torch.empty(0, dtype=v.dtype)
    strides = torch.empty(v.shape, dtype=v.dtype, device="meta").stride()
    out.set_(v.untyped_storage(), v.storage_offset(), v.shape, strides)
    return out


class StridedRawCopyBuffer(KeyedArrayBuffer):
    """BUG: each column is written from its input's raw storage, as if contiguous, so a
    strided batch (``td[::2]``, a transposed or sliced view) stores the wrong elements.
    Plausible: the class of raw-buffer copies that ignore strides (``data_ptr`` /
    ``untyped_storage`` writes into memory maps and NCCL buckets).

    Breaks BUF-006 ("Every sampled item MUST be bit-exactly an item that was written").
    """

    def _write(self, leaves: dict[Key, torch.Tensor], dst: torch.Tensor, start: int) -> None:
        for k, col in self._cols.items():
            col[dst] = _raw(leaves[k])[start:]


def demo_strided_raw_copy() -> bool:
    rb = StridedRawCopyBuffer(4)
    data = _td(x=torch.arange(8).reshape(8, 1) * torch.ones(1, 2, dtype=torch.int64))
    idx = rb.extend(data[::2])
    return bool(rb.read(idx)["x"][:, 0].tolist() != [0, 2, 4, 6])


# ---------------------------------------------------------------------------------------------
# Declarations


def _list(cls: type[ListFifoBuffer]) -> Implementation:
    return Implementation(
        "buffer",
        cls,
        name=f"independent.variants.{cls.__name__}",
        capabilities={"read"},
    )


def _keyed(cls: type[KeyedArrayBuffer]) -> Implementation:
    return Implementation(
        "buffer",
        cls,
        name=f"independent.variants.{cls.__name__}",
        capabilities={"checkpoint", "read"},
        options={"sampling": "without_replacement"},
    )


# The variants' bases are the designs of tests.independent.buffers, checked in
# tests/conformance/independent/test_buffer_loss_metrics_designs.py; none is written here.
BASES: dict[str, Implementation] = {}

# name -> (requirement id the bug breaks, declaration)
VARIANTS: dict[str, tuple[str, Implementation]] = {
    "randint_high_exclusive": ("BUF-007", _list(RandintHighExclusiveBuffer)),
    "nan_scrubbing": ("BUF-006", _list(NanScrubbingBuffer)),
    "oversize_returns_survivors": ("BUF-001", _keyed(OversizeReturnsSurvivorsBuffer)),
    "empty_first_extend_fixes_schema": ("BUF-015", _keyed(EmptyFirstExtendFixesSchemaBuffer)),
    "key_order_schema": ("BUF-001", _list(KeyOrderSchemaBuffer)),
    "negative_read_wraps": ("BUF-022", _list(NegativeReadWrapsBuffer)),
    "sample_zero_fails": ("BUF-004", _list(SampleZeroFailsBuffer)),
    "strided_raw_copy": ("BUF-006", _keyed(StridedRawCopyBuffer)),
}

DEMOS: dict[str, Callable[[], bool]] = {
    "randint_high_exclusive": demo_randint_high_exclusive,
    "nan_scrubbing": demo_nan_scrubbing,
    "oversize_returns_survivors": demo_oversize_returns_survivors,
    "empty_first_extend_fixes_schema": demo_empty_first_extend_fixes_schema,
    "key_order_schema": demo_key_order_schema,
    "negative_read_wraps": demo_negative_read_wraps,
    "sample_zero_fails": demo_sample_zero_fails,
    "strided_raw_copy": demo_strided_raw_copy,
}
