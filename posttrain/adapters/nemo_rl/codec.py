"""NeMo-RL's training data <-> the LLM layout v1, both ways, lossless on a round trip.

NeMo-RL (NVIDIA-NeMo/RL, commit 7ea279a, the one ``../shared/vectors/nemo_rl.json`` was made
at) trains GRPO on a ``BatchedDataDict`` built in ``nemo_rl/algorithms/grpo.py``:

- ``input_ids`` [B, S] right-padded token ids, ``input_lengths`` [B] int32;
- ``token_mask`` [B, S] (token dtype): 1 on tokens generated in the rollout only;
- ``sample_mask`` [B] float: the loss multiplier per sequence (no TorchRL twin);
- ``generation_logprobs`` [B, S]: the inference engine's log-probs, 0 off generated tokens;
- ``prev_logprobs`` / ``reference_policy_logprobs`` [B, S]: the training policy's (before the
  update) and the reference's, real values on prompt tokens, 0 on padding and position 0;
- ``advantages`` [B, S]: the sequence's advantage expanded along S.

Position t holds log p(token_t | tokens before t) in NeMo-RL and in the layout alike.
"""

from __future__ import annotations

import operator
from collections.abc import Mapping, Sequence
from typing import Any

import torch
from tensordict import LazyStackedTensorDict, TensorDict, TensorDictBase

from posttrain.adapters._layout import to_padded
from posttrain.contracts.layout import LLM_LAYOUT_V1, Layout
from posttrain.contracts.validation import check

__all__ = [
    "NEMO_KEY",
    "TOKEN_ALIGNED_FIELDS",
    "NemoFormatError",
    "batched_data_dict",
    "flatten_message_logs",
    "from_batches",
    "from_layout",
    "layout_to_wire",
    "materialize",
    "pack_jagged_fields",
    "shard_by_batch_size",
    "to_layout",
    "wire_to_layout",
]

NEMO_KEY = "nemo"
"""Sub-tree of the layout TensorDict that carries NeMo-RL fields with no layout twin."""

TOKEN_ALIGNED_FIELDS = frozenset(
    {
        "input_ids",
        "generation_logprobs",
        "prev_logprobs",
        "reference_policy_logprobs",
        "advantages",
        "token_mask",
        "sample_mask",
        "routed_experts",
    }
)
"""``nemo_rl/data_plane/column_io.py``'s per-token fields (``sample_mask`` is 1-D: stays dense)."""

# NeMo-RL key -> layout field; the rest travels under ("nemo", key).
_TO_FIELD = {
    "input_ids": "tokens",
    "generation_logprobs": "sample_log_probs",
    "reference_policy_logprobs": "ref_log_probs",
    "advantages": "advantage",
    "total_reward": "reward",
}
_DERIVED = ("input_lengths", "token_mask")  # rebuilt from the attention and assistant masks


class NemoFormatError(ValueError):
    """NeMo-RL data that does not have NeMo-RL's format (the message names key and found).

    Example:
        >>> import torch
        >>> to_layout({"input_ids": torch.tensor([[5, 6]], dtype=torch.int32)})
        Traceback (most recent call last):
        ...
        posttrain...NemoFormatError: 'input_ids': expected int64 ..., found torch.int32
    """


def batched_data_dict(data: dict[str, Any]) -> Any:
    """``nemo_rl``'s ``BatchedDataDict`` of ``data`` where nemo_rl is importable, else ``data``.

    Example:
        >>> isinstance(batched_data_dict({"x": [1]}), dict)  # nemo_rl is not installed here
        True
    """
    try:
        from nemo_rl.distributed.batched_data_dict import BatchedDataDict
    except ImportError:
        return data
    return BatchedDataDict(data)


def _plain(data: Mapping[str, Any]) -> dict[str, Any]:
    inner = getattr(data, "data", None)  # BatchedDataDict is a UserDict
    return dict(inner if isinstance(inner, dict) else data)


