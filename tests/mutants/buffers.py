"""Deliberately broken buffers: each must fail the suite with its requirement's id.

Every mutant is the reference ``RingBuffer`` with one realistic bug (several copy bugs
TorchRL 0.14 really has: zero-filling missing keys, dropping extra ones, casting dtypes).
``MUTANTS`` maps the requirement id each one must fail to its declaration.
"""

from __future__ import annotations

import os
import threading
import time
from contextlib import nullcontext
from typing import Any

import torch
from tensordict import TensorDict, TensorDictBase

from posttrain.contracts import Implementation
from posttrain.reference_impls import RingBuffer
from posttrain.reference_impls.ring_buffer import _tensordict

__all__ = ["MUTANTS"]


def _leaf_keys(td: TensorDictBase) -> set[tuple[str, ...]]:
    return {k if isinstance(k, tuple) else (k,) for k in td.keys(True, True)}


class ReturnsList(RingBuffer):
    def extend(self, data: TensorDictBase, /) -> Any:
        return super().extend(data).tolist()


class LenCountsWrites(RingBuffer):
    def __len__(self) -> int:
        return self.write_count


class DropsWhenFull(RingBuffer):
    """Keeps the first items forever instead of evicting the oldest."""

    def extend(self, data: TensorDictBase, /) -> torch.Tensor:
        n = int(data.batch_size[0])
        room = self.capacity - len(self)
        if self._columns is not None and room < n:
            if room:
                super().extend(data[:room])
            self._write_count += n - room
            return (torch.arange(n) + self._cursor) % self.capacity
        return super().extend(data)


class SampleOneShort(RingBuffer):
    def sample(self, batch_size: int, /) -> TensorDict:
        out = super().sample(batch_size)
        return out[: max(batch_size - 1, 1)]


class SampleDropsReward(RingBuffer):
    def sample(self, batch_size: int, /) -> TensorDict:
        return super().sample(batch_size).exclude(("next", "reward"))


class SamplesUnwrittenSlots(RingBuffer):
    """Draws from the whole capacity, so unwritten rows (garbage) come back while not full."""

    def sample(self, batch_size: int, /) -> TensorDict:
        assert self._rows is not None
        idx = torch.randint(self.capacity, (batch_size,), generator=self._gen)
        return TensorDict(self._views(self._rows.index_select(0, idx)), batch_size=[batch_size])


class NoReplacementBeyondLen(RingBuffer):
    def sample(self, batch_size: int, /) -> TensorDict:
        if batch_size > len(self):
            raise ValueError(f"cannot draw {batch_size} from {len(self)} items")
        return super().sample(batch_size)


class SampleIsAView(RingBuffer):
    """Returns views of the storage when it can (a classic zero-copy bug)."""

    def sample(self, batch_size: int, /) -> TensorDict:
        if batch_size <= len(self) and self._rows is not None:
            return TensorDict(self._views(self._rows[:batch_size]), batch_size=[batch_size])
        return super().sample(batch_size)


class ZeroFillsMissingKeys(RingBuffer):
    """LazyMemmapStorage's behaviour: a missing key is written as zeros."""

    def extend(self, data: TensorDictBase, /) -> torch.Tensor:
        if self._columns is not None:
            data = data.clone(False)
            n = int(data.batch_size[0])
            for k, c in self._columns.items():
                if k not in _leaf_keys(data):
                    data.set(k, torch.zeros((n, *c.shape), dtype=c.dtype))
        return super().extend(data)


class DropsExtraKeys(RingBuffer):
    def extend(self, data: TensorDictBase, /) -> torch.Tensor:
        if self._columns is not None:
            data = data.select(*[k for k in self._columns if k in _leaf_keys(data)])
        return super().extend(data)


class CastsDtypes(RingBuffer):
    def extend(self, data: TensorDictBase, /) -> torch.Tensor:
        if self._columns is not None:
            cols = self._columns
            data = data.clone(False)
            for k in _leaf_keys(data) & set(cols):
                data.set(k, data.get(k).to(cols[k].dtype))
        return super().extend(data)


class TruncatesShapes(RingBuffer):
    def extend(self, data: TensorDictBase, /) -> torch.Tensor:
        if self._columns is not None:
            data = data.clone(False)
            for k in _leaf_keys(data) & set(self._columns):
                shape = self._columns[k].shape
                v = data.get(k)
                if shape and v.shape[1:] != shape:
                    data.set(k, v[:, : shape[0]], inplace=False)
        return super().extend(data)


