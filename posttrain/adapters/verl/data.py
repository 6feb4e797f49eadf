"""verl's ``DataProto`` <-> the LLM layout v1, both ways, lossless on a round trip.

verl 0.9.1 (``verl/protocol.py``, ``verl/workers/rollout/hf_rollout.py``,
``verl/trainer/ppo/ray_trainer.py``) trains PPO/GRPO on a ``DataProto``: a TensorDict ``batch``
[B], per-sample numpy arrays ``non_tensor_batch`` and a ``meta_info`` dict. Its batch keys:

- ``input_ids`` [B, P + R] = ``prompts`` [B, P] (left-padded) then ``responses`` [B, R]
  (right-padded), ``attention_mask`` [B, P + R] (0/1, int64 from the tokenizer) and
  ``position_ids`` ([B, P + R], or [B, 3, P + R] for rotary-3D models);
- ``response_mask`` [B, R]: the response tokens the loss trains on (tool output in a
  multi-turn response is attended but masked out); ``attention_mask[:, -R:]`` when absent
  (``compute_response_mask``);
- response-aligned [B, R] values: ``old_log_probs`` (the policy before the update: the
  ratio's denominator), ``ref_log_prob``, ``advantages``, ``returns``, ``values``,
  ``token_level_scores``, ``token_level_rewards`` (the outcome score on the last response
  token), ``rollout_log_probs`` ...;
- ``non_tensor_batch["uid"]``: the GRPO group (one uuid string per prompt, repeated).

Column j of a response-aligned value belongs to ``input_ids[:, P + j]`` and holds
log p(token | tokens before it), the layout's alignment, so a value moves without a shift.

Example:
    >>> import torch
    >>> from posttrain.testing import llm_batch
    >>> proto = from_layout(llm_batch(2, 8))  # a posttrain batch as verl trains on it
    >>> sorted(proto.batch.keys())[:4], proto.non_tensor_batch["uid"].tolist()
    (['advantages', 'attention_mask', 'input_ids', 'old_log_probs'], ['0', '0'])
    >>> td = to_layout(proto)
    >>> td["masks", "all_assistant_mask"].sum().item() == proto.batch["response_mask"].sum().item()
    True
"""

from __future__ import annotations

from typing import Any

import numpy as np
import torch
from tensordict import (
    LazyStackedTensorDict,
    NonTensorData,
    NonTensorStack,
    TensorDict,
    TensorDictBase,
)

from posttrain.adapters._layout import to_padded
from posttrain.contracts.layout import LLM_LAYOUT_V1, Layout
from posttrain.errors import PosttrainError

VERL_KEY = "verl"
"""Sub-tree of the layout TensorDict that carries what of a ``DataProto`` has no layout twin."""

FORMAT_KEY = (VERL_KEY, "format")
"""Where :func:`to_layout` records what a lossless way back needs (prompt length, key order,
mask and numpy dtypes): a ``NonTensorData`` dict."""

# verl's response-aligned [B, R] keys that are layout fields ([B, T] there).
_RESPONSE_FIELDS = {
    "old_log_probs": "sample_log_probs",
    "ref_log_prob": "ref_log_probs",
    "advantages": "advantage",
}
# Rebuilt from the layout's tokens and masks (and checked against them on the way in).
_DERIVED = ("input_ids", "attention_mask", "prompts", "responses", "response_mask")


class VerlFormatError(PosttrainError, ValueError):
    """A ``DataProto`` (or layout batch) verl's format cannot hold; the message names the key.

    Example:
        >>> to_layout(object())
        Traceback (most recent call last):
        ...
        posttrain...VerlFormatError: data: expected a verl DataProto (batch, non_tensor_batch, meta_info), found object
    """


def _data_proto() -> Any:
    from verl.protocol import DataProto  # verl is optional: imported when a batch is built

    return DataProto


def _mask(v: Any, key: str, shape: tuple[int, ...]) -> torch.Tensor:
    if not isinstance(v, torch.Tensor) or tuple(v.shape) != shape:
        found = list(v.shape) if isinstance(v, torch.Tensor) else type(v).__name__
        raise VerlFormatError(
            f"{key!r}: expected a 0/1 tensor of shape {list(shape)}, found {found}"
        )
    if v.is_floating_point() or v.is_complex() or not ((v == 0) | (v == 1)).all():
        raise VerlFormatError(f"{key!r}: expected 0/1 values (int or bool), found {v.dtype} values")
    return v.bool()


