"""Replay buffers written from ``specs/buffer-v1.md`` alone: two designs and one-bug variants.

``ListFifoBuffer`` keeps each item as its own TensorDict in a Python list used as a ring, draws
with a Python ``random.Random`` (proportionally to per-item priorities) and holds a lock.
``KeyedArrayBuffer`` keeps one preallocated tensor per leaf key, draws without replacement
from a per-slot "not yet drawn this round" flag and saves itself to a directory.

Example:
    >>> from tensordict import TensorDict
    >>> rb = ListFifoBuffer(2)
    >>> rb.extend(TensorDict({"x": torch.arange(3)}, batch_size=[3])).tolist()
    [0, 1, 0]
    >>> sorted(rb.read(torch.tensor([0, 1]))["x"].tolist())
    [1, 2]
"""

from __future__ import annotations

import operator
import random
import threading
from pathlib import Path
from typing import Any

import torch
from tensordict import LazyStackedTensorDict, TensorDict, TensorDictBase

from posttrain.contracts import Implementation

__all__ = [
    "BUGGY_BUFFERS",
    "CORRECT_BUFFERS",
    "KeyedArrayBuffer",
    "ListFifoBuffer",
]

Key = tuple[str, ...]
Schema = dict[Key, tuple[torch.dtype, tuple[int, ...]]]


def _key(k: Any) -> Key:
    return (k,) if isinstance(k, str) else tuple(k)


def _name(k: Key) -> str:
    # Name a nested key the way TensorDict prints it, and the plain leaf name for a flat one.
    return repr(k[0]) if len(k) == 1 else repr(k)


def _leaves(td: TensorDictBase) -> dict[Key, torch.Tensor]:
    return {_key(k): v for k, v in td.items(include_nested=True, leaves_only=True)}


def _count(n: Any, what: str) -> int:
    if isinstance(n, (bool, float)):
        raise TypeError(f"{what}: expected an int >= 0, found {n!r}")
    try:
        v = operator.index(n)
    except TypeError as e:
        raise TypeError(f"{what}: expected an int >= 0, found {n!r}") from e
    if v < 0:
        raise ValueError(f"{what}: expected an int >= 0, found {v}")
    return v


def _rows(data: Any) -> int:
    if not isinstance(data, TensorDictBase):
        raise TypeError(f"extend: expected a TensorDict, found {type(data).__name__}")
    if data.batch_dims != 1:
        raise ValueError(f"extend: expected batch dims [N], found {list(data.batch_size)}")
    return int(data.batch_size[0])


def _schema_of(leaves: dict[Key, torch.Tensor]) -> Schema:
    return {k: (v.dtype, tuple(v.shape[1:])) for k, v in leaves.items()}


def _check(schema: Schema, leaves: dict[Key, torch.Tensor], *, dtypes: bool = True) -> None:
    """Raise naming the first key that differs from ``schema``; nothing is written before."""
    for k in schema:
        if k not in leaves:
            raise KeyError(f"extend: key {_name(k)} of the stored schema is missing")
    for k in leaves:
        if k not in schema:
            raise KeyError(f"extend: key {_name(k)} is not in the stored schema")
    for k, (dtype, shape) in schema.items():
        v = leaves[k]
        if dtypes and v.dtype != dtype:
            raise TypeError(f"extend: key {_name(k)} has dtype {v.dtype}, the schema {dtype}")
        if tuple(v.shape[1:]) != shape:
            raise ValueError(
                f"extend: key {_name(k)} has trailing shape {list(v.shape[1:])}, "
                f"the schema {list(shape)}"
            )


def _assemble(cols: dict[Key, torch.Tensor], n: int) -> TensorDict:
    out = TensorDict({}, batch_size=[n])
    for k, v in cols.items():
        out.set(k, v)
    return out


def _read_indices(indices: Any, length: int) -> list[int]:
    idx = torch.as_tensor(indices)
    if idx.numel() == 0:
        return []
    if idx.dtype == torch.bool or idx.is_floating_point() or idx.is_complex():
        raise TypeError(f"read: expected integer indices, found {idx.dtype}")
    out = [int(i) for i in idx.reshape(-1).tolist()]
    bad = [i for i in out if not 0 <= i < length]
    if bad:
        raise IndexError(f"read: index {bad[0]} holds no item ({length} stored)")
    return out


