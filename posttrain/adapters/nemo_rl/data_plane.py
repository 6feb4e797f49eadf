"""NeMo-RL's data-plane client interface (direct by-key part) over posttrain/TorchRL buffers.

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

:class:`NemoGroupSlots` is the reserve-then-commit slot list of NeMo-RL's ``TQReplayBuffer``
(``nemo_rl/algorithms/async_utils/replay_buffer.py``, 7ea279a) over this client.
"""

from __future__ import annotations

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
    fields: list[str]
    sequence_lengths: list[int] | None = None
    extra_info: dict[str, Any] = field(default_factory=dict)
    tags: list[dict[str, Any]] | None = None


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

    def put_samples(
        self,
        sample_ids: list[str],
        partition_id: str,
        fields: TensorDictBase | None = None,
        tags: list[dict[str, Any]] | None = None,
    ) -> KVBatchMeta:
        """Write ``fields`` (a TensorDict [len(sample_ids)]) for these ids."""
        self._open()
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
        """Forget these ids (``None``: every id of the partition)."""
        self._open()
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

    def live_sample_ids(self, partition_id: str) -> set[str]:
        """Ids holding a row of at least one field of ``partition_id``.

        Example:
            >>> from posttrain.reference_impls import RingBuffer
            >>> dp = NemoDataPlaneClient(RingBuffer, capacity=4)
            >>> _ = dp.put_samples(["a", "b"], "p", TensorDict({"x": torch.ones(2)}, [2]))
            >>> sorted(dp.live_sample_ids("p")), dp.live_sample_ids("q")
            (['a', 'b'], set())
        """
        self._open()
        return {s for (p, _), index in self._index.items() if p == partition_id for s in index}

    def close(self) -> None:
        """Release the stores; later calls raise."""
        self._closed = True
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
            schema.check(items, context)
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


