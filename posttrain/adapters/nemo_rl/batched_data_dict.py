"""A mirror of NeMo-RL's ``BatchedDataDict`` (``nemo_rl/distributed/batched_data_dict.py``).

Followed at NeMo-RL commit 7ea279a method by method, and pinned by outputs of NeMo-RL's own
class on the same inputs (``tests/data/nemo_rl_batched_data_dict.json``). Where ``nemo_rl``
imports, use its class; this one is for code that must run without it (NeMo-RL is not on the
package index). Not mirrored: ``PackedTensor`` values, multimodal helpers, ``all_gather``,
and ``shard_by_batch_size``'s ``sequence_packing_args`` (refused with ``NotImplementedError``).

NeMo-RL signals misuse with ``assert``; this mirror raises ``ValueError`` with the same
conditions, so ``python -O`` does not turn a bad call into a silent wrong answer.
"""

from __future__ import annotations

from collections import UserDict
from collections.abc import Iterator, Mapping, Sequence
from copy import deepcopy
from typing import Any, TypeVar

import torch

_T = TypeVar("_T", bound="BatchedDataDict")


class BatchedDataDict(UserDict[str, Any]):
    """Columns of one batch: tensors (dim 0 is the batch) and lists, as NeMo-RL's class.

    Example:
        >>> b = BatchedDataDict.from_batches(
        ...     [{"x": torch.tensor([[1, 2]]), "id": [0]}, {"x": torch.tensor([[3, 4, 5]]), "id": [1]}],
        ...     pad_value_dict={"x": 9},
        ... )
        >>> type(b).__name__, b["x"].tolist(), b["id"], b.size
        ('BatchedDataDict', [[1, 2, 9], [3, 4, 5]], [0, 1], 2)
    """

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.micro_batch_indices: list[list[list[int]]] | None = None
        self.micro_batch_lengths: list[list[int]] | None = None
        self.elem_counts_per_gb: list[int] | None = None

    @classmethod
    def from_batches(
        cls: type[_T],
        batches: Sequence[Mapping[Any, Any]],
        pad_value_dict: Mapping[str, int | float] | None = None,
        *,
        allow_missing_packed_tensors: bool = False,
    ) -> _T:
        """``BatchedDataDict.from_batches``: stack batches key by key (keys sorted).

        A key absent from an empty batch is fine; absent from a non-empty one, ``KeyError``.
        Lists concatenate; if every value is 1-D, ``torch.cat``; else (2-D, or 1-D mixed with
        2-D) every row is flattened and right-padded with ``pad_value_dict.get(key, 0)``
        (a 1-D value's rows are single elements); values of 3+ dims are padded on dim 1.
        ``allow_missing_packed_tensors`` changes nothing here (no ``PackedTensor`` values).

        Example:
            >>> out = BatchedDataDict.from_batches([{"a": torch.tensor([1, 2])},
            ...                                     {"a": torch.tensor([[3, 4]])}])
            >>> out["a"].tolist()
            [[1, 0], [2, 0], [3, 4]]
        """
        del allow_missing_packed_tensors
        out = cls()
        pads = dict(pad_value_dict or {})
        if not batches:
            return out

        def rows(item: Mapping[Any, Any]) -> int:
            return len(next(iter(item.values()))) if item else 0

        for k in sorted({key for item in batches for key in item}):
            missing = [i for i, item in enumerate(batches) if k not in item and rows(item)]
            if missing:
                raise KeyError(f"Key {k!r} is missing from non-empty batches {missing}.")
            values = [item[k] for item in batches if k in item]
            if isinstance(values[0], list):
                out[k] = [x for v in values for x in v]
            elif all(isinstance(v, torch.Tensor) and v.ndim == 1 for v in values):
                out[k] = torch.cat(values)
            elif isinstance(values[0], torch.Tensor):
                pad = pads.get(k, 0)
                if values[0].ndim >= 3:
                    width = max(v.shape[1] for v in values)
                    padded = [
                        torch.nn.functional.pad(
                            v, (0, 0) * (v.ndim - 2) + (0, width - v.shape[1]), value=pad
                        )
                        for v in values
                    ]
                    out[k] = torch.cat(padded, dim=0)
                else:
                    flat = [row.flatten() for v in values for row in v]
                    out[k] = torch.nn.utils.rnn.pad_sequence(
                        flat, batch_first=True, padding_value=pad
                    )
            else:
                raise NotImplementedError(
                    f"Attempted to stack for unsupported type {type(values[0])} with key {k}."
                )
        return out

    def _batch_size(self) -> int:
        sizes = {v.size(0) if isinstance(v, torch.Tensor) else len(v) for v in self.data.values()}
        if len(sizes) != 1:
            raise ValueError(
                f"Batch sizes are not the same across the rollout batch, found sizes: {sorted(sizes)}"
            )
        return sizes.pop()

    @property
    def size(self) -> int:
        """The first key's length (0 when empty), as NeMo-RL reads it.

        Example:
            >>> BatchedDataDict({"x": [1, 2, 3]}).size
            3
        """
        if not self.data:
            return 0
        v = next(iter(self.data.values()))
        return int(v.shape[0]) if isinstance(v, torch.Tensor) else len(v)

    def chunk(self, rank: int, chunks: int) -> SlicedDataDict:
        """Rows ``torch.arange(B).tensor_split(chunks)[rank]`` (tensors cloned).

        NeMo-RL's bound check compares ``rank`` with the rows per chunk (``B // chunks >
        rank``), not with ``chunks``; mirrored as is: 6 rows in 3 chunks refuse rank 2.

        Example:
            >>> BatchedDataDict({"x": [0, 1, 2, 3, 4, 5]}).chunk(1, 3)["x"]
            [2, 3]
        """
        b = self._batch_size()
        if b % chunks:
            raise ValueError(f"batch size ({b}) is not a multiple of chunks ({chunks})")
        if b // chunks <= rank:
            raise ValueError(
                f"index OOB: not enough splits for this rank. rollout_batch_size: {b}, "
                f"chunks ({chunks}), rank_idx ({rank})"
            )
        idx = torch.arange(b).tensor_split(chunks)[rank]
        out = SlicedDataDict()
        for k, v in self.data.items():
            out[k] = v[idx].clone() if torch.is_tensor(v) else [v[i] for i in idx]
        return out

    def reorder_data(self, reorded_indices: list[int]) -> None:
        """In place: row i moves to position ``reorded_indices[i]`` (NeMo-RL's spelling).

        Example:
            >>> b = BatchedDataDict({"x": ["a", "b", "c"]})
            >>> b.reorder_data([2, 0, 1]); b["x"]
            ['b', 'c', 'a']
        """
        n = self._batch_size()
        target = torch.as_tensor(list(reorded_indices), dtype=torch.int64)
        if target.numel() != n or not torch.equal(target.sort().values, torch.arange(n)):
            raise ValueError(
                f"reorded_indices: expected a permutation of range({n}), found "
                f"{list(reorded_indices)[:10]}" + (" ..." if len(reorded_indices) > 10 else "")
            )
        source = torch.empty(n, dtype=torch.int64)
        source[target] = torch.arange(n)  # the row that lands at each position
        self.data = _take_rows(self.data, source)

    def shard_by_batch_size(
        self,
        shards: int,
        batch_size: int | None = None,
        allow_uneven_shards: bool = False,
        dynamic_batching_args: Mapping[str, Any] | None = None,
        sequence_packing_args: Mapping[str, Any] | None = None,
    ) -> list[SlicedDataDict] | tuple[list[SlicedDataDict], list[int]]:
        """Chunks of ``batch_size``, each cut in ``shards``; shard i gathers every chunk's i-th part.

        ``allow_uneven_shards`` (``batch_size`` must then be ``None``) rounds the shard size up,
        so the last shards may be shorter or empty. ``dynamic_batching_args``
        (``max_tokens_per_microbatch``, ``sequence_length_round``, ``input_key``,
        ``input_lengths_key``) sorts each chunk by length, strides it over the shards, sets
        ``micro_batch_indices`` / ``micro_batch_lengths`` on every shard and returns
        ``(shards, sorted_indices)``, as NeMo-RL does.

        Example:
            >>> b = BatchedDataDict({"id": [0, 1, 2, 3, 4]})
            >>> [s["id"] for s in b.shard_by_batch_size(2, allow_uneven_shards=True)]
            [[0, 1, 2], [3, 4]]
        """
        if allow_uneven_shards and batch_size is not None:
            raise ValueError("batch_size must be None if allow_uneven_shards is True")
        if dynamic_batching_args is not None and sequence_packing_args is not None:
            raise ValueError(
                "dynamic_batching_args and sequence_packing_args cannot be passed together"
            )
        if sequence_packing_args is not None:
            raise NotImplementedError(
                "sequence_packing_args: not mirrored (NeMo-RL's packers); use nemo_rl's class"
            )
        total = self._batch_size()
        bs = total if batch_size is None else batch_size
        if total % bs:
            raise ValueError(f"Total batch size ({total}) is not a multiple of batch_size ({bs})")
        if not allow_uneven_shards and bs % shards:
            raise ValueError(f"Batch size ({bs}) is not a multiple of shards ({shards})")
        num_chunks = total // bs
        shard_size = (bs + shards - 1) // shards if allow_uneven_shards else bs // shards

        data: dict[str, Any] = self.data
        sorted_indices: list[int] = []
        if dynamic_batching_args is not None:
            # Each chunk's rows by length (ties keep their order), dealt round-robin to shards.
            lengths = torch.as_tensor(self.data[dynamic_batching_args["input_lengths_key"]])
            for c in range(num_chunks):
                by_length = torch.argsort(lengths[c * bs : (c + 1) * bs], stable=True) + c * bs
                for r in range(shards):
                    sorted_indices.extend(int(i) for i in by_length[r::shards])
            data = _take_rows(self.data, torch.tensor(sorted_indices, dtype=torch.int64))

        out = [SlicedDataDict() for _ in range(shards)]
        for s in range(shards):
            ranges: list[tuple[int, int]] = []
            for c in range(num_chunks):
                lo = c * bs + s * shard_size
                hi = c * bs + (s + 1) * shard_size
                if allow_uneven_shards:
                    lo, hi = min(lo, total), min(hi, total)
                if lo < hi:
                    ranges.append((lo, hi))
            for k, v in data.items():
                if torch.is_tensor(v):
                    parts = [v[lo:hi] for lo, hi in ranges]
                    out[s][k] = torch.cat(parts) if parts else v[:0].clone()
                else:
                    out[s][k] = [v[i] for lo, hi in ranges for i in range(lo, hi)]

        if dynamic_batching_args is None:
            return out
        max_tokens = int(dynamic_batching_args["max_tokens_per_microbatch"])
        step = int(dynamic_batching_args["sequence_length_round"])
        cap = int(data[dynamic_batching_args["input_key"]].shape[1])
        key = dynamic_batching_args["input_lengths_key"]
        mb_indices: list[list[list[int]]] = []
        mb_lengths: list[list[int]] = []
        for c in range(num_chunks):
            # Position j of every shard shares one micro-batch plan: its padded length is the
            # longest row any shard holds there, rounded up to ``step`` and capped at ``cap``.
            parts = [torch.as_tensor(sh[key])[c * shard_size : (c + 1) * shard_size] for sh in out]
            padded = []
            for j in range(shard_size):
                longest = max((int(p[j]) for p in parts if j < len(p)), default=0)
                padded.append(min(-(-longest // step) * step, cap))
            plan, widths = _plan_micro_batches(padded, max_tokens, step)
            mb_indices.append(plan)
            mb_lengths.append(widths)
        for shard in out:
            shard.micro_batch_indices = mb_indices
            shard.micro_batch_lengths = mb_lengths
        return out, sorted_indices

    def get_batch(self, batch_idx: int, batch_size: int | None = None) -> SlicedDataDict:
        """Rows ``[batch_size * batch_idx, batch_size * (batch_idx + 1))`` with their micro-batch plan.

        Example:
            >>> BatchedDataDict({"x": [0, 1, 2, 3]}).get_batch(1, 2)["x"]
            [2, 3]
        """
        if self.elem_counts_per_gb is not None:
            raise NotImplementedError("sequence-packed batches are not mirrored")
        if batch_size is None:
            raise ValueError("batch_size: expected an int for a batch without a packing plan")
        batch = self.slice(batch_size * batch_idx, batch_size * (batch_idx + 1))
        if self.micro_batch_indices is not None and self.micro_batch_lengths is not None:
            batch.micro_batch_indices = [self.micro_batch_indices[batch_idx]]
            batch.micro_batch_lengths = [self.micro_batch_lengths[batch_idx]]
        return batch

    def slice(self, start: int, end: int) -> SlicedDataDict:
        """Rows ``[start, end)``; ``end`` beyond a tensor's rows raises ``ValueError``.

        Example:
            >>> BatchedDataDict({"x": torch.arange(4)}).slice(1, 3)["x"].tolist()
            [1, 2]
        """
        out = SlicedDataDict()
        for k, v in self.data.items():
            if isinstance(v, torch.Tensor) and end > v.shape[0]:
                raise ValueError(
                    f"end: {end} is greater than the shape of the tensor: {v.shape[0]} for key: {k}"
                )
            out[k] = v[start:end]
        return out

    def repeat_interleave(self, num_repeats: int, *, share_immutable_media: bool = False) -> Any:
        """A new batch with each row ``num_repeats`` times (``self`` is left as it was; list items
        are deep-copied, as NeMo-RL does).

        Example:
            >>> BatchedDataDict({"k": torch.tensor([1, 2]), "o": [1, 2]}).repeat_interleave(2)["o"]
            [1, 1, 2, 2]
        """
        del share_immutable_media  # no multimodal leaves to share here
        out = type(self)()
        for k, v in self.data.items():
            if torch.is_tensor(v):
                out[k] = v.repeat_interleave(num_repeats, dim=0)
            else:
                out[k] = [deepcopy(item) for item in v for _ in range(num_repeats)]
        return out

    def truncate_tensors(self, dim: int, truncated_len: int) -> None:
        """In place: every tensor with more than ``dim`` dims narrowed to ``truncated_len``.

        Example:
            >>> b = BatchedDataDict({"x": torch.zeros(2, 5)}); b.truncate_tensors(1, 3)
            >>> b["x"].shape
            torch.Size([2, 3])
        """
        for k, v in list(self.data.items()):
            if torch.is_tensor(v) and v.ndim >= dim + 1:
                self.data[k] = torch.narrow(v, dim=dim, start=0, length=truncated_len)

    def make_microbatch_iterator(self, microbatch_size: int) -> Iterator[SlicedDataDict]:
        """Consecutive slices of ``microbatch_size`` rows; a size that does not divide raises.

        Example:
            >>> [m["x"] for m in BatchedDataDict({"x": [1, 2, 3, 4]}).make_microbatch_iterator(2)]
            [[1, 2], [3, 4]]
        """
        n = self.size
        if n % microbatch_size:
            raise ValueError(
                f"Data dict size ({n}) is not a multiple of the provided microbatch size "
                f"({microbatch_size})"
            )
        for i in range(0, n, microbatch_size):
            yield self.slice(i, i + microbatch_size)

    def make_microbatch_iterator_with_dynamic_shapes(
        self, sequence_dim: int = 1
    ) -> Iterator[SlicedDataDict]:
        """The dynamic-batching plan's micro-batches, each truncated to its planned length.

        Example:
            >>> b = BatchedDataDict({"x": torch.zeros(4, 6), "n": torch.tensor([1, 2, 5, 6])})
            >>> shards, _ = b.shard_by_batch_size(1, dynamic_batching_args={
            ...     "max_tokens_per_microbatch": 8, "sequence_length_round": 2,
            ...     "input_key": "x", "input_lengths_key": "n"})
            >>> [tuple(m["x"].shape) for m in shards[0].get_batch(0, 4).make_microbatch_iterator_with_dynamic_shapes()]
            [(2, 2), (1, 6), (1, 6)]
        """
        if (
            self.micro_batch_indices is None
            or len(self.micro_batch_indices) != 1
            or self.micro_batch_lengths is None
        ):
            raise ValueError("expected a batch with one dynamic micro-batch plan (get_batch)")
        for seqlen, (start, end) in zip(
            self.micro_batch_lengths[0], self.micro_batch_indices[0], strict=False
        ):
            mb = self.slice(start, end)
            mb.truncate_tensors(dim=sequence_dim, truncated_len=seqlen)
            yield mb

    def to(self: _T, device: str | torch.device) -> _T:
        """In place: every tensor moved to ``device``; returns ``self``.

        Example:
            >>> BatchedDataDict({"x": torch.ones(1)}).to("cpu")["x"].device.type
            'cpu'
        """
        for k, v in list(self.data.items()):
            if torch.is_tensor(v):
                self.data[k] = v.to(device)
        return self

    def select_indices(self, indices: list[int] | torch.Tensor) -> Any:
        """The rows at ``indices`` (tensors indexed, lists gathered); other values raise ``TypeError``.

        Example:
            >>> BatchedDataDict({"x": [5, 6, 7]}).select_indices([2, 0])["x"]
            [7, 5]
        """
        out = type(self)()
        for k, v in self.data.items():
            if torch.is_tensor(v):
                out[k] = v[indices]
            elif isinstance(v, list):
                out[k] = [v[i] for i in indices]
            else:
                raise TypeError(
                    f"Unsupported type {type(v)} for index selection in BatchedDataDict"
                )
        return out

    def get_dict(self) -> dict[Any, Any]:
        """The underlying dict (not a copy).

        Example:
            >>> BatchedDataDict({"x": [1]}).get_dict()
            {'x': [1]}
        """
        return self.data


class SlicedDataDict(BatchedDataDict):
    """A slice or shard of a larger batch (NeMo-RL's type for them).

    Example:
        >>> isinstance(BatchedDataDict({"x": [1]}).slice(0, 1), BatchedDataDict)
        True
    """


def _take_rows(data: Mapping[str, Any], rows: torch.Tensor) -> dict[str, Any]:
    """Every field's ``rows``, in that order (tensors by ``index_select``, lists by item)."""
    return {
        k: v.index_select(0, rows.to(v.device))
        if torch.is_tensor(v)
        else [v[i] for i in rows.tolist()]
        for k, v in data.items()
    }


def _plan_micro_batches(
    padded: list[int], max_tokens: int, step: int
) -> tuple[list[list[int]], list[int]]:
    """Greedy contiguous micro-batches over positions with these padded lengths.

    The rule: a micro-batch costs (its row count) x (its longest padded length) tokens; each
    position joins the open micro-batch while that cost stays within ``max_tokens``, else it
    opens the next one. A position longer than ``max_tokens`` alone is refused. No position:
    one empty micro-batch ``[0, 0]`` of length 0 (as NeMo-RL reports it).
    """
    ranges: list[list[int]] = []
    widths: list[int] = []
    start, peak = 0, 0
    for j, length in enumerate(padded):
        if length > max_tokens:
            raise ValueError(
                f"got an input of padded ({step}) sequence length of {length}, "
                f"however max microbatch size is {max_tokens} tokens"
            )
        if (j - start + 1) * max(peak, length) > max_tokens:
            ranges.append([start, j])
            widths.append(peak)
            start, peak = j, length
        else:
            peak = max(peak, length)
    ranges.append([start, len(padded)])
    widths.append(peak)
    return ranges, widths
