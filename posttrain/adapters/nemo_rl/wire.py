"""The NeMo-RL data plane's jagged wire format (``nemo_rl/data_plane/codec.py``).

Per-token fields travel as ``torch.jagged`` nested tensors (``pack_jagged_fields``) and are
padded back on arrival (``materialize``); ``layout_to_wire`` / ``wire_to_layout`` go between
it and the LLM layout v1 through NeMo-RL's training data (:mod:`.train_data`).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch
from tensordict import LazyStackedTensorDict, TensorDict, TensorDictBase

from posttrain.adapters.nemo_rl.mirror.batching import _plain
from posttrain.adapters.nemo_rl.train_data import (
    NemoFormatError,
    batched_data_dict,
    from_layout,
    to_layout,
)
from posttrain.contracts.layout import LLM_LAYOUT_V1, Layout

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
