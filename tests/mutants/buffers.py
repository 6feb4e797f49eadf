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
from pathlib import Path
from typing import Any

import torch
from tensordict import TensorDict, TensorDictBase

from posttrain._checkpoint import load_verified, save_state
from posttrain.contracts import Implementation
from posttrain.contracts.layout import LLM_LAYOUT_V1
from posttrain.reference_impls import RingBuffer
from posttrain.reference_impls._ring_rows import as_tensordict as _tensordict

__all__ = ["EXTRA_MUTANTS", "MUTANTS", "PRIORITIZED_RING", "PrioritizedRing"]


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


class UnpicklingLoads(RingBuffer):
    """dumps writes a bare torch.save file (no manifest) and loads reads it back with
    ``weights_only=False``: a pickle planted in the directory runs its code on load."""

    def dumps(self, path: str | os.PathLike[str], /) -> None:
        Path(path).mkdir(parents=True, exist_ok=True)
        torch.save(self.state_dict(), Path(path, "ring_buffer.pt"))

    def loads(self, path: str | os.PathLike[str], /) -> None:
        self.load_state_dict(torch.load(Path(path, "ring_buffer.pt"), weights_only=False))


class VerifiesThenUnpickles(RingBuffer):
    """Checks the manifest, then unpickles with ``weights_only=False``: safe only against a
    forger who does not rewrite the manifest."""

    def loads(self, path: str | os.PathLike[str], /) -> None:
        from posttrain._checkpoint import verify_dir

        verify_dir(path)
        self.load_state_dict(torch.load(Path(path, "ring_buffer.pt"), weights_only=False))


class EpochFixedAtStart(RingBuffer):
    """Without replacement, an epoch is a permutation of the items stored when it began:
    items written mid-epoch wait for the next epoch, which draws the old items again first
    (a sampler caching its permutation, as TorchRL's does once the storage is full)."""

    def __init__(self, capacity: int) -> None:
        super().__init__(capacity, sampling="without_replacement")

    def extend(self, data: TensorDictBase, /) -> torch.Tensor:
        with self._lock:
            epoch = list(self._epoch)
            idx = super().extend(data)
            self._epoch = epoch
            return idx


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

    # Defined here so that Ray pickles them by value into its workers and the actor. The host
    # serves the contract's methods only: the position is read from state_dict() and given to
    # extend as an extra argument.
    class PositionedRing(RingBuffer):
        def extend(self, data: TensorDictBase, pos: int | None = None, /) -> torch.Tensor:
            with self._lock:
                if pos is not None:
                    self._cursor = pos
                return super().extend(data)

    class ReadThenWrite(RemoteBuffer):
        def extend(self, data: TensorDictBase, /) -> torch.Tensor:
            pos = self._call("state_dict")["cursor"]
            time.sleep(0.05)
            out: torch.Tensor = self._call("extend", data, pos)
            return out

        def client(self) -> RemoteBuffer:
            return ReadThenWrite(self._host, self._key, self._methods, timeout=self.timeout)

        def __reduce__(self) -> tuple[Any, ...]:
            return (ReadThenWrite, (self._host, self._key, self._methods))

    rb = serve_buffer(PositionedRing, capacity, host=shared_host())
    rb.__class__ = ReadThenWrite
    return rb


class TornSnapshot(RingBuffer):
    """state_dict copies its columns one after the other without holding the lock across them
    (the widest first, then the rest 2 ms later, as a large buffer's copy takes): rows that a
    concurrent extend rewrote in between come back with fields of two different writes."""

    def state_dict(self) -> dict[str, Any]:
        first = super().state_dict()
        time.sleep(0.002)
        later = super().state_dict()
        a, b = first["rows"], later["rows"]
        if a is not None and b is not None and a.shape == b.shape:
            half = a.shape[1] // 2
            first["rows"] = torch.cat([a[:, :half], b[:, half:]], dim=1)
        return first


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
    "BUF-024": _impl("BUF-024", UnpicklingLoads),
    "BUF-025": _impl("BUF-025", TornSnapshot),
}
"""Requirement id -> a buffer that breaks exactly that requirement."""


