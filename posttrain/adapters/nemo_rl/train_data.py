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

from collections.abc import Mapping
from typing import Any

import torch
from tensordict import LazyStackedTensorDict, TensorDict, TensorDictBase

from posttrain.adapters._layout import to_padded
from posttrain.adapters.nemo_rl.mirror.batching import _plain
from posttrain.adapters.nemo_rl.upstream import from_nemo_rl
from posttrain.contracts.layout import LLM_LAYOUT_V1, Layout
from posttrain.errors import PosttrainError

NEMO_KEY = "nemo"
"""Sub-tree of the layout TensorDict that carries NeMo-RL fields with no layout twin."""

# NeMo-RL key -> layout field; the rest travels under ("nemo", key).
_TO_FIELD = {
    "input_ids": "tokens",
    "generation_logprobs": "sample_log_probs",
    "reference_policy_logprobs": "ref_log_probs",
    "advantages": "advantage",
    "total_reward": "reward",
}
_DERIVED = ("input_lengths", "token_mask")  # rebuilt from the attention and assistant masks


class NemoFormatError(PosttrainError, ValueError):
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
    cls = from_nemo_rl("BatchedDataDict")
    return data if cls is None else cls(data)


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
    out, b = _layout_fields(data, nan_outside, layout)
    return TensorDict(out, batch_size=[b])


def check_train_data(data: Mapping[str, Any], *, layout: Layout = LLM_LAYOUT_V1) -> None:
    """Raise what :func:`to_layout` raises on ``data``, without building the TensorDict.

    Example:
        >>> import torch
        >>> check_train_data({"input_ids": torch.tensor([[5, 6]]),
        ...                   "input_lengths": torch.tensor([2], dtype=torch.int32)})
        >>> check_train_data({"input_ids": torch.tensor([[5, 6]])})
        Traceback (most recent call last):
        ...
        posttrain...NemoFormatError: 'input_lengths': expected a tensor, found NoneType
    """
    _layout_fields(data, False, layout)


def _layout_fields(
    data: Mapping[str, Any], nan_outside: bool, layout: Layout
) -> tuple[dict[Any, torch.Tensor], int]:
    """:func:`to_layout`'s leaves by layout key, and B, every check made."""
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
        if not isinstance(key, str):  # a TensorDict key: check_train_data builds none
            raise NemoFormatError(f"{key!r}: expected a str key, found {type(key).__name__}")
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
    return out, b


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
    td: TensorDictBase,
    *,
    pad_token_id: int | None = None,
    layout: Layout = LLM_LAYOUT_V1,
    nan_to_zero: bool = True,
) -> Any:
    """An LLM-layout batch (dense, left/right padded, or ragged) as NeMo-RL ``train_data``.

    Right-padded (re-packed if needed); NaN log-probs become 0 (NeMo-RL's padding value;
    TorchRL pads with NaN) and, with it, infinite ones the float32 extremes (``torch.nan_to_num``);
    ``nan_to_zero=False`` gives the log-probs back as stored, bit for bit (NeMo-RL data that
    came in through :func:`to_layout`, as a replay buffer stores it);
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
    layout.validate_batch(
        td,
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
    b = int(ids.shape[0])
    lengths = attn.sum(-1).to(torch.int32)
    if pad_token_id is not None:
        ids = torch.where(attn, ids, pad_token_id)
    out: dict[str, Any] = {
        "input_ids": ids,
        "input_lengths": lengths,
        "token_mask": asst.to(ids.dtype),
    }
    out.update(_optional_fields(td, layout, nan_to_zero))
    if "prev_logprobs" not in out and "generation_logprobs" in out:
        out["prev_logprobs"] = out["generation_logprobs"]
    out.setdefault("sample_mask", torch.ones(b, dtype=torch.float32))
    return batched_data_dict(out)


def _optional_fields(td: TensorDictBase, layout: Layout, nan_to_zero: bool) -> dict[str, Any]:
    """The NeMo-RL fields of a right-aligned layout batch that it may or may not hold."""
    k = layout.key
    b, s = td.get(k("tokens")).shape
    out: dict[str, Any] = {}
    sample = td.get(k("sample_log_probs"), None)
    if sample is not None:
        out["generation_logprobs"] = _logprobs(sample, nan_to_zero)
    ref = td.get(k("ref_log_probs"), None)
    if ref is not None:
        out["reference_policy_logprobs"] = _logprobs(ref, nan_to_zero)
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
    return out


def _logprobs(v: torch.Tensor, nan_to_zero: bool) -> torch.Tensor:
    return torch.nan_to_num(v.float(), nan=0.0) if nan_to_zero else v.float()