class NemoGroupSlots:
    """Reserve-then-commit prompt-group slots over a data-plane client, as ``TQReplayBuffer``.

    ``nemo_rl/algorithms/async_utils/replay_buffer.py:TQReplayBuffer`` (7ea279a): ``reserve``
    appends an unready slot stamped with the weight version (and target step) before the
    rollout starts; ``commit`` writes the group's rows to the data plane and marks the slot
    ready, rolling the rows back with ``clear_samples`` if the write fails; ``remove_group`` /
    ``remove`` drop slots (and, asked, their rows). Differences, on purpose: calls are
    synchronous (NeMo-RL's ``commit``/``remove`` are coroutines), and ``commit`` takes the
    packed ``sample_ids`` and ``fields`` (NeMo-RL packs a ``PromptGroupRecord`` itself with
    ``record_to_train_batch`` / ``pack_payload``).

    Example:
        >>> from posttrain.reference_impls import RingBuffer
        >>> slots = NemoGroupSlots(NemoDataPlaneClient(RingBuffer, capacity=8), "train")
        >>> gid = slots.reserve(weight_version=3, target_step=4, group_id="g0")
        >>> slots.ready_list, slots.size()
        ([False], 1)
        >>> meta = slots.commit(gid, ["g0_0", "g0_1"], TensorDict({"input_lengths": torch.tensor([2, 3])}, [2]), 3, 4)
        >>> slots.ready_list, meta.sequence_lengths, slots.count_for_target_step(4)
        ([True], [2, 3], 1)
    """

    def __init__(self, dp_client: NemoDataPlaneClient, partition_id: str) -> None:
        self._dp = dp_client
        self._partition_id = partition_id
        self.meta_list: list[KVBatchMeta | None] = []
        self.start_weight_list: list[int] = []
        self.end_weight_list: list[int] = []
        self.target_step_list: list[int | None] = []
        self.ready_list: list[bool] = []
        self._group_ids: list[str] = []

    def reserve(
        self, *, weight_version: int, target_step: int | None = None, group_id: str | None = None
    ) -> str:
        """Append an unready slot; return its ``group_id`` (a fresh uuid4 by default)."""
        import uuid

        gid = str(uuid.uuid4()) if group_id is None else group_id
        if gid in self._group_ids:
            raise ValueError(f"group_id={gid!r}: already has a live slot")
        self.meta_list.append(None)
        self.start_weight_list.append(weight_version)
        self.end_weight_list.append(-1)
        self.target_step_list.append(target_step)
        self.ready_list.append(False)
        self._group_ids.append(gid)
        return gid

    def commit(
        self,
        group_id: str,
        sample_ids: list[str],
        fields: TensorDictBase,
        start_weight_version: int,
        end_weight_version: int,
        tags: list[dict[str, Any]] | None = None,
    ) -> KVBatchMeta:
        """Write the group's rows and mark its slot ready; unknown ``group_id``: ``ValueError``.

        ``sample_ids`` that already hold rows in the partition (another group's live rows) are
        refused with ``ValueError`` before anything is written. A failed write (a refused
        schema, :class:`DataPlaneFullError`) clears the rows this call wrote, and only those,
        and re-raises; the slot stays reserved and unready.
        """
        if group_id not in self._group_ids:
            raise ValueError(
                f"commit called with unknown group_id={group_id!r}; reserve() must precede "
                "commit() (or the slot was already removed)"
            )
        taken = sorted(self._dp.live_sample_ids(self._partition_id).intersection(sample_ids))
        if taken:
            shown = ", ".join(repr(t) for t in taken[:10]) + (
                f" and {len(taken) - 10} more" if len(taken) > 10 else ""
            )
            raise ValueError(
                f"commit of group_id={group_id!r}: expected sample ids without live rows in "
                f"partition {self._partition_id!r}, found {shown} already live; nothing written"
            )
        if tags is None:
            tags = [{"group_id": group_id, "weight_version": start_weight_version}] * len(
                sample_ids
            )
        try:
            meta = self._dp.put_samples(list(sample_ids), self._partition_id, fields, tags)
        except BaseException:
            # None of sample_ids was live before the write, so any now live are this call's.
            wrote = self._dp.live_sample_ids(self._partition_id).intersection(sample_ids)
            if wrote:
                self._dp.clear_samples(sorted(wrote), self._partition_id)
            raise
        meta.task_name = "train"
        i = self._group_ids.index(group_id)
        self.meta_list[i] = meta
        self.start_weight_list[i] = start_weight_version
        self.end_weight_list[i] = end_weight_version
        self.ready_list[i] = True
        return meta

    def remove_group(self, group_id: str, *, remove_in_dp: bool = False) -> int:
        """Drop the slot of ``group_id`` (``ValueError`` if none is live)."""
        try:
            i = self._group_ids.index(group_id)
        except ValueError as error:
            raise ValueError(f"unknown group_id={group_id!r}") from error
        return self.remove([i], remove_in_dp=remove_in_dp)

    def remove(self, idxs: list[int], remove_in_dp: bool) -> int:
        """Drop the slots at ``idxs`` (and their rows when ``remove_in_dp``); how many."""
        if not idxs:
            return 0
        drop = sorted(set(idxs), reverse=True)
        if drop[0] >= len(self.meta_list) or drop[-1] < 0:
            raise IndexError(f"remove: indices out of range: {drop[0]}; size={len(self.meta_list)}")
        ids: list[str] = []
        for i in drop:
            meta = self.meta_list[i]
            if meta is not None:
                ids.extend(meta.sample_ids)
            for lst in (
                self.meta_list,
                self.start_weight_list,
                self.end_weight_list,
                self.target_step_list,
                self.ready_list,
                self._group_ids,
            ):
                del lst[i]
        if remove_in_dp and ids:
            self._dp.clear_samples(ids, self._partition_id)
        return len(drop)

    def count_for_target_step(self, target_step: int) -> int:
        """Slots stamped with ``target_step``."""
        return sum(1 for t in self.target_step_list if t == target_step)

    def size(self) -> int:
        """Slots held, ready or not."""
        return len(self.meta_list)

    def __len__(self) -> int:
        return len(self.meta_list)