class ListFifoBuffer:
    """A ring of per-item TensorDicts in a Python list; proportional-priority sampling.

    Thread-safe through one re-entrant lock. New items get the largest priority seen so far
    (1.0 at first), as prioritized replay does, so they are drawn at least once soon.

    Example:
        >>> from tensordict import TensorDict
        >>> rb = ListFifoBuffer(4)
        >>> _ = rb.extend(TensorDict({"x": torch.arange(4)}, batch_size=[4]))
        >>> rb.update_priority(torch.tensor([0, 1, 2]), 0.0)
        >>> set(rb.sample(20)["x"].tolist())
        {3}
    """

    def __init__(self, capacity: int, *, seed: int = 0) -> None:
        self.capacity = _count(capacity, "capacity")
        if self.capacity == 0:
            raise ValueError("capacity: expected at least 1")
        self._slots: list[TensorDictBase] = []
        self._prio: list[float] = []
        self._max_prio = 1.0
        self._cursor = 0
        self._schema: Schema | None = None
        self._rng = random.Random(seed)
        self._lock = threading.RLock()

    def __len__(self) -> int:
        with self._lock:
            return len(self._slots)

    def extend(self, data: TensorDictBase, /) -> torch.Tensor:
        """Store every row of ``data`` (copied); return the slots written, in order."""
        n = _rows(data)
        leaves = _leaves(data)
        with self._lock:
            if self._schema is not None:
                _check(self._schema, leaves)
            if n == 0:
                return torch.empty(0, dtype=torch.int64)
            if self._schema is None:
                self._schema = _schema_of(leaves)
            written = []
            for row in self._copy_rows(data):
                written.append(self._put(row))
            return torch.tensor(written, dtype=torch.int64)

    def _copy_rows(self, data: TensorDictBase) -> tuple[TensorDictBase, ...]:
        # One deep copy of the batch; the rows are views of that copy alone, never mutated.
        rows: tuple[TensorDictBase, ...] = data.clone().unbind(0)
        return rows

    def _put(self, row: TensorDictBase) -> int:
        slot = self._cursor
        if slot == len(self._slots):
            self._slots.append(row)
            self._prio.append(self._max_prio)
        else:
            self._slots[slot] = row
            self._prio[slot] = self._max_prio
        self._cursor = (slot + 1) % self.capacity
        return slot

    def _draw(self, n: int) -> list[int]:
        size = len(self._slots)
        if sum(self._prio) > 0:
            return self._rng.choices(range(size), weights=self._prio, k=n)
        return [self._rng.randrange(size) for _ in range(n)]

    def _stack(self, idx: list[int]) -> TensorDictBase:
        if not idx:
            empty: TensorDictBase = torch.stack([self._slots[0]])[:0].clone()
            return empty
        out: TensorDictBase = torch.stack([self._slots[i] for i in idx])
        return out

    def sample(self, batch_size: int, /) -> Any:
        """``batch_size`` items drawn with replacement, proportionally to their priority."""
        n = _count(batch_size, "batch_size")
        with self._lock:
            if not self._slots:
                raise RuntimeError("sample: the buffer is empty, nothing to draw")
            return self._stack(self._draw(n))

    def read(self, indices: torch.Tensor, /) -> Any:
        """The items at storage slots ``indices``, in that order."""
        with self._lock:
            idx = _read_indices(indices, len(self._slots))
            if not idx and not self._slots:
                return TensorDict({}, batch_size=[0])
            return self._stack(idx)

    def update_priority(self, index: Any, priority: Any, /) -> None:
        """Set the priority of the items at storage slots ``index`` (a scalar broadcasts)."""
        with self._lock:
            idx = _read_indices(index, len(self._slots))
            pr = torch.as_tensor(priority, dtype=torch.float64).reshape(-1)
            if pr.numel() == 1:
                pr = pr.expand(len(idx))
            if pr.numel() != len(idx):
                raise ValueError(f"update_priority: {len(idx)} indices, {pr.numel()} priorities")
            if not bool(torch.isfinite(pr).all()) or bool((pr < 0).any()):
                raise ValueError("update_priority: priorities must be finite and >= 0")
            self._set_priorities(idx, [float(p) for p in pr.tolist()])

    def _set_priorities(self, idx: list[int], prios: list[float]) -> None:
        for i, p in zip(idx, prios, strict=True):
            self._prio[i] = p
            self._max_prio = max(self._max_prio, p)

    def state_dict(self) -> dict[str, Any]:
        """Items (one stacked tensor per key), priorities, write slot, schema and RNG state:
        tensors and plain data only, so ``torch.load(weights_only=True)`` reads it back."""
        with self._lock:
            keys = list(self._schema or {})
            return {
                "capacity": self.capacity,
                "keys": keys,
                "columns": [torch.stack([s.get(k) for s in self._slots]) for k in keys]
                if self._slots
                else [],
                "prio": list(self._prio),
                "max_prio": self._max_prio,
                "cursor": self._cursor,
                "schema": None
                if self._schema is None
                else [
                    (k, str(d).removeprefix("torch."), list(sh))
                    for k, (d, sh) in self._schema.items()
                ],
                "rng": self._rng.getstate(),
            }

    def load_state_dict(self, state_dict: dict[str, Any], /) -> None:
        """Restore :meth:`state_dict`'s output (copied, so the two never share memory)."""
        with self._lock:
            if state_dict["capacity"] != self.capacity:
                raise ValueError(
                    f"load_state_dict: capacity {state_dict['capacity']} != {self.capacity}"
                )
            keys = [tuple(k) for k in state_dict["keys"]]
            cols = dict(zip(keys, state_dict["columns"], strict=True))
            n = len(state_dict["prio"])
            self._slots = (
                list(_assemble({k: v.clone() for k, v in cols.items()}, n).unbind(0)) if n else []
            )
            self._prio = list(state_dict["prio"])
            self._max_prio = float(state_dict["max_prio"])
            self._cursor = int(state_dict["cursor"])
            schema = state_dict["schema"]
            self._schema = (
                None
                if schema is None
                else {tuple(k): (getattr(torch, d), tuple(sh)) for k, d, sh in schema}
            )
            version, internal, gauss = state_dict["rng"]
            self._rng.setstate((version, tuple(internal), gauss))


