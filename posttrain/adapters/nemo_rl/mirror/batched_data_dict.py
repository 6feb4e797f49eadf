"""A mirror of NeMo-RL's ``BatchedDataDict`` (``nemo_rl/distributed/batched_data_dict.py``).

Each method is written from the rule its docstring states (what it returns for given
inputs), and pinned by outputs of NeMo-RL's own class at commit 7ea279a on the same inputs
(``tests/data/nemo_rl_batched_data_dict.json``). Where ``nemo_rl`` imports, use its class;
this one is for code that must run without it (NeMo-RL is not on the package index). Not
mirrored: ``PackedTensor`` values, multimodal helpers, ``all_gather``, and
``shard_by_batch_size``'s ``sequence_packing_args`` (refused with ``NotImplementedError``).

NeMo-RL signals misuse with ``assert``; this mirror raises ``ValueError`` on the same
conditions, so ``python -O`` does not turn a bad call into a silent wrong answer; each
message names the argument or key, what was expected and what was found.
"""

from __future__ import annotations

from collections import UserDict
from collections.abc import Callable, Iterator, Mapping, Sequence
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
        from posttrain.adapters.nemo_rl.mirror.batching import stack_values

        del allow_missing_packed_tensors
        out = cls()
        pads = dict(pad_value_dict or {})
        for key in sorted({k for batch in batches for k in batch}):
            # An empty batch (no key at all, or rows of length 0) may lack any key.
            lacking = [n for n, batch in enumerate(batches) if key not in batch and _rows(batch)]
            if lacking:
                raise KeyError(
                    f"from_batches key {key!r}: expected in every non-empty batch, "
                    f"found it absent from batches {lacking}"
                )
            out[key] = stack_values([b[key] for b in batches if key in b], pads.get(key, 0))
        return out

    def _batch_size(self) -> int:
        counts = {
            k: int(v.shape[0]) if isinstance(v, torch.Tensor) else len(v)
            for k, v in self.data.items()
        }
        if len(set(counts.values())) != 1:
            shown = ", ".join(f"{k!r}: {n}" for k, n in list(counts.items())[:10])
            raise ValueError(
                f"batch keys: expected one row count, found {{{shown}}}"
                + (f" and {len(counts) - 10} more" if len(counts) > 10 else "")
            )
        return next(iter(counts.values()))

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
        """Part ``rank`` of the batch cut into ``chunks`` equal, consecutive parts.

        The rule: with ``B`` rows and ``n = B // chunks``, part ``rank`` is rows
        ``[rank * n, (rank + 1) * n)`` (a negative ``rank`` counts from the last part);
        tensors come back as copies, list values as new lists. Refused: ``chunks`` not
        dividing ``B``, and ``rank >= n``. That bound compares ``rank`` with the rows per part,
        not with ``chunks`` (NeMo-RL's check, kept so both accept the same calls): 6 rows in 3
        parts refuse rank 2.

        Example:
            >>> BatchedDataDict({"x": [0, 1, 2, 3, 4, 5]}).chunk(1, 3)["x"]
            [2, 3]
        """
        total = self._batch_size()
        if total % chunks:
            raise ValueError(
                f"chunk chunks: expected a divisor of the batch's {total} rows, found {chunks}"
            )
        per_part = total // chunks
        if rank >= per_part:
            raise ValueError(
                f"chunk rank: expected below {per_part} (the rows per part of {total} rows "
                f"in {chunks}), found {rank}"
            )
        part = rank + chunks if rank < 0 else rank
        if not 0 <= part < chunks:
            raise IndexError(f"chunk rank: expected -{chunks} or more, found {rank}")
        lo, hi = part * per_part, (part + 1) * per_part
        out = SlicedDataDict()
        for k, v in self.data.items():
            out[k] = v[lo:hi].clone() if isinstance(v, torch.Tensor) else list(v[lo:hi])
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
        """Split the batch over ``shards`` ranks, keeping each global batch's order.

        The rule, with ``B`` rows and ``G = batch_size`` (``B`` when ``None``): the rows form
        ``B / G`` global batches of ``G`` consecutive rows; each global batch is cut in
        ``shards`` consecutive parts of ``m = G / shards`` rows, and shard ``s`` holds part
        ``s`` of every global batch, global batch by global batch, i.e. rows
        ``g * G + s * m + j`` for ``g`` in order, then ``j < m``. With
        ``allow_uneven_shards`` (``batch_size`` must then be ``None``; one global batch),
        ``m = ceil(B / shards)`` and shard ``s`` holds rows ``[s * m, (s + 1) * m)`` clipped
        to ``B``, so the last shards may be shorter or empty. Tensors come back as copies.

        ``dynamic_batching_args`` (``max_tokens_per_microbatch``, ``sequence_length_round``,
        ``input_key``, ``input_lengths_key``) first reorders each global batch: its rows
        ranked by length (ties by position), the row of rank ``r`` placed at part ``r % shards``,
        slot ``r // shards``. The cut above then runs on the reordered rows, every shard gets
        the same micro-batch plan (``micro_batch_indices`` / ``micro_batch_lengths``, one list
        per global batch; see ``_plan_micro_batches``) and the call returns
        ``(shards, order)``, ``order[i]`` being the original row now at position ``i``.
        Slot ``j`` of a plan is as long as the longest row any shard holds at slot ``j`` of
        that global batch, rounded up to ``sequence_length_round`` and capped at the width of
        ``input_key``.

        Example:
            >>> b = BatchedDataDict({"id": [0, 1, 2, 3, 4]})
            >>> [s["id"] for s in b.shard_by_batch_size(2, allow_uneven_shards=True)]
            [[0, 1, 2], [3, 4]]
            >>> b = BatchedDataDict({"id": list(range(8))})
            >>> [s["id"] for s in b.shard_by_batch_size(2, batch_size=4)]
            [[0, 1, 4, 5], [2, 3, 6, 7]]
        """
        total, per_batch = _shard_rows(
            self._batch_size,
            shards,
            batch_size,
            allow_uneven_shards,
            dynamic_batching_args is not None,
            sequence_packing_args is not None,
        )
        batches = total // per_batch
        width = -(-per_batch // shards) if allow_uneven_shards else per_batch // shards
        # Row numbers laid out as [global batch, shard, slot]; the uneven case (one global
        # batch) pads the grid with -1 past the last row.
        grid = torch.full((batches * shards * width,), -1, dtype=torch.int64)
        grid[:total] = torch.arange(total)
        grid = grid.view(batches, shards, width)

        data: dict[str, Any] = self.data
        order: list[int] = []
        if dynamic_batching_args is not None:
            lengths = torch.as_tensor(self.data[dynamic_batching_args["input_lengths_key"]])
            order = _dealt_by_length(lengths, batches, per_batch, shards)
            data = _take_rows(self.data, torch.tensor(order, dtype=torch.int64))

        out = []
        for s in range(shards):
            rows = grid[:, s].reshape(-1)
            out.append(SlicedDataDict(_take_rows(data, rows[rows >= 0])))
        if dynamic_batching_args is None:
            return out

        mb_indices, mb_lengths = _shard_micro_batches(data, grid, dynamic_batching_args)
        for shard in out:
            shard.micro_batch_indices = mb_indices
            shard.micro_batch_lengths = mb_lengths
        return out, order

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
                    f"slice end: expected at most key {k!r}'s {v.shape[0]} rows, found {end}"
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
                "make_microbatch_iterator microbatch_size: expected a divisor of the batch's "
                f"{n} rows, found {microbatch_size}"
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
                    f"select_indices key {k!r}: expected a tensor or a list, "
                    f"found {type(v).__name__}"
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


def _rows(batch: Mapping[Any, Any]) -> int:
    """A batch's row count as NeMo-RL reads it: the length of its first value (0 if none)."""
    for value in batch.values():
        return len(value)
    return 0


def _take_rows(data: Mapping[str, Any], rows: torch.Tensor) -> dict[str, Any]:
    """Every field's ``rows``, in that order (tensors by ``index_select``, lists by item)."""
    return {
        k: v.index_select(0, rows.to(v.device))
        if torch.is_tensor(v)
        else [v[i] for i in rows.tolist()]
        for k, v in data.items()
    }


def _shard_rows(
    rows: Callable[[], int],
    shards: int,
    batch_size: int | None,
    allow_uneven_shards: bool,
    dynamic: bool,
    packing: bool,
) -> tuple[int, int]:
    """``shard_by_batch_size``'s argument checks: (the batch's rows, one global batch's).

    ``rows`` is asked only once the packing arguments passed, as NeMo-RL's order has it."""
    if allow_uneven_shards and batch_size is not None:
        raise ValueError(
            "shard_by_batch_size batch_size: expected None with allow_uneven_shards=True, "
            f"found {batch_size}"
        )
    if dynamic and packing:
        raise ValueError(
            "shard_by_batch_size dynamic_batching_args, sequence_packing_args: "
            "expected at most one of them, found both"
        )
    if packing:
        raise NotImplementedError(
            "sequence_packing_args: not mirrored (NeMo-RL's packers); use nemo_rl's class"
        )
    total = rows()
    per_batch = total if batch_size is None else batch_size
    if total % per_batch:
        raise ValueError(
            "shard_by_batch_size batch_size: expected a divisor of the batch's "
            f"{total} rows, found {per_batch}"
        )
    if not allow_uneven_shards and per_batch % shards:
        raise ValueError(
            f"shard_by_batch_size shards: expected a divisor of batch_size {per_batch}, "
            f"found {shards}"
        )
    return total, per_batch


def _dealt_by_length(lengths: torch.Tensor, batches: int, per_batch: int, shards: int) -> list[int]:
    """Dynamic batching's row order: each global batch ranked by length (ties by position),
    the row of rank ``r`` dealt to part ``r % shards``, slot ``r // shards``."""
    ranked = torch.argsort(lengths.to("cpu").view(batches, per_batch), dim=1, stable=True)
    rank = torch.arange(per_batch)
    dealt = torch.argsort((rank % shards) * per_batch + rank // shards)
    first_row = (torch.arange(batches) * per_batch).unsqueeze(1)
    order: list[int] = (ranked[:, dealt] + first_row).reshape(-1).tolist()
    return order


def _shard_micro_batches(
    data: Mapping[str, Any], grid: torch.Tensor, args: Mapping[str, Any]
) -> tuple[list[list[list[int]]], list[list[int]]]:
    """The micro-batch plan every shard gets: (indices, lengths), one list per global batch.

    ``grid`` holds row numbers as [global batch, shard, slot] (-1: no row)."""
    step = int(args["sequence_length_round"])
    cap = int(data[args["input_key"]].shape[1])
    held = torch.as_tensor(data[args["input_lengths_key"]]).to("cpu")
    # Each slot's longest row over the shards; an empty grid cell counts as length 0.
    by_cell = torch.where(grid >= 0, held[grid.clamp(min=0)], torch.zeros((), dtype=held.dtype))
    longest = by_cell.amax(dim=1)
    padded = torch.clamp((-(-longest // step)) * step, max=cap)
    plans = [
        _plan_micro_batches([int(x) for x in row], int(args["max_tokens_per_microbatch"]), step)
        for row in padded
    ]
    mb_indices = [plan for plan, _ in plans]
    mb_lengths = [widths for _, widths in plans]
    return mb_indices, mb_lengths


def _plan_micro_batches(
    padded: list[int], max_tokens: int, step: int
) -> tuple[list[list[int]], list[int]]:
    """Cut slots with these padded lengths into consecutive micro-batches.

    The rule: a micro-batch of ``k`` slots whose longest is ``w`` costs ``k * w`` tokens.
    Each micro-batch starts where the previous one ended and takes the most slots whose cost
    stays within ``max_tokens`` (the cost only grows with ``k``, so that is a single cut);
    its reported length is ``w``. A slot longer than ``max_tokens`` fits nowhere and is
    refused (``step`` only names the rounding in that error). No slot at all: one empty
    micro-batch ``[0, 0]`` of length 0, as NeMo-RL reports it.

    Example:
        >>> _plan_micro_batches([4, 4, 8, 8, 16], 16, 4)
        ([[0, 2], [2, 4], [4, 5]], [4, 8, 16])
    """
    lengths = torch.tensor(padded, dtype=torch.int64)
    over = (lengths > max_tokens).nonzero()
    if over.numel():
        worst = int(lengths[over[0, 0]])
        raise ValueError(
            f"dynamic_batching_args max_tokens_per_microbatch: expected at least every "
            f"row's padded length (rounded to {step}), found {max_tokens} for a row of {worst}"
        )
    if not padded:
        return [[0, 0]], [0]
    bounds: list[list[int]] = []
    widths: list[int] = []
    lo = 0
    while lo < len(padded):
        peak = lengths[lo:].cummax(0).values
        cost = torch.arange(1, len(peak) + 1) * peak
        take = int((cost <= max_tokens).sum())  # cost is non-decreasing: a prefix fits
        bounds.append([lo, lo + take])
        widths.append(int(peak[take - 1]))
        lo += take
    return bounds, widths
