"""NeMo-RL's batching helpers, written from their specified behaviour (not from its code).

``BatchedDataDict.from_batches`` and ``shard_by_batch_size``
(``nemo_rl/distributed/batched_data_dict.py``), and the flattening of message logs that
``nemo_rl/algorithms/grpo.py`` does before training (``nemo_rl/data/llm_message_utils.py``).
"""

from __future__ import annotations

import operator
from collections.abc import Mapping, Sequence
from typing import Any

import torch


def _plain(data: Mapping[str, Any]) -> dict[str, Any]:
    inner = getattr(data, "data", None)  # BatchedDataDict is a UserDict
    return dict(inner if isinstance(inner, dict) else data)


def from_batches(
    batches: Sequence[Mapping[str, Any]], pad_value_dict: Mapping[str, int | float] | None = None
) -> dict[str, Any]:
    """``BatchedDataDict.from_batches`` as a plain dict, every key in every batch.

    Stricter than NeMo-RL's classmethod (``BatchedDataDict.from_batches`` in
    :mod:`posttrain.adapters.nemo_rl.mirror.batched_data_dict` is the faithful one): a key missing
    from any batch raises ``KeyError``, and a key holding 1-D tensors in one batch and 2-D in
    another raises ``TypeError``. Otherwise the values are stacked by :func:`stack_values`.

    Example:
        >>> import torch
        >>> out = from_batches([{"x": torch.tensor([[1, 2]])}, {"x": torch.tensor([[3, 4, 5]])}], {"x": 9})
        >>> out["x"].tolist()
        [[1, 2, 9], [3, 4, 5]]
    """
    pads = dict(pad_value_dict or {})
    out: dict[str, Any] = {}
    for key in sorted({k for b in batches for k in b}):
        missing = [i for i, b in enumerate(batches) if key not in b]
        if missing:
            raise KeyError(f"{key!r}: missing from batches {missing}")
        vals = [b[key] for b in batches]
        lists = all(isinstance(v, list) for v in vals)
        ranks = {v.ndim for v in vals if isinstance(v, torch.Tensor)}
        tensors = len(ranks) == 1 and all(isinstance(v, torch.Tensor) for v in vals)
        if not (lists or (tensors and ranks != {0})):
            raise TypeError(f"{key!r}: cannot concatenate {[type(v).__name__ for v in vals]}")
        out[key] = stack_values(vals, pads.get(key, 0))
    return out


def stack_values(values: Sequence[Any], pad: int | float = 0) -> Any:
    """One key's values from several batches, as one batch (NeMo-RL's stacking rule).

    The rule, by the first value: lists are joined; tensors that are all 1-D are joined
    end to end; tensors of 3+ dims keep their trailing dims and are right-padded on dim 1
    to the longest (the pad cast to each value's dtype), with the type the values promote to; any other tensors are cut into
    rows (a 1-D value's rows are single elements), each row flattened and right-padded to
    the longest row, with the first value's dtype. ``pad`` is cast to that dtype (a float
    pad on integers truncates toward zero). Anything else raises ``NotImplementedError``.

    Example:
        >>> import torch
        >>> stack_values([torch.tensor([1, 2]), torch.tensor([[3, 4]])], pad=-1).tolist()
        [[1, -1], [2, -1], [3, 4]]
    """
    first = values[0]
    if isinstance(first, list):
        return [x for v in values for x in v]
    if not isinstance(first, torch.Tensor):
        raise NotImplementedError(
            f"cannot stack values of type {type(first).__name__}: expected tensors or lists"
        )
    if all(v.ndim == 1 for v in values):
        return torch.cat(list(values))
    if first.ndim >= 3:
        dtype = first.dtype
        for v in values[1:]:
            dtype = torch.promote_types(dtype, v.dtype)
        width = max(int(v.shape[1]) for v in values)
        out = torch.empty(
            (sum(int(v.shape[0]) for v in values), width, *first.shape[2:]),
            dtype=dtype,
            device=first.device,
        )
        at = 0
        for v in values:
            block = out[at : at + v.shape[0]]
            # The pad as the value's own dtype holds it, then promoted with the value.
            block.fill_(torch.empty((), dtype=v.dtype).fill_(pad))
            block[:, : v.shape[1]] = v
            at += int(v.shape[0])
        return out
    rows = [r.reshape(-1) for v in values for r in v]
    table = torch.empty(
        (len(rows), max((int(r.numel()) for r in rows), default=0)),
        dtype=first.dtype,
        device=first.device,
    )
    table.fill_(pad)
    for i, r in enumerate(rows):
        table[i, : r.numel()] = r
    return table