def _response_value(v: Any, key: str, shape: tuple[int, int]) -> torch.Tensor:
    if not isinstance(v, torch.Tensor) or tuple(v.shape) != shape or not v.is_floating_point():
        found = f"{list(v.shape)} {v.dtype}" if isinstance(v, torch.Tensor) else type(v).__name__
        raise VerlFormatError(
            f"{key!r}: expected a float tensor of shape {list(shape)} (response-aligned), "
            f"found {found}"
        )
    return v


def _group_ids(uid: np.ndarray) -> torch.Tensor:
    """int64 group ids numbered by first appearance of each uid."""
    first: dict[Any, int] = {}
    return torch.tensor([first.setdefault(u, len(first)) for u in uid.tolist()], dtype=torch.int64)


def to_layout(data: Any, *, layout: Layout = LLM_LAYOUT_V1) -> TensorDict:
    """A verl ``DataProto`` as an LLM-layout TensorDict [B]; :func:`from_layout` inverts it.

    ``tokens`` is ``input_ids``; ``attention_mask`` its bool; ``assistant_mask`` is False on
    the prompt and ``response_mask`` on the response. ``old_log_probs``, ``ref_log_prob`` and
    ``advantages`` become ``sample_log_probs``, ``ref_log_probs`` and a [B, T] ``advantage``
    (0 on the prompt, their dtype kept); ``reward`` is ``token_level_rewards`` summed over the
    response (what verl's outcome estimators read); ``group_id`` numbers the ``uid`` groups
    by first appearance. Every other batch tensor (``position_ids``, ``returns``, ...) goes
    under ``("verl", key)`` as it is, every ``non_tensor_batch`` array under ``("verl", key)``
    as a ``NonTensorStack``, ``meta_info`` under ``("verl", "meta_info")``.

    A key that breaks verl's format raises :class:`VerlFormatError` naming it: ``input_ids``
    not int64 [B, T]; a mask not 0/1 of its shape; ``responses`` or ``prompts`` other than
    the slices of ``input_ids``; a ``response_mask`` True where ``attention_mask`` is not; a
    mapped value not a float [B, R]; a ``non_tensor_batch`` entry without B rows; a key
    named ``meta_info`` or ``format``, or in both ``batch`` and ``non_tensor_batch``.

    Example:
        >>> import torch
        >>> from verl.protocol import DataProto
        >>> ids = torch.tensor([[0, 5, 6, 7, 0]])  # prompt [0, 5, 6] left-padded, response [7, 0]
        >>> proto = DataProto.from_dict({"input_ids": ids, "responses": ids[:, 3:],
        ...     "attention_mask": torch.tensor([[0, 1, 1, 1, 0]]),
        ...     "old_log_probs": torch.tensor([[-0.5, 0.0]])})
        >>> td = to_layout(proto)
        >>> td["masks", "all_assistant_mask"].tolist(), td["log_probs", "full"].tolist()
        ([[False, False, False, True, False]], [[0.0, 0.0, 0.0, -0.5, 0.0]])
    """
    batch, non_tensor, meta = _proto_parts(data)
    ids, attn_raw, attn, resp_raw, resp, p = _tokens_and_masks(batch)
    b, t = ids.shape
    asst = torch.zeros_like(attn)
    asst[:, p:] = resp
    k = layout.key
    out: dict[Any, Any] = {k("tokens"): ids, k("attention_mask"): attn, k("assistant_mask"): asst}
    _batch_values(batch, layout, (b, t, p), out)
    kinds = _non_tensor_values(batch, non_tensor, b, out)
    if "uid" in non_tensor:
        out[k("group_id")] = _group_ids(non_tensor["uid"])
    out[(VERL_KEY, "meta_info")] = NonTensorData(dict(meta), batch_size=[b])
    out[FORMAT_KEY] = NonTensorData(
        {
            "prompt_length": p,
            "batch_keys": list(batch.keys()),
            "attention_mask": str(attn_raw.dtype),
            "response_mask": None if resp_raw is None else str(resp_raw.dtype),
            "non_tensor": kinds,
        },
        batch_size=[b],
    )
    return TensorDict(out, batch_size=[b])