class KeyedArrayBuffer:
    """One preallocated ``[capacity, *trailing]`` tensor per leaf key; draws without replacement.

    A slot's "fresh" flag is set when it is written and cleared when it is drawn; a draw
    takes a random permutation of the fresh slots, and only once none is left does a new
    round begin, so every stored item is drawn once before any repeats, however extends and
    samples interleave.

    Example:
        >>> from tensordict import TensorDict
        >>> rb = KeyedArrayBuffer(3)
        >>> _ = rb.extend(TensorDict({"x": torch.arange(3)}, batch_size=[3]))
        >>> sorted(rb.sample(3)["x"].tolist())
        [0, 1, 2]
    """

    def __init__(self, capacity: int, *, seed: int = 0) -> None:
        self.capacity = _count(capacity, "capacity")
        if self.capacity == 0:
            raise ValueError("capacity: expected at least 1")
        self._cols: dict[Key, torch.Tensor] = {}
        self._schema: Schema | None = None
        self._size = 0
        self._cursor = 0
        self._fresh = torch.zeros(self.capacity, dtype=torch.bool)
        self._gen = torch.Generator().manual_seed(seed)

    def __len__(self) -> int:
        return self._size

    def _validate(self, leaves: dict[Key, torch.Tensor]) -> None:
        assert self._schema is not None
        _check(self._schema, leaves)

    def extend(self, data: TensorDictBase, /) -> torch.Tensor:
        """Write every row of ``data`` into the next slots (oldest first when full)."""
        n = _rows(data)
        leaves = _leaves(data)
        if self._schema is not None:
            self._validate(leaves)
        if n == 0:
            return torch.empty(0, dtype=torch.int64)
        if self._schema is None:
            self._schema = _schema_of(leaves)
            self._cols = {
                k: torch.empty((self.capacity, *shape), dtype=dtype)
                for k, (dtype, shape) in self._schema.items()
            }
        idx = (self._cursor + torch.arange(n)) % self.capacity
        # Of a batch longer than the buffer only its last `capacity` rows survive; writing
        # just those keeps the scatter free of duplicate targets (whose winner is unspecified).
        m = min(n, self.capacity)
        dst = idx[n - m :]
        self._write(leaves, dst, n - m)
        self._fresh[dst] = True
        self._cursor = (self._cursor + n) % self.capacity
        self._size = min(self.capacity, self._size + n)
        return idx

    def _write(self, leaves: dict[Key, torch.Tensor], dst: torch.Tensor, start: int) -> None:
        for k, col in self._cols.items():
            col[dst] = leaves[k][start:]

    def _pick(self, n: int) -> torch.Tensor:
        chosen: list[torch.Tensor] = []
        left = n
        while left > 0:
            cand = self._fresh[: self._size].nonzero().squeeze(1)
            if cand.numel() == 0:
                self._fresh[: self._size] = True
                continue
            take = cand[torch.randperm(cand.numel(), generator=self._gen)][:left]
            self._fresh[take] = False
            chosen.append(take)
            left -= take.numel()
        return torch.cat(chosen) if chosen else torch.empty(0, dtype=torch.int64)

    def sample(self, batch_size: int, /) -> Any:
        """``batch_size`` items, each stored item once per round (rounds may straddle calls)."""
        n = _count(batch_size, "batch_size")
        if self._size == 0:
            raise RuntimeError("sample: the buffer is empty, nothing to draw")
        idx = self._pick(n)
        return _assemble({k: col[idx] for k, col in self._cols.items()}, n)

    def read(self, indices: torch.Tensor, /) -> Any:
        """The items at storage slots ``indices``, in that order."""
        idx = torch.tensor(_read_indices(indices, self._size), dtype=torch.int64)
        return _assemble({k: col[idx] for k, col in self._cols.items()}, idx.numel())

    def state_dict(self) -> dict[str, Any]:
        """Copies of the written slots, size, write slot, draw flags and generator state."""
        return {
            "capacity": self.capacity,
            "cols": {k: col[: self._size].clone() for k, col in self._cols.items()},
            "schema": None if self._schema is None else dict(self._schema),
            "size": self._size,
            "cursor": self._cursor,
            "fresh": self._fresh.clone(),
            "gen": self._gen.get_state(),
        }

    def load_state_dict(self, state_dict: dict[str, Any], /) -> None:
        """Restore :meth:`state_dict`'s output into freshly allocated storage."""
        if state_dict["capacity"] != self.capacity:
            raise ValueError(
                f"load_state_dict: capacity {state_dict['capacity']} != {self.capacity}"
            )
        schema = state_dict["schema"]
        self._schema = None if schema is None else dict(schema)
        self._size = int(state_dict["size"])
        self._cursor = int(state_dict["cursor"])
        self._cols = {}
        for k, (dtype, shape) in (self._schema or {}).items():
            col = torch.empty((self.capacity, *shape), dtype=dtype)
            col[: self._size] = state_dict["cols"][k]
            self._cols[k] = col
        self._fresh = state_dict["fresh"].clone()
        self._gen.set_state(state_dict["gen"])

    def dumps(self, path: Any, /) -> None:
        """Write the state under the directory ``path``."""
        d = Path(path)
        d.mkdir(parents=True, exist_ok=True)
        torch.save(self.state_dict(), d / "keyed_array_buffer.pt")

    def loads(self, path: Any, /) -> None:
        """Restore the state :meth:`dumps` wrote under ``path``."""
        self.load_state_dict(torch.load(Path(path) / "keyed_array_buffer.pt", weights_only=True))


