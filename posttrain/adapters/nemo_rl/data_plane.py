"""NeMo-RL's data-plane client interface (direct by-key part) over posttrain/TorchRL buffers.

``DataPlaneClient`` (``nemo_rl/data_plane/interfaces.py``, commit 7ea279a, since v0.7) stores
fields of samples by id in a partition: ``put_samples(sample_ids, partition_id, fields, tags)``
writes fields (a stage writes the fields it produced), ``get_samples(sample_ids, partition_id,
select_fields)`` reads named fields by id (no cursor moves), ``clear_samples(sample_ids |
None, partition_id)`` drops ids (``None``: all of the partition). Values travel as a
``TensorDict`` [N]; per-token fields as ``torch.jagged`` nested tensors (``data_plane/codec.py``).

Here each (partition, field) is stored in its own buffer made by ``make_buffer(capacity)``:
one item per sample, a per-token row kept at its own length (a ragged buffer) or a fixed
shape, read back by index (buffer capability ``read``).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch
from tensordict import LazyStackedTensorDict, TensorDict, TensorDictBase

__all__ = ["KVBatchMeta", "NemoDataPlaneClient"]


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
    write that fails (bad field, a store refusing it) changes nothing a reader can see: ids
    are indexed only after every field's store accepted its items. Rewriting a field of an id
    writes a new item and moves the id's index (the old item is left to be overwritten).

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
        written: dict[str, list[int]] = {}
        for name, items in rows.items():
            store = self._store(partition_id, name, nested[name])
            written[name] = [int(i) for i in store.extend(items).tolist()]
        for name, idx in written.items():
            self._index[(partition_id, name)].update(zip(sample_ids, idx, strict=True))
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
                raise KeyError(f"field {name!r}: no value for sample ids {missing}")
            items = self._stores[(partition_id, name)].read(
                torch.tensor([index[s] for s in sample_ids], dtype=torch.int64)
            )
            out[name] = _column(items, self._nested[(partition_id, name)])
        return TensorDict(out, batch_size=[len(sample_ids)])

    def clear_samples(self, sample_ids: list[str] | None, partition_id: str) -> None:
        """Forget these ids (``None``: every id of the partition)."""
        self._open()
        for (p, _), index in self._index.items():
            if p != partition_id:
                continue
            if sample_ids is None:
                index.clear()
            else:
                for s in sample_ids:
                    index.pop(s, None)

    def close(self) -> None:
        """Release the stores; later calls raise."""
        self._closed = True
        self._stores.clear()
        self._index.clear()
        self._nested.clear()

    def _open(self) -> None:
        if self._closed:
            raise RuntimeError("data-plane client used after close()")

    def _store(self, partition_id: str, name: str, nested: bool) -> Any:
        key = (partition_id, name)
        if key not in self._stores:
            make = self.make_ragged_buffer if nested else self.make_buffer
            assert make is not None
            self._stores[key] = make(self.capacity)
            self._index[key] = {}
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