def shard_by_batch_size(
    data: Mapping[str, Any], shards: int, batch_size: int | None = None
) -> list[dict[str, Any]]:
    """``BatchedDataDict.shard_by_batch_size`` without dynamic batching or packing.

    Cut into chunks of ``batch_size`` (default: everything), split each chunk into ``shards``
    equal parts, and give shard i the i-th part of every chunk. ``shards`` and ``batch_size``
    must be positive ints, and ``data`` must hold at least one key, every value as long as
    the others; anything else raises ``ValueError`` (``TypeError`` for a non-int count).

    Example:
        >>> [s["x"] for s in shard_by_batch_size({"x": list(range(8))}, 2, batch_size=4)]
        [[0, 1, 4, 5], [2, 3, 6, 7]]
    """
    data = _plain(data)
    if not data:
        raise ValueError("data: expected at least one key, found an empty mapping")
    lengths = {k: len(v) for k, v in data.items()}
    if len(set(lengths.values())) != 1:
        raise ValueError(f"data: expected values of one length, found lengths {lengths}")
    _positive("shards", shards)
    if batch_size is not None:
        _positive("batch_size", batch_size)
    n = next(iter(lengths.values()))
    if n == 0:  # nothing to cut: every shard is empty (no division by a batch of 0)
        return [{k: _select(v, []) for k, v in data.items()} for _ in range(shards)]
    bs = n if batch_size is None else batch_size
    if n % bs or bs % shards:
        raise ValueError(
            f"shard_by_batch_size: {n} items must split into batches of {bs} and each batch "
            f"into {shards} equal shards"
        )
    per = bs // shards
    index = [[c + i * per + j for c in range(0, n, bs) for j in range(per)] for i in range(shards)]
    return [{k: _select(v, idx) for k, v in data.items()} for idx in index]


def _positive(name: str, value: Any) -> None:
    try:
        if isinstance(value, bool):
            raise TypeError
        value = operator.index(value)  # numpy ints too
    except TypeError:
        raise TypeError(f"{name}: expected a positive int, found {value!r}") from None
    if value < 1:
        raise ValueError(f"{name}: expected a positive int, found {value}")


def _select(v: Any, idx: list[int]) -> Any:
    if isinstance(v, torch.Tensor):
        return v[torch.tensor(idx, dtype=torch.long)]
    return [v[i] for i in idx]


def flatten_message_logs(
    message_logs: Sequence[Sequence[Mapping[str, Any]]],
    *,
    pad_value: int = 0,
    make_sequence_length_divisible_by: int = 1,
) -> dict[str, torch.Tensor]:
    """NeMo-RL's message logs flattened for training, as ``grpo.py`` does.

    ``token_loss_mask`` is 1 on assistant messages that carry ``generation_logprobs`` (tokens
    generated in the rollout) and 0 elsewhere; ``generation_logprobs`` are 0 where a message
    has none (``add_grpo_token_loss_masks_and_generation_logprobs``); then
    ``batched_message_log_to_flat_message`` concatenates, right-pads to a multiple of
    ``make_sequence_length_divisible_by`` and returns int32 ``input_lengths``
    (``nemo_rl/data/llm_message_utils.py``).

    Example:
        >>> logs = [[{"role": "user", "token_ids": [5, 6]},
        ...          {"role": "assistant", "token_ids": [7], "generation_logprobs": [-0.5]}]]
        >>> out = flatten_message_logs(logs, make_sequence_length_divisible_by=4)
        >>> out["token_ids"].tolist(), out["token_loss_mask"].tolist(), out["input_lengths"].tolist()
        ([[5, 6, 7, 0]], [[0, 0, 1, 0]], [3])
    """
    rows: list[tuple[list[int], list[int], list[float]]] = []
    for log in message_logs:
        ids: list[int] = []
        mask: list[int] = []
        lps: list[float] = []
        for msg in log:
            toks = [int(t) for t in msg["token_ids"]]
            gen = msg.get("generation_logprobs")
            ids += toks
            if msg.get("role") == "assistant" and gen is not None:
                mask += [1] * len(toks)
                lps += [float(x) for x in gen]
            else:
                mask += [0] * len(toks)
                lps += [0.0] * len(toks)
        rows.append((ids, mask, lps))
    longest = max(len(r[0]) for r in rows)
    m = max(1, make_sequence_length_divisible_by)
    width = -(-longest // m) * m
    token_ids = torch.full((len(rows), width), pad_value, dtype=torch.int64)
    loss_mask = torch.zeros(len(rows), width, dtype=torch.int64)
    gen_lps = torch.zeros(len(rows), width, dtype=torch.float32)
    for i, (ids, mask, lps) in enumerate(rows):
        token_ids[i, : len(ids)] = torch.tensor(ids, dtype=torch.int64)
        loss_mask[i, : len(mask)] = torch.tensor(mask, dtype=torch.int64)
        gen_lps[i, : len(lps)] = torch.tensor(lps, dtype=torch.float32)
    return {
        "token_ids": token_ids,
        "token_loss_mask": loss_mask,
        "generation_logprobs": gen_lps,
        "input_lengths": torch.tensor([len(r[0]) for r in rows], dtype=torch.int32),
    }