class EmptySampleReturnsZeros(RingBuffer):
    def sample(self, batch_size: int, /) -> TensorDict:
        if len(self) == 0:
            return TensorDict({"x": torch.zeros(batch_size)}, batch_size=[batch_size])
        return super().sample(batch_size)


class StateForgetsCursor(RingBuffer):
    def load_state_dict(self, state_dict: dict[str, Any], /) -> None:
        super().load_state_dict({**state_dict, "cursor": 0})


class EmptyExtendRaises(RingBuffer):
    def extend(self, data: TensorDictBase, /) -> torch.Tensor:
        if data.batch_size[0] == 0:
            raise ValueError("cannot extend with an empty batch")
        return super().extend(data)


def _with_replacement(capacity: int) -> RingBuffer:
    return RingBuffer(capacity, sampling="with_replacement")


class IgnoresPriority(RingBuffer):
    def update_priority(self, index: Any, priority: Any, /) -> None:
        pass


class LoadsForgetsCursor(RingBuffer):
    def loads(self, path: str | os.PathLike[str], /) -> None:
        super().loads(path)
        self._cursor = 0


class Unlocked(RingBuffer):
    """No lock, and a window between reading and advancing the cursor: writes get lost."""

    def __init__(self, capacity: int) -> None:
        super().__init__(capacity)
        self._lock = nullcontext()  # type: ignore[assignment]

    def extend(self, data: TensorDictBase, /) -> torch.Tensor:
        cursor, count = self._cursor, self._len
        idx = super().extend(data)
        time.sleep(0.002)
        self._cursor = (cursor + int(data.batch_size[0])) % self.capacity
        self._len = min(self.capacity, count + int(data.batch_size[0]))
        return idx


_ = threading  # the suite drives the threads; this module only removes the lock


class ReadsInStorageOrder(RingBuffer):
    """Returns the asked items sorted by index, not in the order asked."""

    def read(self, indices: torch.Tensor, /) -> TensorDict:
        return super().read(torch.as_tensor(indices).sort().values)


def _replica_per_client(capacity: int) -> Any:
    """A served buffer whose client() serves a fresh replica (a handle pickled by value, not
    by reference): every producer writes into a buffer of its own, and the learner sees none."""
    from posttrain.adapters.ray import RemoteBuffer, serve_buffer
    from posttrain.adapters.ray.implementations import shared_host

    class ReplicaPerClient(RemoteBuffer):
        replicas: list[RemoteBuffer]

        def client(self) -> RemoteBuffer:
            self.replicas.append(serve_buffer(RingBuffer, capacity, host=shared_host()))
            return self.replicas[-1].client()

    rb = serve_buffer(RingBuffer, capacity, host=shared_host())
    rb.__class__ = ReplicaPerClient
    rb.replicas = []  # type: ignore[attr-defined]  # mypy keeps the pre-assignment class
    return rb


def _read_then_write(capacity: int) -> Any:
    """A served buffer whose client extends in two calls: it asks for the write position,
    then writes there. Each call is atomic in the actor, the pair is not: producers whose
    extends overlap write at the same place. Killed only if BUF-023's producers really do
    overlap (the window between the calls is widened to 50 ms so that they would)."""
    import time

    from posttrain.adapters.ray import RemoteBuffer, serve_buffer
    from posttrain.adapters.ray.implementations import shared_host

    # Defined here so that Ray pickles them by value into its workers and the actor.
    class PositionedRing(RingBuffer):
        def cursor(self) -> int:
            return self._cursor

        def write_at(self, pos: int, data: TensorDictBase) -> torch.Tensor:
            self._cursor = pos
            return self.extend(data)

    class ReadThenWrite(RemoteBuffer):
        def extend(self, data: TensorDictBase, /) -> torch.Tensor:
            pos = self._call("cursor")
            time.sleep(0.05)
            out: torch.Tensor = self._call("write_at", pos, data)
            return out

        def client(self) -> RemoteBuffer:
            return ReadThenWrite(self._host, self._key, self._methods, timeout=self.timeout)

        def __reduce__(self) -> tuple[Any, ...]:
            return (ReadThenWrite, (self._host, self._key, self._methods))

    rb = serve_buffer(PositionedRing, capacity, host=shared_host())
    rb.__class__ = ReadThenWrite
    return rb