# ---------------------------------------------------------------------------------------------
# One-bug variants. Each docstring names the bug, where real systems shipped it, and the
# requirement it breaks (read from the spec text).


class CastingKeyedBuffer(KeyedArrayBuffer):
    """BUG: no dtype check; ``col[dst] = value`` casts float64 into the float32 column.

    Breaks BUF-011 ("wrong dtype MUST raise ... (no silent cast)"). TorchRL 0.14's
    LazyTensorStorage writes through the same index assignment and casts the same way.
    """

    def _validate(self, leaves: dict[Key, torch.Tensor]) -> None:
        assert self._schema is not None
        _check(self._schema, leaves, dtypes=False)


class PartialWriteKeyedBuffer(KeyedArrayBuffer):
    """BUG: keys are checked while writing, column by column, so a missing key is found only
    after the columns before it were overwritten: on a full buffer the oldest items come back
    half replaced (the slot counters are untouched, so len and indices look fine).

    Breaks BUF-009 ("... MUST leave contents, len, indices and future writes unchanged").
    """

    def _validate(self, leaves: dict[Key, torch.Tensor]) -> None:
        assert self._schema is not None
        extra = [k for k in leaves if k not in self._schema]
        if extra:
            raise KeyError(f"extend: key {_name(extra[0])} is not in the stored schema")
        for k, (dtype, shape) in self._schema.items():
            if k in leaves and (leaves[k].dtype != dtype or tuple(leaves[k].shape[1:]) != shape):
                raise TypeError(f"extend: key {_name(k)} does not match the schema")

    def _write(self, leaves: dict[Key, torch.Tensor], dst: torch.Tensor, start: int) -> None:
        for k, col in self._cols.items():
            if k not in leaves:
                raise KeyError(f"extend: key {_name(k)} of the stored schema is missing")
            col[dst] = leaves[k][start:]

    def extend(self, data: TensorDictBase, /) -> torch.Tensor:
        """Write every row; a missing key raises only when its column's turn comes."""
        n = _rows(data)
        leaves = _leaves(data)
        if self._schema is None or n == 0:
            return super().extend(data)
        self._validate(leaves)
        idx = (self._cursor + torch.arange(n)) % self.capacity
        m = min(n, self.capacity)
        self._write(leaves, idx[n - m :], n - m)
        self._fresh[idx[n - m :]] = True
        self._cursor = (self._cursor + n) % self.capacity
        self._size = min(self.capacity, self._size + n)
        return idx