def _tensor(data: Mapping[str, Any], key: str, ndim: int, b: int | None = None) -> torch.Tensor:
    v = data.get(key)
    if not isinstance(v, torch.Tensor):
        raise NemoFormatError(f"{key!r}: expected a tensor, found {type(v).__name__}")
    if v.ndim != ndim or (b is not None and v.shape[0] != b):
        want = f"[{'B' if b is None else b}{', S' if ndim == 2 else ''}]"
        raise NemoFormatError(f"{key!r}: expected shape {want}, found {list(v.shape)}")
    return v


def to_layout(
    data: Mapping[str, Any], *, nan_outside: bool = False, layout: Layout = LLM_LAYOUT_V1
) -> TensorDict:
    """NeMo-RL ``train_data`` (dict or ``BatchedDataDict``) as an LLM-layout TensorDict [B].

    ``attention_mask`` is ``position < input_lengths``; ``assistant_mask`` is ``token_mask``
    (generated tokens only, which is what the layout's loss trains on). Log-prob values are
    kept as NeMo-RL wrote them (0 off generated tokens; the layout reads them only under the
    assistant mask); ``nan_outside=True`` writes NaN there as TorchRL does (not lossless).
    ``prev_logprobs``, ``sample_mask`` and any other per-sample tensor go under
    ``("nemo", key)``. ``advantages`` stay per-token [B, S]; ``total_reward`` becomes the
    reward.

    Example:
        >>> import torch
        >>> d = {"input_ids": torch.tensor([[5, 6, 7, 0]]), "input_lengths": torch.tensor([3], dtype=torch.int32),
        ...      "token_mask": torch.tensor([[0, 0, 1, 0]]), "sample_mask": torch.tensor([1.0])}
        >>> td = to_layout(d)
        >>> td["masks", "all_attention_mask"].tolist(), td["masks", "all_assistant_mask"].tolist()
        ([[True, True, True, False]], [[False, False, True, False]])
        >>> td["nemo", "sample_mask"].tolist()
        [1.0]
    """
    data = _plain(data)
    ids = _tensor(data, "input_ids", 2)
    if ids.dtype != torch.int64:
        raise NemoFormatError(
            f"'input_ids': expected int64 (NeMo-RL's token ids), found {ids.dtype}"
        )
    b, s = ids.shape
    lengths = _tensor(data, "input_lengths", 1, b)
    if lengths.dtype != torch.int32:
        raise NemoFormatError(f"'input_lengths': expected int32, found {lengths.dtype}")
    if (lengths < 0).any() or (lengths > s).any():
        raise NemoFormatError(
            f"'input_lengths': expected values in [0, {s}], found {lengths.tolist()}"
        )
    attn = torch.arange(s) < lengths[:, None]
    if "token_mask" in data:
        tm = _tensor(data, "token_mask", 2, b)
        if tm.shape != ids.shape or tm.dtype != ids.dtype:
            raise NemoFormatError(
                f"'token_mask': expected {list(ids.shape)} {ids.dtype} (the token dtype), "
                f"found {list(tm.shape)} {tm.dtype}"
            )
        if not ((tm == 0) | (tm == 1)).all():
            raise NemoFormatError("'token_mask': expected 0/1 values")
        asst = tm.bool()
        if (asst & ~attn).any():
            rows = sorted(set((asst & ~attn).nonzero()[:, 0].tolist()))
            raise NemoFormatError(f"'token_mask': rows {rows} mark tokens beyond input_lengths")
    else:
        asst = torch.zeros_like(attn)
    k = layout.key
    out: dict[Any, torch.Tensor] = {
        k("tokens"): ids,
        k("attention_mask"): attn,
        k("assistant_mask"): asst,
    }
    for key, v in data.items():
        if key in ("input_ids", *_DERIVED):
            continue
        if not isinstance(v, torch.Tensor) or v.ndim == 0 or v.shape[0] != b:
            raise NemoFormatError(
                f"{key!r}: expected a tensor with batch dim {b}, found "
                f"{type(v).__name__}{list(v.shape) if isinstance(v, torch.Tensor) else ''}"
            )
        field = _TO_FIELD.get(key)
        if field is None:
            out[(NEMO_KEY, key)] = v
            continue
        if field in ("sample_log_probs", "ref_log_probs"):
            if v.shape != ids.shape or v.dtype != torch.float32:
                raise NemoFormatError(
                    f"{key!r}: expected {list(ids.shape)} float32, found {list(v.shape)} {v.dtype}"
                )
            if nan_outside:
                v = torch.where(asst, v, float("nan"))
        out[k(field)] = v
    return TensorDict(out, batch_size=[b])