def _proto_parts(data: Any) -> tuple[TensorDictBase, dict[str, Any], dict[str, Any]]:
    """A ``DataProto``'s ``batch``, ``non_tensor_batch`` and ``meta_info``, each checked."""
    batch = getattr(data, "batch", None)
    non_tensor = getattr(data, "non_tensor_batch", None)
    meta = getattr(data, "meta_info", None)
    if not isinstance(non_tensor, dict) or not isinstance(meta, dict) or not hasattr(data, "batch"):
        raise VerlFormatError(
            "data: expected a verl DataProto (batch, non_tensor_batch, meta_info), found "
            f"{type(data).__name__}"
        )
    if not isinstance(batch, TensorDictBase) or batch.batch_dims != 1:
        raise VerlFormatError(
            f"batch: expected a TensorDict with one batch dim, found {type(batch).__name__}"
            + (
                f" of batch size {list(batch.batch_size)}"
                if isinstance(batch, TensorDictBase)
                else ""
            )
        )
    return batch, non_tensor, meta


def _tokens_and_masks(
    batch: TensorDictBase,
) -> tuple[torch.Tensor, Any, torch.Tensor, Any, torch.Tensor, int]:
    """``input_ids``, the attention mask as given and as bool, the response mask as given
    (``None`` when absent) and as bool [B, R], and the prompt length P: each checked against
    verl's format (``responses`` and ``prompts`` the slices of ``input_ids``)."""
    ids = batch.get("input_ids", None)
    if not isinstance(ids, torch.Tensor) or ids.ndim != 2 or ids.dtype != torch.int64:
        said = f"{list(ids.shape)} {ids.dtype}" if isinstance(ids, torch.Tensor) else "no such key"
        raise VerlFormatError(f"'input_ids': expected int64 [B, T] token ids, found {said}")
    b, t = ids.shape
    attn_raw = batch.get("attention_mask", None)
    attn = _mask(attn_raw, "attention_mask", (b, t))
    responses = batch.get("responses", None)
    if (
        not isinstance(responses, torch.Tensor)
        or responses.ndim != 2
        or responses.shape[0] != b
        or responses.shape[1] > t
    ):
        found = list(responses.shape) if isinstance(responses, torch.Tensor) else "no such key"
        raise VerlFormatError(f"'responses': expected [B, R] with R <= {t}, found {found}")
    r = responses.shape[1]
    p = t - r
    if not torch.equal(responses, ids[:, p:]):
        raise VerlFormatError(f"'responses': expected input_ids[:, {p}:] (the last R tokens)")
    prompts = batch.get("prompts", None)
    if prompts is not None and not (
        isinstance(prompts, torch.Tensor) and torch.equal(prompts, ids[:, :p])
    ):
        raise VerlFormatError(f"'prompts': expected input_ids[:, :{p}] (the first T - R tokens)")
    resp_raw = batch.get("response_mask", None)
    resp = attn[:, p:] if resp_raw is None else _mask(resp_raw, "response_mask", (b, r))
    if (resp & ~attn[:, p:]).any():
        rows = sorted(set((resp & ~attn[:, p:]).nonzero()[:, 0].tolist()))
        raise VerlFormatError(
            f"'response_mask': rows {rows[:10]} mark tokens attention_mask does not"
        )
    return ids, attn_raw, attn, resp_raw, resp, p


def _batch_values(
    batch: TensorDictBase, layout: Layout, btp: tuple[int, int, int], out: dict[Any, Any]
) -> None:
    """Into ``out``: the mapped response-aligned values as [B, T] layout fields, the reward,
    and every other batch tensor under ``("verl", key)`` (``btp``: B, T and the prompt
    length P)."""
    k = layout.key
    b, t, p = btp
    r = t - p
    for key, v in batch.items():
        if key in _DERIVED:
            continue
        field = _RESPONSE_FIELDS.get(key)
        if field is None:
            out[(VERL_KEY, key)] = v
            continue
        v = _response_value(v, key, (b, r))
        full = torch.zeros(b, t, dtype=v.dtype, device=v.device)
        full[:, p:] = v
        out[k(field)] = full
    rewards = batch.get("token_level_rewards", None)
    if rewards is not None:
        out[k("reward")] = _response_value(rewards, "token_level_rewards", (b, r)).sum(-1).float()