def _densifies_later_batches(capacity: int) -> Any:
    """A ragged buffer whose check reads a dense view of every batch after the first (the
    ValidatedReplayBuffer bug the B=64 ragged benchmark found): a second ragged extend fails."""
    from torchrl.data import LazyStackStorage, TensorDictReplayBuffer

    from posttrain.adapters.torchrl import ValidatedReplayBuffer
    from posttrain.contracts.keys import leaf_items

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


class ReturnsAgePositions(RingBuffer):
    """Writes like the ring, but returns each item's position by age (0 = the oldest), as a
    list-backed buffer that drops its head and appends would: the write indices until the
    ring is full, then the newest positions, not the slots written."""

    def extend(self, data: TensorDictBase, /) -> torch.Tensor:
        n = super().extend(data).numel()
        return torch.arange(len(self) - min(n, len(self)), len(self), dtype=torch.int64)


class PrioritizedRing(RingBuffer):
    """The ring with per-slot priorities (a new item gets 1.0); draws proportional to them.

    A correct priority design, so that BUF-017 runs on one that passes.

    Example:
        >>> rb = PrioritizedRing(4)
        >>> idx = rb.extend(TensorDict({"x": torch.arange(4)}, batch_size=[4]))
        >>> rb.update_priority(idx[:3], torch.zeros(3))
        >>> set(rb.sample(20)["x"].tolist())
        {3}
    """

    def __init__(self, capacity: int) -> None:
        super().__init__(capacity)
        self._prio = torch.ones(capacity, dtype=torch.float64)

    def extend(self, data: TensorDictBase, /) -> torch.Tensor:
        with self._lock:
            idx = super().extend(data)
            self._prio[idx] = 1.0
            return idx

    def _slots(self, index: torch.Tensor) -> torch.Tensor:
        return index

    def update_priority(self, index: Any, priority: Any, /) -> None:
        with self._lock:
            idx = torch.as_tensor(index, dtype=torch.int64).reshape(-1)
            pr = torch.as_tensor(priority, dtype=torch.float64).reshape(-1).expand(idx.shape[0])
            self._prio[self._slots(idx)] = pr

    def sample(self, batch_size: int, /) -> TensorDict:
        with self._lock:
            if self._len == 0 or self._rows is None:
                raise RuntimeError("cannot sample from an empty buffer: extend it first")
            idx = torch.multinomial(
                self._prio[: self._len], batch_size, replacement=True, generator=self._gen
            )
            rows = self._rows.index_select(0, idx)
        return _tensordict(self._nested(self._views(rows)), batch_size, self.device)


class PrioritiesByAge(PrioritizedRing):
    """Reads the index given to update_priority as an age (0 = the oldest), as priorities kept
    in a deque beside the items would: right until the ring wraps, then the priority steers
    another item than the one extend wrote at that index."""

    def _slots(self, index: torch.Tensor) -> torch.Tensor:
        if len(self) < self.capacity:
            return index
        return (index + self._cursor) % self.capacity  # the oldest item sits at the cursor


class KeepsCallerTensors(RingBuffer):
    """Keeps each item as a view of the batch given to extend (a list-backed buffer that
    skips the copy) and samples from those: a caller reusing its tensors changes the items."""

    def __init__(self, capacity: int) -> None:
        super().__init__(capacity)
        self._refs: dict[int, TensorDictBase] = {}

    def extend(self, data: TensorDictBase, /) -> torch.Tensor:
        idx = super().extend(data)
        for j, i in enumerate(idx.tolist()):
            self._refs[i] = data[j]  # a view of the caller's row
        return idx

    def sample(self, batch_size: int, /) -> TensorDict:
        if not self._refs or len(self._refs) < len(self):  # empty, or restored from a state
            return super().sample(batch_size)
        idx = torch.randint(len(self), (batch_size,), generator=self._gen).tolist()
        out: TensorDict = torch.stack([self._refs[i] for i in idx])
        return out


class LiveStateDict(RingBuffer):
    """state_dict hands out a view of the live rows instead of a copy: a snapshot taken before
    more extends changes with them."""

    def state_dict(self) -> dict[str, Any]:
        sd = super().state_dict()
        if self._rows is not None:
            sd["rows"] = self._rows[: self._len]
        return sd