class LiveStateKeyedBuffer(KeyedArrayBuffer):
    """BUG: ``state_dict`` hands out the live storage columns and ``load_state_dict`` adopts
    the tensors it is given, so a snapshot keeps changing with the buffer it came from and a
    buffer restored from it shares storage with the original (a checkpoint taken before more
    writes restores the later contents).

    Breaks BUF-014 ("load_state_dict(state_dict()) into a fresh buffer MUST reproduce contents
    and write position bit-exactly").
    """

    def state_dict(self) -> dict[str, Any]:
        """The live columns (not copies), counters, flags and generator state."""
        sd = super().state_dict()
        sd["cols"] = self._cols
        return sd

    def load_state_dict(self, state_dict: dict[str, Any], /) -> None:
        """Adopt the given columns as storage."""
        schema = state_dict["schema"]
        self._schema = None if schema is None else dict(schema)
        self._size = int(state_dict["size"])
        self._cursor = int(state_dict["cursor"])
        self._cols = state_dict["cols"]
        self._fresh = state_dict["fresh"].clone()
        self._gen.set_state(state_dict["gen"])


class RoundAtStartKeyedBuffer(KeyedArrayBuffer):
    """BUG: a round is a permutation of the slots stored when the round began; items written
    mid-round wait for the next round, which re-draws every old item too, so an old item
    repeats before the new ones were drawn once (an epoch-style sampler that never sees the
    storage grow, as TorchRL's ``SamplerWithoutReplacement`` caches its permutation).

    Breaks BUF-016 ("consecutive samples MUST visit every stored item exactly once before any
    repeats").
    """

    def __init__(self, capacity: int, *, seed: int = 0) -> None:
        super().__init__(capacity, seed=seed)
        self._queue: list[int] = []

    def _pick(self, n: int) -> torch.Tensor:
        out: list[int] = []
        while len(out) < n:
            if not self._queue:
                self._queue = torch.randperm(self._size, generator=self._gen).tolist()
            out.append(self._queue.pop())
        return torch.tensor(out, dtype=torch.int64)


class PositionPriorityListBuffer(ListFifoBuffer):
    """BUG: ``update_priority`` writes the i-th priority to slot i of the storage, i.e. it
    indexes by position in the batch passed (as code written for "update the whole last
    sample, in order" does), not by the storage indices given. Priorities land on the wrong
    items, the failure class of ray-project/ray#6534 and vwxyzjn/cleanrl#511 (priorities
    applied to a slot that no longer holds the item they were computed for).

    Breaks BUF-017 ("an item with zero priority MUST NOT be drawn while items with positive
    priority remain").
    """

    def _set_priorities(self, idx: list[int], prios: list[float]) -> None:
        for pos, p in enumerate(prios):
            self._prio[pos] = p
            self._max_prio = max(self._max_prio, p)


class LazyStackListBuffer(ListFifoBuffer):
    """BUG: ``sample`` returns a lazy stack of the stored item TensorDicts (no copy, fast), so
    an in-place change to the sample (``sample.apply_(...)``, ``sample[0]["x"] += 1``, a
    transform that writes in place) writes into the stored items.

    Breaks BUF-008 ("Mutating a sample in place MUST NOT change what the buffer stores").
    """

    def _stack(self, idx: list[int]) -> TensorDictBase:
        if not idx:
            return super()._stack(idx)
        return LazyStackedTensorDict.lazy_stack([self._slots[i] for i in idx], 0)