def _non_tensor_values(
    batch: TensorDictBase, non_tensor: dict[str, Any], b: int, out: dict[Any, Any]
) -> dict[str, str]:
    """Into ``out``: each ``non_tensor_batch`` array under ``("verl", key)`` as a
    ``NonTensorStack``; returns each array's numpy dtype (``"object"`` for objects)."""
    clash = sorted(
        {*batch.keys(), *non_tensor} & {"meta_info", "format"} | set(batch.keys()) & set(non_tensor)
    )
    if clash:
        raise VerlFormatError(
            f"{clash[0]!r}: expected a key other than 'meta_info'/'format' and not both a batch "
            "and a non_tensor_batch key (both would live at ('verl', key))"
        )
    kinds: dict[str, str] = {}
    for key, arr in non_tensor.items():
        if not isinstance(arr, np.ndarray) or arr.ndim == 0 or arr.shape[0] != b:
            shape = list(arr.shape) if isinstance(arr, np.ndarray) else type(arr).__name__
            raise VerlFormatError(
                f"non_tensor_batch[{key!r}]: expected a numpy array with {b} rows, found {shape}"
            )
        if arr.dtype == object and arr.ndim != 1:
            raise VerlFormatError(
                f"non_tensor_batch[{key!r}]: expected a 1-D object array, found {list(arr.shape)}"
            )
        kinds[key] = arr.dtype.str if arr.dtype != object else "object"
        out[(VERL_KEY, key)] = NonTensorStack(*(NonTensorData(x) for x in arr), batch_size=[b])
    return kinds


def _dtype(name: str) -> torch.dtype:
    dtype = getattr(torch, name.removeprefix("torch."), None)
    if not isinstance(dtype, torch.dtype):
        raise VerlFormatError(f"{FORMAT_KEY!r}: unknown dtype {name!r}")
    return dtype


def _numpy(items: list[Any], kind: str) -> np.ndarray:
    if kind != "object":
        return np.asarray(items, dtype=np.dtype(kind))
    # Element by element: np.array(list of equal-length lists, dtype=object) would add a dim.
    arr = np.empty(len(items), dtype=object)
    for i, x in enumerate(items):
        arr[i] = x
    return arr


def _place(
    td: TensorDictBase, layout: Layout, pad_token_id: int
) -> tuple[dict[str, torch.Tensor], torch.Tensor, torch.Tensor, torch.Tensor, int]:
    """A layout batch's rows in verl's shape: prompt left-padded to P, response right-padded.

    A row's response starts at its first assistant token (its whole attended part is prompt
    when it has none) and runs to its last attended token; gaps in the attention mask close.
    Returns the token and mask tensors, each kept position's row and column in the layout and
    its column in the response [B, R] (-1: a prompt token), and P.
    """
    k = layout.key
    ids = td.get(k("tokens"))
    attn = td.get(k("attention_mask"))
    asst = td.get(k("assistant_mask")) & attn
    b, t = ids.shape
    pos = torch.arange(t, device=ids.device).expand(b, t)
    start = torch.where(asst, pos, t).min(-1, keepdim=True).values
    in_prompt = attn & (pos < start)
    in_resp = attn & (pos >= start)
    lp, lr = in_prompt.sum(-1), in_resp.sum(-1)
    p, r = int(lp.max()) if b else 0, int(lr.max()) if b else 0
    # Destination column: prompts end at column P (left padding), responses start there.
    dest = torch.where(
        in_prompt, p - lp[:, None] + in_prompt.cumsum(-1) - 1, p + in_resp.cumsum(-1) - 1
    )
    rows, cols = (in_prompt | in_resp).nonzero(as_tuple=True)
    where = dest[rows, cols]
    out_ids = torch.full((b, p + r), pad_token_id, dtype=ids.dtype, device=ids.device)
    out_ids[rows, where] = ids[rows, cols]
    out_attn = torch.zeros(b, p + r, dtype=torch.int64, device=ids.device)
    out_attn[rows, where] = 1
    out_resp = torch.zeros(b, p + r, dtype=torch.int64, device=ids.device)
    out_resp[rows, where] = asst[rows, cols].to(torch.int64)
    tensors = {
        "prompts": out_ids[:, :p],
        "responses": out_ids[:, p:],
        "input_ids": out_ids,
        "attention_mask": out_attn,
        # verl's compute_position_id_with_mask: left padding shares position 0.
        "position_ids": (out_attn.cumsum(-1) - 1).clamp(min=0),
        "response_mask": out_resp[:, p:],
    }
    return tensors, rows, cols, where - p, p