_REQUIRED = {LLM_LAYOUT_V1.key(f.name) for f in LLM_LAYOUT_V1.fields if f.required}


class ChecksRequiredKeysOnly(RingBuffer):
    """Checks only the layout's required fields: a batch lacking an optional one (advantage,
    reward, ...) is written with that column left as the slots held it, so the new items read
    the evicted (or never written) items' values."""

    def extend(self, data: TensorDictBase, /) -> torch.Tensor:
        if self._columns is not None and self._rows is not None:
            missing = [k for k in self._columns if k not in _leaf_keys(data)]
            if missing and not set(missing) & _REQUIRED:
                n = int(data.batch_size[0])
                slots = (torch.arange(n) + self._cursor) % self.capacity
                old = self._views(self._rows.index_select(0, slots))
                data = data.clone(False)
                for k in missing:
                    data.set(k, old[k].clone())
        return super().extend(data)


class UncheckedListBuffer:
    """A ring of item TensorDicts with no schema check, stacked on sample: a batch lacking a
    key goes in, and the kit's own sample afterwards fails inside ``torch.stack``."""

    def __init__(self, capacity: int) -> None:
        self.capacity = capacity
        self._items: list[TensorDictBase] = []
        self._cursor = 0
        self._gen = torch.Generator().manual_seed(0)

    def extend(self, data: TensorDictBase, /) -> torch.Tensor:
        idx = []
        for row in data.clone().unbind(0):
            if len(self._items) < self.capacity:
                self._items.append(row)
            else:
                self._items[self._cursor] = row
            idx.append(self._cursor)
            self._cursor = (self._cursor + 1) % self.capacity
        return torch.tensor(idx, dtype=torch.int64)

    def sample(self, batch_size: int, /) -> TensorDictBase:
        if not self._items:
            raise RuntimeError("sample: the buffer is empty")
        idx = torch.randint(len(self._items), (batch_size,), generator=self._gen).tolist()
        out: TensorDictBase = torch.stack([self._items[i] for i in idx])
        return out

    def __len__(self) -> int:
        return len(self._items)

    def state_dict(self) -> dict[str, Any]:
        return {"items": [x.clone() for x in self._items], "cursor": self._cursor}

    def load_state_dict(self, state_dict: dict[str, Any], /) -> None:
        self._items = [x.clone() for x in state_dict["items"]]
        self._cursor = state_dict["cursor"]


class EmptySampleIndexError(RingBuffer):
    """No emptiness check: sample on an empty buffer fails deep in torch with an IndexError
    that says nothing of the buffer ("index 0 is out of bounds for dimension 0 with size 0")."""

    def sample(self, batch_size: int, /) -> TensorDict:
        if len(self) == 0:
            torch.empty(0)[torch.zeros(batch_size, dtype=torch.int64)]
        return super().sample(batch_size)


class UnlockedEviction(RingBuffer):
    """Takes the lock only while the ring is filling: once full, an extend reads the write
    position, copies (the window is widened to 2 ms, as a large batch's copy takes), then
    bumps it, so concurrent extends that evict write over each other and return one index
    for two items. Without eviction under concurrency (BUF-019 before 1.3) it passes."""

    def extend(self, data: TensorDictBase, /) -> torch.Tensor:
        n = int(data.batch_size[0])
        if self._schema is None or n == 0 or self._len < self.capacity or n > self.capacity:
            return super().extend(data)
        leaves = self._schema.validated_leaves(data, "UnlockedEviction.extend")
        cursor = self._cursor
        time.sleep(0.002)
        idx = (torch.arange(n, dtype=torch.int64) + cursor) % self.capacity
        for k, dst in self._dst_items:
            dst[idx] = leaves[k]
        self._cursor = (cursor + n) % self.capacity
        self._write_count += n
        return idx


class EmptyExtendRestartsEpoch(RingBuffer):
    """Without replacement, an extend of 0 items starts a new epoch (any write resets the
    permutation): items drawn before it may repeat before the others were drawn once."""

    def __init__(self, capacity: int) -> None:
        super().__init__(capacity, sampling="without_replacement")

    def extend(self, data: TensorDictBase, /) -> torch.Tensor:
        idx = super().extend(data)
        if idx.numel() == 0:
            self._epoch = []
        return idx