def _right_aligned(td: TensorDictBase, layout: Layout) -> TensorDictBase:
    """A dense batch whose attention mask is a prefix of every row (re-packed if not)."""
    if isinstance(td, LazyStackedTensorDict):
        td = to_padded(td, layout=layout)
    attn = td.get(layout.key("attention_mask"))
    s = attn.shape[-1]
    lengths = attn.sum(-1)
    if torch.equal(attn, torch.arange(s) < lengths[:, None]):
        return td
    # Stable sort puts each row's real positions first, in order: left padding and gaps alike.
    order = torch.sort((~attn).to(torch.int8), dim=-1, stable=True).indices
    out = td.clone()
    for key, v in td.items(include_nested=True, leaves_only=True):
        if isinstance(v, torch.Tensor) and v.ndim == 2 and v.shape == attn.shape:
            out.set(key, v.gather(-1, order))
    out.set(layout.key("attention_mask"), torch.arange(s) < lengths[:, None])
    return out


def from_layout(
    td: TensorDictBase, *, pad_token_id: int | None = None, layout: Layout = LLM_LAYOUT_V1
) -> Any:
    """An LLM-layout batch (dense, left/right padded, or ragged) as NeMo-RL ``train_data``.

    Right-padded (re-packed if needed); NaN log-probs become 0 (NeMo-RL's padding value);
    ``prev_logprobs`` is ``("nemo", "prev_logprobs")`` when present, else the behaviour
    log-probs (on-policy data: the policy before the update is the one that sampled);
    ``sample_mask`` is ``("nemo", "sample_mask")`` or ones; a [B] advantage is expanded to
    [B, S]; the reward becomes ``total_reward``. ``pad_token_id`` overwrites token ids past
    each length. Returns a ``BatchedDataDict`` where nemo_rl is importable, else a dict.

    ``td`` is checked against ``layout`` first (keys, dtypes, shapes): anything but a
    TensorDict raises :class:`NemoFormatError`, a batch that breaks the layout (no attention
    mask, float tokens, an advantage neither [B] nor [B, T]) a ``ContractViolation`` naming
    the key, what was expected and what was found.

    Example:
        >>> from posttrain.testing import llm_batch
        >>> d = from_layout(llm_batch(2, 6))
        >>> d["input_lengths"].dtype, d["token_mask"].dtype, d["advantages"].shape
        (torch.int32, torch.int64, torch.Size([2, 6]))
    """
    if not isinstance(td, TensorDictBase):
        raise NemoFormatError(
            f"td: expected an LLM-layout TensorDict, found {type(td).__name__} "
            "(NeMo-RL train data goes the other way, through to_layout)"
        )
    # Checked before any field is read: a missing or mistyped field would otherwise surface
    # as an AttributeError, or pass through as input_ids NeMo-RL cannot train on.
    # Float fields may hold any float dtype (bf16 log-probs, float64 rewards): cast below.
    check(
        td,
        layout,
        ragged=isinstance(td, LazyStackedTensorDict),
        any_float=True,
        context="from_layout",
    )
    td = _right_aligned(td, layout)
    if td.batch_dims != 1:
        td = td.reshape(-1)
    k = layout.key
    ids = td.get(k("tokens"))
    attn = td.get(k("attention_mask"))
    asst = td.get(k("assistant_mask")) & attn
    b, s = ids.shape
    lengths = attn.sum(-1).to(torch.int32)
    if pad_token_id is not None:
        ids = torch.where(attn, ids, pad_token_id)
    out: dict[str, Any] = {
        "input_ids": ids,
        "input_lengths": lengths,
        "token_mask": asst.to(ids.dtype),
    }
    sample = td.get(k("sample_log_probs"), None)
    if sample is not None:
        out["generation_logprobs"] = torch.nan_to_num(sample.float(), nan=0.0)
    ref = td.get(k("ref_log_probs"), None)
    if ref is not None:
        out["reference_policy_logprobs"] = torch.nan_to_num(ref.float(), nan=0.0)
    adv = td.get(k("advantage"), None)
    if adv is not None:
        out["advantages"] = adv[:, None].expand(b, s).contiguous() if adv.ndim == 1 else adv
    reward = td.get(k("reward"), None)
    if reward is not None:
        out["total_reward"] = reward
    nemo = td.get(NEMO_KEY, None)
    if nemo is not None:
        for key, v in nemo.items(include_nested=True, leaves_only=True):
            out[key if isinstance(key, str) else ".".join(key)] = v
    if "prev_logprobs" not in out and "generation_logprobs" in out:
        out["prev_logprobs"] = out["generation_logprobs"]
    out.setdefault("sample_mask", torch.ones(b, dtype=torch.float32))
    return batched_data_dict(out)