def from_layout(
    td: TensorDictBase, *, pad_token_id: int = 0, layout: Layout = LLM_LAYOUT_V1
) -> Any:
    """An LLM-layout batch as a verl ``DataProto`` (verl imported here).

    A batch :func:`to_layout` made (it holds ``("verl", "format")``) comes back as the
    ``DataProto`` it was: the same batch keys in the same order, dtypes and values, the same
    ``non_tensor_batch`` arrays (dtype included) and ``meta_info``; layout fields read from
    the layout (so an edited advantage travels), the rest from ``("verl", ...)``.

    Any other batch (dense, left/right padded, or ragged) is laid out as verl's rollout lays
    it out: each row's prompt (attended tokens before its first assistant token)
    left-padded with ``pad_token_id`` to P, its response (from there to its last attended
    token) right-padded to R; ``attention_mask``/``response_mask`` int64, ``position_ids``
    as verl computes them from the mask; ``sample_log_probs``, ``ref_log_probs`` and the
    advantage ([B] expanded) become ``old_log_probs``, ``ref_log_prob`` and ``advantages``,
    0 off ``response_mask`` (NaN there would survive verl's masking multiply); the reward
    becomes ``token_level_rewards`` on the last response token, as verl's reward managers
    place it; ``group_id`` becomes ``non_tensor_batch["uid"]`` (its decimal string).
    Fields with no verl twin (``policy_version``) are left out.

    ``td`` is checked against ``layout`` first (a ``ContractViolation`` names the key);
    anything but a TensorDict, or a reward / group id that disagrees with the verl values
    kept beside it, raises :class:`VerlFormatError`.

    Example:
        >>> from posttrain.testing import llm_batch
        >>> proto = from_layout(llm_batch(2, 8))
        >>> proto.batch["input_ids"].shape[1] == proto.batch["prompts"].shape[1] + proto.batch["responses"].shape[1]
        True
        >>> from_layout(to_layout(proto)).batch.keys() == proto.batch.keys()
        True
    """
    if not isinstance(td, TensorDictBase):
        raise VerlFormatError(
            f"td: expected an LLM-layout TensorDict, found {type(td).__name__} "
            "(a DataProto goes the other way, through to_layout)"
        )
    layout.validate_batch(
        td, ragged=isinstance(td, LazyStackedTensorDict), any_float=True,
        context="verl from_layout",
    )  # fmt: skip
    fmt = td.get(FORMAT_KEY, None) if not isinstance(td, LazyStackedTensorDict) else None
    if isinstance(fmt, NonTensorData):
        fmt = fmt.data
    if isinstance(fmt, dict):
        return _from_verl_layout(td, fmt, layout)
    if isinstance(td, LazyStackedTensorDict):
        td = to_padded(td, pad_token_id=pad_token_id, layout=layout)
    if td.batch_dims != 1:
        td = td.reshape(-1)
    return _from_any_layout(td, layout, pad_token_id)