class StaleKeyNameKeyedBuffer(KeyedArrayBuffer):
    """BUG: the dtype check remembers *that* a column mismatched but names the loop variable
    left over from the scan, i.e. the schema's last key, not the key whose dtype is wrong
    (the error points the user at an innocent field).

    Breaks BUF-011 ("extend with a wrong dtype MUST raise an error naming the key").
    """

    def _validate(self, leaves: dict[Key, torch.Tensor]) -> None:
        assert self._schema is not None
        _check(self._schema, leaves, dtypes=False)
        mismatch = False
        k: Key = ()
        for k, (dtype, _shape) in self._schema.items():
            if leaves[k].dtype != dtype:
                mismatch = True
        if mismatch:
            raise TypeError(f"extend: key {_name(k)} has the wrong dtype")


class CopyPastedKeyNameKeyedBuffer(KeyedArrayBuffer):
    """BUG: the dtype error's text was copied from the token check and always names
    ``('tokens', 'full')``, whichever key has the wrong dtype (a user chasing a float64
    ``('log_probs', 'full')`` is sent to the token ids).

    Breaks BUF-011 ("extend with a wrong dtype MUST raise an error naming the key").
    """

    def _validate(self, leaves: dict[Key, torch.Tensor]) -> None:
        assert self._schema is not None
        _check(self._schema, leaves, dtypes=False)
        for k, (dtype, _shape) in self._schema.items():
            if leaves[k].dtype != dtype:
                raise TypeError(f"extend: key ('tokens', 'full') must have dtype {dtype}")


class KeepFirstOversizeKeyedBuffer(KeyedArrayBuffer):
    """BUG: a batch longer than the buffer has its *first* ``capacity`` rows written (the
    tail is dropped, "it would be overwritten anyway" reasoning applied to the wrong end),
    while the write position still moves by N: the newest items of the batch are lost and
    older ones kept.

    Breaks BUF-003 ("When full, extend MUST overwrite the oldest stored items first").
    """

    def _write(self, leaves: dict[Key, torch.Tensor], dst: torch.Tensor, start: int) -> None:
        m = dst.numel()
        n = next(iter(leaves.values())).shape[0]
        first = ((self._cursor + torch.arange(m)) % self.capacity) if n > self.capacity else dst
        for k, col in self._cols.items():
            col[first] = leaves[k][:m]


# Correct designs that read the spec's latitude differently from the obvious one.


class Int32IndexListBuffer(ListFifoBuffer):
    """CORRECT: ``extend`` returns its storage indices as int32 (BUF-001 asks for "a 1-D
    integer tensor"; a buffer indexing 32-bit storage may well return int32).
    """

    def extend(self, data: TensorDictBase, /) -> torch.Tensor:
        """Store every row; the slots written, as int32."""
        return super().extend(data).to(torch.int32)


class LazyCopyListBuffer(ListFifoBuffer):
    """CORRECT: ``sample`` returns a LazyStackedTensorDict of *copies* of the drawn items (a
    TensorDict with batch size [n], as BUF-004 asks; TorchRL's ListStorage returns lazy
    stacks too), so nothing written to it reaches storage.
    """

    def _stack(self, idx: list[int]) -> TensorDictBase:
        if not idx:
            return super()._stack(idx)
        return LazyStackedTensorDict.lazy_stack([self._slots[i].clone() for i in idx], 0)


class IndexKeyKeyedBuffer(KeyedArrayBuffer):
    """CORRECT: a sample also carries the bookkeeping key ``index`` (the storage slot of each
    item, as TorchRL's buffers add), which BUF-005 explicitly allows.
    """

    def sample(self, batch_size: int, /) -> Any:
        """Items drawn without replacement, plus their storage slots under ``index``."""
        n = _count(batch_size, "batch_size")
        if self._size == 0:
            raise RuntimeError("sample: the buffer is empty, nothing to draw")
        idx = self._pick(n)
        out = _assemble({k: col[idx] for k, col in self._cols.items()}, n)
        out.set("index", idx.clone())
        return out