# --- NeMo-RL's own batching helpers (reproduced from their documented behaviour) ---------


def from_batches(
    batches: Sequence[Mapping[str, Any]], pad_value_dict: Mapping[str, int | float] | None = None
) -> dict[str, Any]:
    """``BatchedDataDict.from_batches``: concatenate batches, right-padding 2-D tensors.

    Per key (sorted): lists concatenate; 1-D tensors ``cat``; 2-D tensors are split into rows
    and right-padded with ``pad_value_dict.get(key, 0)``; tensors of 3+ dims are padded on
    dim 1 then concatenated (``nemo_rl/distributed/batched_data_dict.py``).

    Example:
        >>> import torch
        >>> out = from_batches([{"x": torch.tensor([[1, 2]])}, {"x": torch.tensor([[3, 4, 5]])}], {"x": 9})
        >>> out["x"].tolist()
        [[1, 2, 9], [3, 4, 5]]
    """
    pads = dict(pad_value_dict or {})
    keys = sorted({k for b in batches for k in b})
    out: dict[str, Any] = {}
    for key in keys:
        missing = [i for i, b in enumerate(batches) if key not in b]
        if missing:
            raise KeyError(f"{key!r}: missing from batches {missing}")
        vals = [b[key] for b in batches]
        pad = pads.get(key, 0)
        if all(isinstance(v, list) for v in vals):
            out[key] = [x for v in vals for x in v]
        elif all(isinstance(v, torch.Tensor) and v.ndim == 1 for v in vals):
            out[key] = torch.cat(vals)
        elif all(isinstance(v, torch.Tensor) and v.ndim == 2 for v in vals):
            rows = [r for v in vals for r in v]
            out[key] = torch.nn.utils.rnn.pad_sequence(rows, batch_first=True, padding_value=pad)
        elif all(isinstance(v, torch.Tensor) and v.ndim >= 3 for v in vals):
            width = max(v.shape[1] for v in vals)
            padded = []
            for v in vals:
                spec = [0, 0] * (v.ndim - 2) + [0, width - v.shape[1]]
                padded.append(torch.nn.functional.pad(v, spec, value=pad))
            out[key] = torch.cat(padded)
        else:
            raise TypeError(f"{key!r}: cannot concatenate {[type(v).__name__ for v in vals]}")
    return out


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


# --- the data plane's jagged wire format (nemo_rl/data_plane/codec.py) -----------------


def pack_jagged_fields(
    fields: Mapping[str, Any],
    *,
    lengths: torch.Tensor | None,
    token_aligned_fields: frozenset[str] | set[str] | None = TOKEN_ALIGNED_FIELDS,
) -> TensorDict:
    """NeMo-RL's ``pack_jagged_fields``: per-token fields become ``torch.jagged`` nested tensors.

    A field in ``token_aligned_fields`` that is at least 2-D, has the batch size and is at
    least ``max(lengths)`` wide becomes rows ``v[i, :lengths[i]]``; every other tensor stays
    dense (``input_lengths``, ``sample_mask``).

    Example:
        >>> import torch
        >>> td = pack_jagged_fields({"input_ids": torch.tensor([[1, 2, 0], [3, 4, 5]])},
        ...                         lengths=torch.tensor([2, 3]))
        >>> [r.tolist() for r in td["input_ids"].unbind()]
        [[1, 2], [3, 4, 5]]
    """
    n = None if lengths is None else int(lengths.shape[0])
    out: dict[str, Any] = {}
    aligned = token_aligned_fields or frozenset()
    for key, v in fields.items():
        if not isinstance(v, torch.Tensor):
            raise TypeError(f"{key!r}: expected a tensor, found {type(v).__name__}")
        if n is None:
            n = int(v.shape[0])
        if (
            lengths is not None
            and key in aligned
            and v.ndim >= 2
            and v.shape[0] == n
            and v.shape[1] >= int(lengths.max())
        ):
            rows = [v[i, : int(lengths[i])] for i in range(n)]
            out[key] = torch.nested.as_nested_tensor(rows, layout=torch.jagged)
        else:
            out[key] = v.detach().contiguous()
    return TensorDict(out, batch_size=[n or 0])