EXTRA_MUTANTS: list[tuple[str, Implementation]] = [
    ("BUF-020", _impl("BUF-020", _densifies_later_batches, capabilities={"ragged"})),
    ("BUF-022", _impl("BUF-022", ReadsUnwrittenSlots, capabilities={"read"})),
    # buffer 1.3: bugs found in independently written buffers the kit had passed
    ("BUF-001", _impl("BUF-001", ReturnsAgePositions)),
    ("BUF-017", _impl("BUF-017", PrioritiesByAge, capabilities={"priority"})),
    ("BUF-006", _impl("BUF-006", KeepsCallerTensors)),
    ("BUF-014", _impl("BUF-014", LiveStateDict)),
    ("BUF-009", _impl("BUF-009", ChecksRequiredKeysOnly)),
    ("BUF-009", _impl("BUF-009", UncheckedListBuffer, capabilities=set())),
    ("BUF-013", _impl("BUF-013", EmptySampleIndexError)),
    ("BUF-019", _impl("BUF-019", UnlockedEviction)),
    (
        "BUF-015",
        _impl(
            "BUF-015",
            EmptyExtendRestartsEpoch,
            options={"sampling": "without_replacement"},
        ),
    ),
]
"""Further bugs a requirement must catch besides its main mutant: (requirement id, mutant)."""

PRIORITIZED_RING = Implementation(
    "buffer",
    PrioritizedRing,
    name="tests.PrioritizedRing",
    capabilities={"priority", "checkpoint", "thread_safe", "read"},
)
"""A correct priority design (none ships here): BUF-017 must pass it."""

READ_THEN_WRITE = _impl("BUF-023", _read_then_write, capabilities={"remote_writers"})
"""BUF-023's second mutant (run by tests/adapters/ray/test_ray.py, which owns the Ray cluster)."""


class _Cursor:
    """A write position wrapped in an object of the buffer's own: only a pickle load restores it."""

    def __init__(self, value: int) -> None:
        self.value = value


class PicklesItsState(RingBuffer):
    """``state_dict()`` holds an object of its own class, so loading it runs code."""

    def state_dict(self) -> dict[str, Any]:
        st = super().state_dict()
        st["cursor"] = _Cursor(st["cursor"])
        return st

    def load_state_dict(self, state_dict: dict[str, Any], /) -> None:
        st = dict(state_dict)
        if isinstance(st.get("cursor"), _Cursor):
            st["cursor"] = st["cursor"].value
        super().load_state_dict(st)


EXTRA_MUTANTS.append(("BUF-014", _impl("BUF-014", PicklesItsState)))
# buffer 1.4: a load that runs code; an epoch that keeps items written mid-epoch waiting
EXTRA_MUTANTS.append(("BUF-024", _impl("BUF-024", VerifiesThenUnpickles)))
EXTRA_MUTANTS.append(
    (
        "BUF-016",
        _impl("BUF-016", EpochFixedAtStart, options={"sampling": "without_replacement"}),
    )
)


class JoinsKeyNames(RingBuffer):
    """Files each column of a checkpoint under its key's names joined with '.' (as a directory
    of one file per joined name does) and splits them on '.' when loading: ``'a.b'`` comes back
    as ``('a', 'b')``, and ``('a', 'b')`` beside ``'a.b'`` leaves one of the two."""

    def dumps(self, path: str | os.PathLike[str], /) -> None:
        state = self.state_dict()
        if state["schema"] is not None:
            state["schema"] = [((".".join(k),), d, s) for k, d, s in state["schema"]]
        save_state(path, "ring_buffer.pt", state)

    def loads(self, path: str | os.PathLike[str], /) -> None:
        state = load_verified(path, "ring_buffer.pt")
        if state["schema"] is not None:
            state["schema"] = [(tuple(k[0].split(".")), d, s) for k, d, s in state["schema"]]
        self.load_state_dict(state)


# buffer 1.6: key names holding '.' (and nested keys whose names joined with '.' are another's)
EXTRA_MUTANTS.append(("BUF-018", _impl("BUF-018", JoinsKeyNames)))
