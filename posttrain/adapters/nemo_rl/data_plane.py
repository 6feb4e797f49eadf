"""NeMo-RL's data-plane client interface over posttrain/TorchRL buffers.

``DataPlaneClient`` (``nemo_rl/data_plane/interfaces.py``, commit 7ea279a, since v0.7) stores
fields of samples by id in a partition: ``put_samples(sample_ids, partition_id, fields, tags)``
writes fields (a stage writes the fields it produced), ``get_samples(sample_ids, partition_id,
select_fields)`` reads named fields by id (no cursor moves), ``clear_samples(sample_ids |
None, partition_id)`` drops ids (``None``: all of the partition). Values travel as a
``TensorDict`` [N]; per-token fields as ``torch.jagged`` nested tensors (``data_plane/codec.py``).

Here each (partition, field) is stored in its own buffer made by ``make_buffer(capacity)``:
one item per sample, a per-token row kept at its own length (a ragged buffer) or a fixed
shape, read back by index (buffer capability ``read``). The interface says nothing of a full
store (TransferQueue's ``storage_capacity`` bounds a partition); here the policy is explicit:
``full="refuse"`` (the default) raises :class:`DataPlaneFullError` before anything is written
when a write would land on a live id's row; ``full="evict_oldest"`` lets the FIFO write evict
the oldest rows, and reading an id whose row was overwritten raises ``KeyError``.

The task-mediated half (``register_partition``, ``claim_meta``, ``get_data``,
``check_consumption_status``) follows ``nemo_rl/data_plane/adapters/transfer_queue.py`` and
the in-memory ``adapters/noop.py`` (7ea279a): a partition declares its consumer tasks; each
task claims every sample once, in write order, once all of its ``required_fields`` are
written (field production is the stage-done signal); ``claim_meta`` blocks until at least
one sample is ready (``TimeoutError`` after ``timeout_s``), or returns an empty meta with
``blocking=False``. Not applied: ``grpo_group_size`` (TransferQueue's group-balanced
sampler), ``enums`` and ``dp_rank`` are kept but change nothing (NeMo-RL's interface calls
``dp_rank`` reserved). NeMo-RL's sync trainer uses only the by-key half; its async trainer
does not call the task-mediated half at this commit (``data_plane/README.md``).

The reserve-then-commit slots of NeMo-RL's ``TQReplayBuffer`` over this client are in
:mod:`posttrain.adapters.nemo_rl.group_slots`.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch
from tensordict import LazyStackedTensorDict, TensorDict, TensorDictBase

from posttrain.contracts.schema import ItemSchema
from posttrain.contracts.validation import ContractViolation
from posttrain.errors import PosttrainError


class DataPlaneFullError(PosttrainError, RuntimeError):
    """A write refused because it would overwrite rows of live sample ids (``full="refuse"``).

    Example:
        >>> from posttrain.reference_impls import RingBuffer
        >>> dp = NemoDataPlaneClient(RingBuffer, capacity=1)
        >>> _ = dp.put_samples(["a"], "p", TensorDict({"x": torch.ones(1)}, [1]))
        >>> dp.put_samples(["b"], "p", TensorDict({"x": torch.ones(1)}, [1]))
        Traceback (most recent call last):
        ...
        posttrain.adapters.nemo_rl.data_plane.DataPlaneFullError: put_samples: ...
    """


@dataclass
class KVBatchMeta:
    """What ``put_samples`` returns: NeMo-RL's ``KVBatchMeta`` fields.

    Example:
        >>> from posttrain.reference_impls import RingBuffer
        >>> dp = NemoDataPlaneClient(RingBuffer, capacity=4)
        >>> td = TensorDict({"input_lengths": torch.tensor([3, 5])}, [2])
        >>> meta = dp.put_samples(["a", "b"], "train", td)
        >>> meta.sample_ids, meta.fields, meta.sequence_lengths  # lengths from input_lengths
        (['a', 'b'], ['input_lengths'], [3, 5])
    """

    partition_id: str
    task_name: str | None
    sample_ids: list[str]
    fields: list[str] | None = None
    sequence_lengths: list[int] | None = None
    extra_info: dict[str, Any] = field(default_factory=dict)
    tags: list[dict[str, Any]] | None = None

    @property
    def size(self) -> int:
        """Samples this meta addresses (NeMo-RL's ``KVBatchMeta.size``)."""
        return len(self.sample_ids)


@dataclass
class _Partition:
    """What ``register_partition`` declared, and each task's claimed ids."""

    fields: list[str]
    num_samples: int
    grpo_group_size: int | None
    enums: dict[str, list[str]]
    claimed: dict[str, set[str]]


class NemoDataPlaneClient:
    """``put_samples`` / ``get_samples`` / ``clear_samples`` of NeMo-RL's data-plane client.

    ``make_buffer(capacity)`` builds the store of a dense field (posttrain's ``RingBuffer``),
    ``make_ragged_buffer(capacity)`` the store of a jagged one (``ValidatedReplayBuffer`` over
    TorchRL's ``LazyStackStorage`` with ``ragged=True``); both need the ``read`` capability. A
    write that fails (bad field, a field whose keys, dtype or item shape differ from what its
    store holds) raises before any store is written, so it changes nothing a reader can see;
    ids are indexed only after every field's store accepted its items. Rewriting a field of an
    id writes a new item and moves the id's index (the old item is left to be overwritten).

    Each store holds ``capacity`` items and evicts the oldest first: once a later write has
    overwritten the row of an id, ``get_samples`` for it raises ``KeyError`` saying it was
    evicted (never another sample's row); ``clear_samples`` forgets that too. A write of more
    than ``capacity`` ids is refused.

    Example:
        >>> import torch
        >>> from tensordict import TensorDict
        >>> from posttrain.reference_impls import RingBuffer
        >>> dp = NemoDataPlaneClient(RingBuffer, capacity=8)
        >>> meta = dp.put_samples(["a", "b"], "train", TensorDict({"x": torch.tensor([1.0, 2.0])}, [2]))
        >>> meta.fields, dp.get_samples(["b"], "train", ["x"])["x"].tolist()
        (['x'], [2.0])
    """

    def __init__(
        self,
        make_buffer: Callable[[int], Any],
        *,
        make_ragged_buffer: Callable[[int], Any] | None = None,
        capacity: int = 1024,
        full: str = "refuse",
    ) -> None:
        if full not in ("refuse", "evict_oldest"):
            raise ValueError(f"full: expected 'refuse' or 'evict_oldest', found {full!r}")
        self.full = full
        self._writes: dict[tuple[str, str], int] = {}  # items extended per store (FIFO position)
        self.make_buffer = make_buffer
        self.make_ragged_buffer = make_ragged_buffer
        self.capacity = capacity
        self._stores: dict[tuple[str, str], Any] = {}
        self._nested: dict[tuple[str, str], bool] = {}
        self._index: dict[tuple[str, str], dict[str, int]] = {}  # (partition, field) -> id -> i
        self._slots: dict[tuple[str, str], dict[int, str]] = {}  # the inverse: row -> its id
        self._evicted: dict[tuple[str, str], set[str]] = {}
        self._schemas: dict[tuple[str, str], ItemSchema] = {}
        self._closed = False
        self._partitions: dict[str, _Partition] = {}
        self._order: dict[str, dict[str, int]] = {}  # partition -> id -> first-write number
        self._tags: dict[str, dict[str, dict[str, Any]]] = {}  # partition -> id -> tags
        self._count = 0
        # One lock for every call, so a producer thread may put while a consumer claims.
        self._lock = threading.RLock()
        self._ready = threading.Condition(self._lock)

    # -- task-mediated -------------------------------------------------------------------------
    def register_partition(
        self,
        partition_id: str,
        fields: list[str],
        num_samples: int,
        consumer_tasks: list[str],
        grpo_group_size: int | None = None,
        enums: dict[str, list[str]] | None = None,
    ) -> None:
        """Declare ``partition_id``'s fields and consumer tasks (one claim cursor per task).

        Registering again (NeMo-RL's sync trainer does, each step) replaces the declaration
        and adds new tasks; a task already declared keeps its claims, so no sample is handed
        to one task twice. Samples and their rows are left as they are.

        Example:
            >>> from posttrain.reference_impls import RingBuffer
            >>> dp = NemoDataPlaneClient(RingBuffer, capacity=4)
            >>> dp.register_partition("train", ["x"], num_samples=2, consumer_tasks=["train"])
            >>> dp.check_consumption_status("train", ["train"])  # nothing written yet
            True
        """
        self._open()
        if isinstance(consumer_tasks, str) or not all(isinstance(t, str) for t in consumer_tasks):
            raise TypeError(f"consumer_tasks: expected a list of str, found {consumer_tasks!r}")
        with self._lock:
            old = self._partitions.get(partition_id)
            claimed = {t: (old.claimed.get(t, set()) if old else set()) for t in consumer_tasks}
            self._partitions[partition_id] = _Partition(
                list(fields), int(num_samples), grpo_group_size, dict(enums or {}), claimed
            )

    def claim_meta(
        self,
        partition_id: str,
        task_name: str,
        required_fields: list[str],
        batch_size: int,
        dp_rank: int | None = None,
        blocking: bool = True,
        timeout_s: float = 60.0,
    ) -> KVBatchMeta:
        """Claim up to ``batch_size`` samples ``task_name`` has not claimed, all fields written.

        In write order; once claimed, a sample is not handed to ``task_name`` again (it stays
        readable until ``clear_samples``). Blocks until at least one sample is ready (a put
        from another thread wakes it), then takes what is ready; ``TimeoutError`` after
        ``timeout_s``; ``blocking=False`` returns an empty meta at once. ``sequence_lengths``
        come from the ``input_lengths`` tags, as TransferQueue's adapter lifts them. A task
        not declared by ``register_partition`` raises ``KeyError``.

        Example:
            >>> from posttrain.reference_impls import RingBuffer
            >>> dp = NemoDataPlaneClient(RingBuffer, capacity=4)
            >>> dp.register_partition("p", ["x"], 2, ["read"])
            >>> _ = dp.put_samples(["a", "b"], "p", TensorDict({"x": torch.tensor([1, 2])}, [2]))
            >>> meta = dp.claim_meta("p", "read", ["x"], batch_size=8)
            >>> meta.sample_ids, dp.get_data(meta)["x"].tolist(), dp.check_consumption_status("p", ["read"])
            (['a', 'b'], [1, 2], True)
        """
        del dp_rank  # reserved in NeMo-RL's interface
        self._open()
        if batch_size < 1:
            raise ValueError(f"batch_size: expected >= 1, found {batch_size}")
        deadline = time.monotonic() + max(0.0, timeout_s)
        with self._ready:
            while True:
                part = self._partitions.get(partition_id)
                if part is None:
                    raise KeyError(
                        f"claim_meta: partition {partition_id!r} is not registered; call "
                        f"register_partition first (registered: {sorted(self._partitions)})"
                    )
                claimed = part.claimed.get(task_name)
                if claimed is None:
                    raise KeyError(
                        f"claim_meta: expected a consumer task of partition {partition_id!r} "
                        f"(one of {sorted(part.claimed)}), found {task_name!r}"
                    )
                ready = self._ready_ids(partition_id, claimed, list(required_fields), batch_size)
                if ready or not blocking:
                    break
                left = deadline - time.monotonic()
                if left <= 0:
                    raise TimeoutError(
                        f"claim_meta: waited {timeout_s} s for task {task_name!r} of partition "
                        f"{partition_id!r}; no unclaimed sample has all of {list(required_fields)}"
                    )
                self._ready.wait(left)
            claimed.update(ready)
            table = self._tags.get(partition_id, {})
            tags = [dict(table.get(s, {})) for s in ready]
            lengths = (
                [int(t.get("input_lengths", 0)) for t in tags]
                if any("input_lengths" in t for t in tags)
                else None
            )
            return KVBatchMeta(
                partition_id,
                task_name,
                ready,
                list(required_fields),
                lengths,
                {},
                tags if tags else None,
            )

    def _ready_ids(
        self, partition_id: str, claimed: set[str], required: list[str], limit: int
    ) -> list[str]:
        indexes = [self._index.get((partition_id, f), {}) for f in required]
        out: list[str] = []
        order = self._order.get(partition_id, {})
        for s in sorted(order, key=order.__getitem__):
            if s not in claimed and all(s in ix for ix in indexes):
                out.append(s)
                if len(out) == limit:
                    break
        return out

    def get_data(self, meta: KVBatchMeta, select_fields: list[str] | None = None) -> TensorDict:
        """The fields of ``meta``'s samples: ``select_fields``, else ``meta.fields``, else
        ``ValueError`` (never every field silently).

        Example:
            >>> from posttrain.reference_impls import RingBuffer
            >>> dp = NemoDataPlaneClient(RingBuffer, capacity=4)
            >>> dp.get_data(KVBatchMeta("p", None, ["a"]))
            Traceback (most recent call last):
            ...
            ValueError: get_data: name the fields to read ...
        """
        names = select_fields if select_fields is not None else meta.fields
        if names is None:
            raise ValueError(
                "get_data: name the fields to read (select_fields=, or a meta with fields); "
                "found neither, and every field is never read implicitly"
            )
        return self.get_samples(meta.sample_ids, meta.partition_id, list(names))

    def check_consumption_status(self, partition_id: str, task_names: list[str]) -> bool:
        """Whether every task in ``task_names`` has claimed every live sample of the partition.

        A task the partition does not declare has consumed nothing: ``False``.

        Example:
            >>> from posttrain.reference_impls import RingBuffer
            >>> dp = NemoDataPlaneClient(RingBuffer, capacity=4)
            >>> dp.register_partition("p", ["x"], 1, ["read"])
            >>> _ = dp.put_samples(["a"], "p", TensorDict({"x": torch.ones(1)}, [1]))
            >>> dp.check_consumption_status("p", ["read"]), dp.check_consumption_status("p", ["other"])
            (False, False)
        """
        self._open()
        with self._lock:
            part = self._partitions.get(partition_id)
            if part is None:
                raise KeyError(f"check_consumption_status: partition {partition_id!r} unknown")
            live = self.live_sample_ids(partition_id)
            return all(t in part.claimed and live <= part.claimed[t] for t in task_names)

    # -- direct by key -------------------------------------------------------------------------
    def put_samples(
        self,
        sample_ids: list[str],
        partition_id: str,
        fields: TensorDictBase | None = None,
        tags: list[dict[str, Any]] | None = None,
    ) -> KVBatchMeta:
        """Write ``fields`` (a TensorDict [len(sample_ids)]) for these ids."""
        self._open()
        with self._ready:
            meta = self._put(sample_ids, partition_id, fields, tags)
            order = self._order.setdefault(partition_id, {})
            table = self._tags.setdefault(partition_id, {})
            for i, s in enumerate(sample_ids):
                if s not in order:
                    order[s] = self._count
                    self._count += 1
                if tags is not None:
                    table.setdefault(s, {}).update(tags[i])
            self._ready.notify_all()  # a blocked claim_meta may now find its fields
            return meta

    def _put(
        self,
        sample_ids: list[str],
        partition_id: str,
        fields: TensorDictBase | None,
        tags: list[dict[str, Any]] | None,
    ) -> KVBatchMeta:
        n = len(sample_ids)
        if len(set(sample_ids)) != n:
            raise ValueError(f"sample_ids: duplicates in {sample_ids}")
        if tags is not None and len(tags) != n:
            raise ValueError(f"tags: expected {n} (one per sample), found {len(tags)}")
        if n > self.capacity:
            # The write's own first rows would be overwritten by its last ones.
            raise ValueError(
                f"sample_ids: expected at most capacity={self.capacity} ids per write, found {n}"
            )
        names: list[str] = []
        rows: dict[str, TensorDictBase] = {}
        nested: dict[str, bool] = {}
        if fields is not None:
            if tuple(fields.batch_size[:1]) != (n,):
                raise ValueError(
                    f"fields: expected batch size [{n}] (one row per sample id), found "
                    f"{list(fields.batch_size)}"
                )
            for key in fields.keys():  # noqa: SIM118 - iterating a TensorDict yields rows
                value = fields.get(key)
                if not isinstance(value, torch.Tensor):
                    raise TypeError(
                        f"field {key!r}: expected a tensor, found {type(value).__name__}"
                    )
                name = str(key)
                known = self._nested.get((partition_id, name))
                if known is not None and known != value.is_nested:
                    raise ValueError(
                        f"field {name!r}: stored as {'jagged' if known else 'dense'}, found "
                        f"{'jagged' if value.is_nested else 'dense'}"
                    )
                if value.is_nested and self.make_ragged_buffer is None:
                    raise ValueError(
                        f"field {name!r} is jagged: pass make_ragged_buffer= (a ragged buffer "
                        "with read, e.g. ValidatedReplayBuffer(..., ragged=True))"
                    )
                names.append(name)
                nested[name] = value.is_nested
                rows[name] = _items(value)
        # Every field is checked before any store is written: a store refusing the second
        # field after the first was written would already have overwritten rows other ids
        # point to.
        schemas = {
            name: self._check(partition_id, name, items, nested[name])
            for name, items in rows.items()
        }
        if self.full == "refuse":
            self._refuse_if_full(partition_id, list(rows), set(sample_ids), n)
        written: dict[str, list[int]] = {}
        try:
            for name, items in rows.items():
                store = self._store(partition_id, name, nested[name])
                written[name] = [int(i) for i in store.extend(items).tolist()]
                self._writes[(partition_id, name)] = self._writes.get((partition_id, name), 0) + n
        finally:
            # A store that refuses despite the check leaves the fields written before it
            # unindexed, but the rows they overwrote are gone all the same.
            done = len(written) == len(rows)
            for name, idx in written.items():
                self._record((partition_id, name), sample_ids, idx, index=done)
                if n:  # an empty write fixes no store's schema (BUF-015)
                    self._schemas[(partition_id, name)] = schemas[name]
        lengths = None
        if "input_lengths" in rows:
            lengths = [int(v) for v in fields.get("input_lengths").reshape(-1).tolist()]  # type: ignore[union-attr]
        return KVBatchMeta(partition_id, None, list(sample_ids), names, lengths, {}, tags)

    def _refuse_if_full(self, partition_id: str, names: list[str], ids: set[str], n: int) -> None:
        """Raise before writing when the FIFO's next ``n`` rows of a store hold live ids."""
        for name in names:
            key = (partition_id, name)
            slots = self._slots.get(key, {})
            w = self._writes.get(key, 0)
            hit = sorted(
                {slots[r] for r in ((w + j) % self.capacity for j in range(n)) if r in slots} - ids
            )
            if hit:
                shown = ", ".join(repr(h) for h in hit[:10]) + (
                    f" and {len(hit) - 10} more" if len(hit) > 10 else ""
                )
                raise DataPlaneFullError(
                    f"put_samples: field {name!r} of partition {partition_id!r}: writing {n} ids "
                    f"would overwrite the rows of live ids {shown} (capacity={self.capacity}, "
                    "full='refuse'); nothing written. clear_samples them first, raise capacity, "
                    "or pass full='evict_oldest'"
                )

    def get_samples(
        self, sample_ids: list[str], partition_id: str, select_fields: list[str]
    ) -> TensorDict:
        """The named fields of these ids; per-token fields as jagged nested tensors."""
        self._open()
        if not select_fields:
            raise ValueError("select_fields: name at least one field (no implicit fetch-all)")
        if not sample_ids:  # an empty claim reads as an empty batch, as TransferQueue's adapter
            return TensorDict({}, batch_size=[0])
        with self._lock:
            return self._get(sample_ids, partition_id, select_fields)

    def _get(
        self, sample_ids: list[str], partition_id: str, select_fields: list[str]
    ) -> TensorDict:
        out: dict[str, torch.Tensor] = {}
        for name in select_fields:
            index = self._index.get((partition_id, name))
            if index is None:
                known = sorted(f for p, f in self._index if p == partition_id)
                raise KeyError(f"field {name!r}: not in partition {partition_id!r}; found {known}")
            missing = [s for s in sample_ids if s not in index]
            if missing:
                evicted = self._evicted[(partition_id, name)]
                gone = [s for s in missing if s in evicted]
                never = [s for s in missing if s not in evicted]
                problems = []
                if gone:
                    problems.append(
                        f"sample ids {gone} were evicted (their rows were overwritten by later "
                        f"writes; each field's store holds capacity={self.capacity} items)"
                    )
                if never:
                    problems.append(f"no value for sample ids {never}")
                raise KeyError(f"field {name!r}: {'; '.join(problems)}")
            items = self._stores[(partition_id, name)].read(
                torch.tensor([index[s] for s in sample_ids], dtype=torch.int64)
            )
            out[name] = _column(items, self._nested[(partition_id, name)])
        return TensorDict(out, batch_size=[len(sample_ids)])

    def clear_samples(self, sample_ids: list[str] | None, partition_id: str) -> None:
        """Forget these ids (``None``: every id of the partition), claims included."""
        self._open()
        with self._lock:
            self._clear(sample_ids, partition_id)

    def _clear(self, sample_ids: list[str] | None, partition_id: str) -> None:
        order, table = self._order.get(partition_id, {}), self._tags.get(partition_id, {})
        part = self._partitions.get(partition_id)
        gone = list(order) if sample_ids is None else list(sample_ids)
        for s in gone:
            order.pop(s, None)
            table.pop(s, None)
            if part is not None:
                for claimed in part.claimed.values():
                    claimed.discard(s)
        for key, index in self._index.items():
            if key[0] != partition_id:
                continue
            slots, evicted = self._slots[key], self._evicted[key]
            if sample_ids is None:
                index.clear()
                slots.clear()
                evicted.clear()
                continue
            for s in sample_ids:
                i = index.pop(s, None)
                if i is not None:
                    del slots[i]
                evicted.discard(s)

    def live_sample_ids(self, partition_id: str, among: list[str] | None = None) -> set[str]:
        """Ids holding a row of at least one field of ``partition_id`` (only those ``among``).

        ``among`` bounds the work by the ids asked about rather than by the partition's size.

        Example:
            >>> from posttrain.reference_impls import RingBuffer
            >>> dp = NemoDataPlaneClient(RingBuffer, capacity=4)
            >>> _ = dp.put_samples(["a", "b"], "p", TensorDict({"x": torch.ones(2)}, [2]))
            >>> sorted(dp.live_sample_ids("p")), dp.live_sample_ids("q")
            (['a', 'b'], set())
        """
        self._open()
        with self._lock:
            indexes = [index for (p, _), index in self._index.items() if p == partition_id]
            if among is not None:
                return {s for s in among if any(s in index for index in indexes)}
            return {s for index in indexes for s in index}

    def close(self) -> None:
        """Release the stores; later calls raise (``close`` again does nothing)."""
        self._closed = True
        self._partitions.clear()
        self._order.clear()
        self._tags.clear()
        self._stores.clear()
        self._index.clear()
        self._slots.clear()
        self._evicted.clear()
        self._schemas.clear()
        self._nested.clear()
        self._writes.clear()

    def _open(self) -> None:
        if self._closed:
            raise RuntimeError("data-plane client used after close()")

    def _check(
        self, partition_id: str, name: str, items: TensorDictBase, nested: bool
    ) -> ItemSchema:
        """The schema the field's store holds (or will fix), ``items`` checked against it."""
        context = f"put_samples: field {name!r} of partition {partition_id!r} (nothing written)"
        schema = self._schemas.get((partition_id, name))
        if schema is not None:
            schema.validated_leaves(items, context)
            return schema
        try:
            # The schema the store's own first extend fixes: ragged stores free the length.
            return ItemSchema.of(items, ragged=nested)
        except ContractViolation as e:
            raise ContractViolation(e.violations, context) from None

    def _record(
        self, key: tuple[str, str], ids: list[str], rows: list[int], *, index: bool
    ) -> None:
        """Book a write of ``rows``: ids whose row it overwrote are evicted; ``ids`` move there."""
        slots, table, evicted = self._slots[key], self._index[key], self._evicted[key]
        for s, i in zip(ids, rows, strict=True):
            old = slots.pop(i, None)
            if old is not None:
                del table[old]
                evicted.add(old)
            if not index:
                continue
            if s in table:
                del slots[table[s]]
            table[s] = i
            slots[i] = s
            evicted.discard(s)

    def _store(self, partition_id: str, name: str, nested: bool) -> Any:
        key = (partition_id, name)
        if key not in self._stores:
            make = self.make_ragged_buffer if nested else self.make_buffer
            assert make is not None
            self._stores[key] = make(self.capacity)
            self._index[key] = {}
            self._slots[key] = {}
            self._evicted[key] = set()
            self._nested[key] = nested
        return self._stores[key]


_VALUE = "value"


def _items(value: torch.Tensor) -> TensorDictBase:
    """One item per sample under key 'value': jagged rows stay at their own lengths."""
    if value.is_nested:
        rows = [TensorDict({_VALUE: r}, batch_size=[]) for r in value.unbind()]
        return LazyStackedTensorDict.lazy_stack(rows, 0)
    return TensorDict({_VALUE: value}, batch_size=value.shape[:1])


def _column(items: TensorDictBase, nested: bool) -> torch.Tensor:
    if nested:
        if isinstance(items, LazyStackedTensorDict):
            rows = [x.get(_VALUE) for x in items.tensordicts]
        else:
            rows = list(items.get(_VALUE).unbind(0))
        return torch.nested.as_nested_tensor(rows, layout=torch.jagged)
    out: torch.Tensor = items.get(_VALUE)
    return out
