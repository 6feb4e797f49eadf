"""Deterministic LLM-layout batches: what the suites feed implementations, for your own tests.

Every item carries a unique id in token 0, so a sample can be traced back to its write.
"""

from __future__ import annotations

import torch
from tensordict import LazyStackedTensorDict, TensorDict, TensorDictBase

from posttrain.contracts.layout import LLM_LAYOUT_V1, Layout

PROMPT_LEN = 3
"""The prompt length of every item :func:`llm_batch` builds: its response starts at this position.

Example:
    >>> llm_batch(1).get(("masks", "all_assistant_mask"))[0, :PROMPT_LEN].any().item()
    False
"""
_UID = ("tokens", "full")


def llm_batch(
    n: int,
    t: int = 8,
    *,
    uid_start: int = 0,
    seed: int = 0,
    vocab_size: int | None = None,
    layout: Layout = LLM_LAYOUT_V1,
) -> TensorDict:
    """``n`` items in the LLM layout with T=``t``; item i has uid ``uid_start + i`` in token 0.

    With ``vocab_size`` every token is a valid id below it instead (no uid: for model inputs).

    Prompt of ``PROMPT_LEN`` tokens, a response of random length, right padding; every field of
    the layout is present, log-probs are NaN outside the assistant mask (as TorchRL writes).

    Example:
        >>> td = llm_batch(3, uid_start=10)
        >>> item_uids(td)
        [10, 11, 12]
    """
    g = torch.Generator().manual_seed(seed * 1_000_003 + uid_start)
    tokens = torch.randint(0, vocab_size or 1000, (n, t), generator=g)
    if vocab_size is None:
        tokens[:, 0] = torch.arange(uid_start, uid_start + n)
    lengths = torch.randint(PROMPT_LEN + 1, t + 1, (n,), generator=g)
    pos = torch.arange(t).expand(n, t)
    attn = pos < lengths[:, None]
    asst = attn & (pos >= PROMPT_LEN)
    lp = torch.where(asst, -torch.rand(n, t, generator=g), float("nan"))
    k = layout.key
    return TensorDict(
        {
            k("tokens"): tokens,
            k("attention_mask"): attn,
            k("assistant_mask"): asst,
            k("sample_log_probs"): lp,
            k("ref_log_probs"): lp - 0.25,
            k("advantage"): torch.randn(n, generator=g),
            k("reward"): torch.rand(n, generator=g),
            k("policy_version"): torch.full((n,), 7, dtype=torch.int64),
            k("group_id"): torch.arange(uid_start, uid_start + n) // 2,
        },
        batch_size=[n],
    )


def ragged_llm_batch(
    lengths: list[int], *, uid_start: int = 0, seed: int = 0
) -> LazyStackedTensorDict:
    """A lazy stack of single items whose T differ (the ragged form).

    Example:
        >>> td = ragged_llm_batch([5, 7])
        >>> [x.get(("tokens", "full")).shape[-1] for x in td.tensordicts]
        [5, 7]
    """
    items: list[TensorDictBase] = [
        llm_batch(1, t, uid_start=uid_start + i, seed=seed)[0] for i, t in enumerate(lengths)
    ]
    return LazyStackedTensorDict.lazy_stack(items, 0)


def item_uids(td: TensorDictBase) -> list[int]:
    """The uids of the items of a batch (token 0 of each item), padded or a ragged lazy stack.

    Example:
        >>> item_uids(llm_batch(3, uid_start=5)), item_uids(ragged_llm_batch([4, 6], uid_start=7))
        ([5, 6, 7], [7, 8])
    """
    if isinstance(td, LazyStackedTensorDict):
        return [int(x.get(_UID)[0]) for x in td.tensordicts]
    return [int(u) for u in td.get(_UID)[..., 0].reshape(-1).tolist()]