def _from_any_layout(td: TensorDictBase, layout: Layout, pad_token_id: int) -> Any:
    """The way to verl for a dense layout batch :func:`to_layout` did not make: laid out as
    verl's rollout lays it out (:func:`_place`), the mapped values response-aligned."""
    k = layout.key
    tensors, rows, cols, rcol, p = _place(td, layout, pad_token_id)
    resp = tensors["response_mask"].bool()
    b, r = resp.shape
    kept = rcol >= 0
    rrows, rcols, rdest = rows[kept], cols[kept], rcol[kept]

    def response_values(v: torch.Tensor) -> torch.Tensor:
        out = torch.zeros(b, r, dtype=v.dtype, device=v.device)
        out[rrows, rdest] = v[rrows, rcols]
        return torch.where(resp, out, torch.zeros_like(out))

    for name, key in (("sample_log_probs", "old_log_probs"), ("ref_log_probs", "ref_log_prob")):
        v = td.get(k(name), None)
        if v is not None:
            tensors[key] = response_values(v)
    adv = td.get(k("advantage"), None)
    if adv is not None:
        tensors["advantages"] = (
            adv[:, None].to(torch.float32) * resp if adv.ndim == 1 else response_values(adv)
        )
    reward = td.get(k("reward"), None)
    if reward is not None:
        last = tensors["attention_mask"][:, p:].sum(-1) - 1
        scores = torch.zeros(b, r, dtype=torch.float32, device=reward.device)
        has = last >= 0
        scores[has.nonzero(as_tuple=True)[0], last[has]] = reward[has].to(torch.float32)
        tensors["token_level_rewards"] = scores
    non_tensor: dict[str, np.ndarray] = {}
    gid = td.get(k("group_id"), None)
    if gid is not None:
        non_tensor["uid"] = _numpy([str(int(g)) for g in gid.tolist()], "object")
    return _data_proto().from_dict(tensors=tensors, non_tensors=non_tensor, meta_info={})


def _from_verl_layout(td: TensorDictBase, fmt: dict[str, Any], layout: Layout) -> Any:
    """The way back for a batch :func:`to_layout` made (``fmt``: its format record)."""
    if td.batch_dims != 1:
        td = td.reshape(-1)
    k = layout.key
    p = int(fmt["prompt_length"])
    ids = td.get(k("tokens"))
    attn = td.get(k("attention_mask"))
    asst = td.get(k("assistant_mask"))
    derived: dict[str, torch.Tensor] = {
        "input_ids": ids,
        "attention_mask": attn.to(_dtype(fmt["attention_mask"])),
        "prompts": ids[:, :p],
        "responses": ids[:, p:],
        "response_mask": (asst & attn)[:, p:].to(_dtype(fmt["response_mask"] or "int64")),
    }
    verl = td.get(VERL_KEY)
    mapped: dict[str, torch.Tensor] = {}
    for key, name in _RESPONSE_FIELDS.items():
        v = td.get(k(name), None)
        if v is None:
            continue
        if v.ndim == 1:  # a [B] advantage set on the layout side
            v = v[:, None].to(torch.float32) * derived["response_mask"].to(torch.float32)
            mapped[key] = v
        else:
            mapped[key] = v[:, p:]
    reward = td.get(k("reward"), None)
    kept_rewards = verl.get("token_level_rewards", None)
    if (
        reward is not None
        and isinstance(kept_rewards, torch.Tensor)
        and not torch.allclose(kept_rewards.sum(-1).float(), reward.float())
    ):
        raise VerlFormatError(
            f"{k('reward')!r}: expected the sum of ('verl', 'token_level_rewards') over the "
            "response, found other values (set one of them, not both)"
        )
    tensors: dict[str, torch.Tensor] = {}
    order = [*fmt["batch_keys"], *(key for key in mapped if key not in fmt["batch_keys"])]
    for key in order:
        if key in mapped:
            tensors[key] = mapped[key]
        elif key in derived:
            tensors[key] = derived[key]
        elif key in _RESPONSE_FIELDS:
            continue  # the layout field was removed
        else:
            kept = verl.get(key, None)
            if kept is None:
                raise VerlFormatError(
                    f"{(VERL_KEY, key)!r}: expected the verl batch key to_layout kept, found none"
                )
            tensors[key] = kept
    non_tensor = {
        key: _numpy(list(verl.get(key).tolist()), kind) for key, kind in fmt["non_tensor"].items()
    }
    gid = td.get(k("group_id"), None)
    if (
        gid is not None
        and "uid" in non_tensor
        and not torch.equal(_group_ids(non_tensor["uid"]), _group_ids(gid.numpy()))
    ):
        raise VerlFormatError(
            f"{k('group_id')!r}: expected the groups of ('verl', 'uid'), found other groups "
            "(regroup one of them, not both)"
        )
    meta = td.get((VERL_KEY, "meta_info"))
    meta = meta.data if isinstance(meta, NonTensorData) else meta
    return _data_proto().from_dict(tensors=tensors, non_tensors=non_tensor, meta_info=dict(meta))
