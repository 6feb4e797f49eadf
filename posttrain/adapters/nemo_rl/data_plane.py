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
store (TransferQueue's ``storage_capacity`` bounds a partition); here a store's FIFO write
evicts the oldest rows, and reading an id whose row was overwritten raises ``KeyError``.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch
from tensordict import LazyStackedTensorDict, TensorDict, TensorDictBase

from posttrain.contracts.schema import ItemSchema
from posttrain.contracts.validation import ContractViolation


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
    ) -> None:
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
        written: dict[str, list[int]] = {}
        try:
            for name, items in rows.items():
                store = self._store(partition_id, name, nested[name])
                written[name] = [int(i) for i in store.extend(items).tolist()]
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

    def close(self) -> None:
        """Release the stores; later calls raise."""
        self._closed = True
        self._stores.clear()
        self._index.clear()
        self._slots.clear()
        self._evicted.clear()
        self._schemas.clear()
        self._nested.clear()

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