def materialize(
    td: TensorDictBase,
    layout: str = "padded",
    pad_value_dict: Mapping[str, int | float] | None = None,
    pad_to_seqlen: int = 0,
) -> Any:
    """NeMo-RL's ``materialize``: nested fields padded back (``layout="padded"``) or kept.

    Example:
        >>> import torch
        >>> td = pack_jagged_fields({"input_ids": torch.tensor([[1, 2, 0], [3, 4, 5]])},
        ...                         lengths=torch.tensor([2, 3]))
        >>> materialize(td, pad_value_dict={"input_ids": 0})["input_ids"].tolist()
        [[1, 2, 0], [3, 4, 5]]
    """
    if layout not in ("padded", "jagged"):
        raise ValueError(f"layout: expected 'padded' or 'jagged', found {layout!r}")
    pads = dict(pad_value_dict or {})
    out: dict[str, Any] = {}
    for key in td.keys():  # noqa: SIM118 - iterating a TensorDict yields its rows
        v = td.get(key)
        if isinstance(v, torch.Tensor) and v.is_nested and layout == "padded":
            v = torch.nested.to_padded_tensor(v, padding=pads.get(str(key), 0))
        if (
            pad_to_seqlen > 0
            and isinstance(v, torch.Tensor)
            and not v.is_nested
            and v.ndim >= 2
            and v.shape[1] < pad_to_seqlen
        ):
            spec = [0, 0] * (v.ndim - 2) + [0, pad_to_seqlen - v.shape[1]]
            v = torch.nn.functional.pad(v, spec, value=pads.get(str(key), 0))
        out[str(key)] = v
    return batched_data_dict(out)


def layout_to_wire(td: TensorDictBase, *, layout: Layout = LLM_LAYOUT_V1) -> TensorDict:
    """An LLM-layout batch (dense or ragged) in the data plane's jagged wire format.

    Example:
        >>> from posttrain.testing import ragged_llm_batch
        >>> wire = layout_to_wire(ragged_llm_batch([4, 6]))
        >>> wire["input_ids"].is_nested, wire["input_lengths"].dtype
        (True, torch.int32)
    """
    data = _plain(from_layout(td, layout=layout))
    return pack_jagged_fields(data, lengths=data["input_lengths"])


def wire_to_layout(td: TensorDictBase, *, layout: Layout = LLM_LAYOUT_V1) -> LazyStackedTensorDict:
    """The data plane's jagged wire format as a ragged LLM-layout batch (one item per row).

    Example:
        >>> from posttrain.testing import ragged_llm_batch
        >>> back = wire_to_layout(layout_to_wire(ragged_llm_batch([4, 6])))
        >>> [x["tokens", "full"].shape[-1] for x in back.tensordicts] <= [4, 6]
        True
    """
    dense = _plain(materialize(td, "padded"))
    for key in ("input_ids", "input_lengths"):
        if key not in dense:
            raise NemoFormatError(f"{key!r}: missing from the wire batch; found {sorted(dense)}")
    full = to_layout(dense, layout=layout)
    lengths = dense["input_lengths"].tolist()
    s = full.get(layout.key("tokens")).shape[-1]
    items = []
    for i, n in enumerate(lengths):
        item = full[i]
        items.append(item.apply(lambda v, n=n: v[:n] if v.ndim == 1 and v.shape[0] == s else v))
    return LazyStackedTensorDict.lazy_stack(items, 0)