def make_list_fifo(capacity: int) -> ListFifoBuffer:
    """Factory for :class:`ListFifoBuffer`.

    Example:
        >>> len(make_list_fifo(3))
        0
    """
    return ListFifoBuffer(capacity)


def make_keyed_array(capacity: int) -> KeyedArrayBuffer:
    """Factory for :class:`KeyedArrayBuffer`.

    Example:
        >>> make_keyed_array(3).capacity
        3
    """
    return KeyedArrayBuffer(capacity)


LIST_FIFO = Implementation(
    "buffer",
    make_list_fifo,
    name="independent.ListFifoBuffer",
    capabilities={"priority", "thread_safe", "read"},
)
KEYED_ARRAY = Implementation(
    "buffer",
    make_keyed_array,
    name="independent.KeyedArrayBuffer",
    capabilities={"checkpoint", "read"},
    options={"sampling": "without_replacement"},
)

CORRECT_BUFFERS = {
    "list_fifo": LIST_FIFO,
    "keyed_array": KEYED_ARRAY,
    "list_fifo_int32_indices": Implementation(
        "buffer",
        Int32IndexListBuffer,
        name="independent.Int32IndexListBuffer",
        capabilities={"priority", "thread_safe", "read"},
    ),
    "list_fifo_lazy_copy": Implementation(
        "buffer",
        LazyCopyListBuffer,
        name="independent.LazyCopyListBuffer",
        capabilities={"priority", "thread_safe", "read"},
    ),
    "keyed_array_index_key": Implementation(
        "buffer",
        IndexKeyKeyedBuffer,
        name="independent.IndexKeyKeyedBuffer",
        capabilities={"checkpoint", "read"},
        options={"sampling": "without_replacement"},
    ),
}

# name -> (declaration, requirement the bug breaks)
BUGGY_BUFFERS: dict[str, tuple[Implementation, str]] = {
    "casting_keyed": (
        Implementation(
            "buffer",
            CastingKeyedBuffer,
            name="independent.CastingKeyedBuffer",
            capabilities={"checkpoint", "read"},
            options={"sampling": "without_replacement"},
        ),
        "BUF-011",
    ),
    "partial_write_keyed": (
        Implementation(
            "buffer",
            PartialWriteKeyedBuffer,
            name="independent.PartialWriteKeyedBuffer",
            capabilities={"checkpoint", "read"},
            options={"sampling": "without_replacement"},
        ),
        "BUF-009",
    ),
    "live_state_keyed": (
        Implementation(
            "buffer",
            LiveStateKeyedBuffer,
            name="independent.LiveStateKeyedBuffer",
            capabilities={"read"},
            options={"sampling": "without_replacement"},
        ),
        "BUF-014",
    ),
    "round_at_start_keyed": (
        Implementation(
            "buffer",
            RoundAtStartKeyedBuffer,
            name="independent.RoundAtStartKeyedBuffer",
            capabilities={"read"},
            options={"sampling": "without_replacement"},
        ),
        "BUF-016",
    ),
    "stale_key_name_keyed": (
        Implementation(
            "buffer",
            StaleKeyNameKeyedBuffer,
            name="independent.StaleKeyNameKeyedBuffer",
            capabilities={"read"},
            options={"sampling": "without_replacement"},
        ),
        "BUF-011",
    ),
    "copy_pasted_key_name_keyed": (
        Implementation(
            "buffer",
            CopyPastedKeyNameKeyedBuffer,
            name="independent.CopyPastedKeyNameKeyedBuffer",
            capabilities={"read"},
            options={"sampling": "without_replacement"},
        ),
        "BUF-011",
    ),
    "keep_first_oversize_keyed": (
        Implementation(
            "buffer",
            KeepFirstOversizeKeyedBuffer,
            name="independent.KeepFirstOversizeKeyedBuffer",
            capabilities={"read"},
            options={"sampling": "without_replacement"},
        ),
        "BUF-003",
    ),
    "position_priority_list": (
        Implementation(
            "buffer",
            PositionPriorityListBuffer,
            name="independent.PositionPriorityListBuffer",
            capabilities={"priority", "thread_safe", "read"},
        ),
        "BUF-017",
    ),
    "lazy_stack_list": (
        Implementation(
            "buffer",
            LazyStackListBuffer,
            name="independent.LazyStackListBuffer",
            capabilities={"priority", "thread_safe", "read"},
        ),
        "BUF-008",
    ),
}