def _impl(req: str, factory: Any, **kw: Any) -> Implementation:
    kw.setdefault("capabilities", {"checkpoint", "thread_safe"})
    return Implementation("buffer", factory, name=f"mutant-{req}-{factory.__name__}", **kw)


MUTANTS: dict[str, Implementation] = {
    "BUF-001": _impl("BUF-001", ReturnsList),
    "BUF-002": _impl("BUF-002", LenCountsWrites),
    "BUF-003": _impl("BUF-003", DropsWhenFull),
    "BUF-004": _impl("BUF-004", SampleOneShort),
    "BUF-005": _impl("BUF-005", SampleDropsReward),
    "BUF-006": _impl("BUF-006", SamplesUnwrittenSlots),
    "BUF-007": _impl("BUF-007", NoReplacementBeyondLen),
    "BUF-008": _impl("BUF-008", SampleIsAView),
    "BUF-009": _impl("BUF-009", ZeroFillsMissingKeys),
    "BUF-010": _impl("BUF-010", DropsExtraKeys),
    "BUF-011": _impl("BUF-011", CastsDtypes),
    "BUF-012": _impl("BUF-012", TruncatesShapes),
    "BUF-013": _impl("BUF-013", EmptySampleReturnsZeros),
    "BUF-014": _impl("BUF-014", StateForgetsCursor),
    "BUF-015": _impl("BUF-015", EmptyExtendRaises),
    "BUF-016": _impl("BUF-016", _with_replacement, options={"sampling": "without_replacement"}),
    "BUF-017": _impl("BUF-017", IgnoresPriority, capabilities={"priority"}),
    "BUF-018": _impl("BUF-018", LoadsForgetsCursor),
    "BUF-019": _impl("BUF-019", Unlocked),
    "BUF-020": _impl("BUF-020", RingBuffer, capabilities={"ragged"}),
    "BUF-021": _impl("BUF-021", RingBuffer, capabilities={"cuda"}),
    "BUF-022": _impl("BUF-022", ReadsInStorageOrder, capabilities={"read"}),
    "BUF-023": _impl("BUF-023", _replica_per_client, capabilities={"remote_writers"}),
}
"""Requirement id -> a buffer that breaks exactly that requirement."""


def _densifies_later_batches(capacity: int) -> Any:
    """A ragged buffer whose check reads a dense view of every batch after the first (the
    ValidatedReplayBuffer bug the B=64 ragged benchmark found): a second ragged extend fails."""
    from torchrl.data import LazyStackStorage, TensorDictReplayBuffer

    from posttrain.adapters.torchrl import ValidatedReplayBuffer
    from posttrain.contracts.layout import leaf_items

    class DensifiesLaterBatches(ValidatedReplayBuffer):
        def extend(self, data: TensorDictBase, /) -> torch.Tensor:
            if self._schema is not None:
                leaf_items(data)
            return super().extend(data)

    return DensifiesLaterBatches(
        TensorDictReplayBuffer(storage=LazyStackStorage(capacity)), ragged=True
    )


class ReadsUnwrittenSlots(RingBuffer):
    """Reads any row of its preallocated storage, written or not."""

    def read(self, indices: torch.Tensor, /) -> TensorDict:
        idx = torch.as_tensor(indices, dtype=torch.int64).reshape(-1)
        assert self._rows is not None
        rows = self._rows.index_select(0, idx)
        return _tensordict(self._nested(self._views(rows)), int(idx.shape[0]), self.device)


EXTRA_MUTANTS: list[tuple[str, Implementation]] = [
    ("BUF-020", _impl("BUF-020", _densifies_later_batches, capabilities={"ragged"})),
    ("BUF-022", _impl("BUF-022", ReadsUnwrittenSlots, capabilities={"read"})),
]
"""Further bugs a requirement must catch besides its main mutant: (requirement id, mutant)."""

READ_THEN_WRITE = _impl("BUF-023", _read_then_write, capabilities={"remote_writers"})
"""BUF-023's second mutant (run by tests/test_ray.py, which owns the Ray cluster)."""
