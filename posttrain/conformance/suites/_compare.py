"""Bit-exact comparisons of TensorDict items, shared by the suites."""

from __future__ import annotations

from collections.abc import Iterable

import torch
from tensordict import LazyStackedTensorDict, TensorDictBase

from posttrain.conformance.context import ConformanceError
from posttrain.contracts.keys import key_str, norm_key
from posttrain.testing import item_uids


def leaves(td: TensorDictBase) -> dict[tuple[str, ...], torch.Tensor]:
    """Leaf tensors by normalised key."""
    return {norm_key(k): td.get(k) for k in td.keys(include_nested=True, leaves_only=True)}


def bits_equal(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Same dtype, shape and bytes (NaN payloads included)."""
    if a.dtype != b.dtype or a.shape != b.shape:
        return False
    a, b = a.detach().cpu().reshape(-1), b.detach().cpu().reshape(-1)
    if a.dtype == torch.bool:
        return torch.equal(a, b)
    return torch.equal(a.contiguous().view(torch.uint8), b.contiguous().view(torch.uint8))


def id_list(ids: Iterable[int], limit: int = 10) -> str:
    """``ids`` as a list for a message, cut after ``limit`` entries ("... and N more").

    Example:
        >>> id_list(range(3)), id_list(range(14))
        ('[0, 1, 2]', '[0, 1, 2, 3, 4, 5, 6, 7, 8, 9, ... and 4 more]')
    """
    xs = list(ids)
    if len(xs) <= limit:
        return str(xs)
    return "[" + ", ".join(map(str, xs[:limit])) + f", ... and {len(xs) - limit} more]"


def _items(td: TensorDictBase) -> list[TensorDictBase]:
    if isinstance(td, LazyStackedTensorDict):
        return list(td.tensordicts)
    return [td[i] for i in range(td.batch_size[0])]


class Table:
    """What was written, by uid: the model a buffer's samples are checked against.

    Example:
        >>> from posttrain.testing import llm_batch
        >>> t = Table()
        >>> t.add(llm_batch(2))
        >>> t.check_sample(llm_batch(2)[1:], allowed={0, 1})
        [1]
    """

    def __init__(self) -> None:
        self.items: dict[int, TensorDictBase] = {}

    def add(self, td: TensorDictBase) -> None:
        """Remember every item of ``td`` (a copy) by its uid."""
        for uid, item in zip(item_uids(td), _items(td), strict=True):
            self.items[uid] = item.clone()

    def check_sample(self, sample: TensorDictBase, allowed: set[int]) -> list[int]:
        """Assert every item of ``sample`` is bit-exactly a written item whose uid is allowed."""
        uids = item_uids(sample)
        for uid, item in zip(uids, _items(sample), strict=True):
            if uid not in allowed:
                state = (
                    "was never written" if uid not in self.items else "was evicted or is not stored"
                )
                raise ConformanceError(
                    f"sampled item with uid {uid} {state}; stored uids: {id_list(sorted(allowed))}"
                )
            want = leaves(self.items[uid])
            got = leaves(item)
            for k, v in want.items():
                if k not in got:
                    raise ConformanceError(f"sampled item {uid} lacks key {key_str(k)}")
                if not bits_equal(got[k], v):
                    raise ConformanceError(
                        f"sampled item {uid}, key {key_str(k)}: expected {v.dtype} {list(v.shape)} "
                        f"{_short(v)}, found {got[k].dtype} {list(got[k].shape)} {_short(got[k])}"
                    )
        return uids


def _short(t: torch.Tensor) -> str:
    flat = t.detach().cpu().reshape(-1)
    s = flat[:6].tolist()
    return f"{s}{'...' if flat.numel() > 6 else ''}"
