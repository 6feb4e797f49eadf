"""The buffer suite's run: a buffer under test beside the FIFO model of the uids it must hold.

Every check of the buffer suite (``buffer``) and its random call sequences (``_buffer_model``)
writes through a :class:`Run`, so each item carries a fresh uid and each sample is compared
bit-exactly with what was written.
"""

from __future__ import annotations

import itertools
from typing import Any

import torch
from tensordict import TensorDictBase

from posttrain.conformance.context import ConformanceError, Context
from posttrain.conformance.suites._compare import Table, id_list
from posttrain.conformance.suites._fail import fail as _fail
from posttrain.testing import item_uids, llm_batch

CAP = 8
T = 8
UID_BASES = itertools.count(1)

# Keys beside the LLM layout's, from the key names the contract allows (non-empty, no '/' or
# NUL): names whose parts joined with '.' (or '_') are one another's, or a layout key's
# (('next', 'reward'), ('tokens', 'full')), dots at any depth, spaces, dashes, non-ASCII
# letters. A buffer that files keys under joined names stores two of them in one place.
KEY_SETS: tuple[tuple[tuple[str, ...], ...], ...] = (
    (),
    (("a.b",), ("a", "b")),
    (("next.reward",), ("tokens.full",), ("next", "ref_log_probs.full")),
    (("x", "y", "z"), ("x.y.z",), ("x.y", "z"), ("x", "y.z")),
    (
        ("a_b",),
        ("a", "b"),
        ("clé",),
        ("键",),
        ("ключ", "значение"),
        ("with space",),
        ("dash-name",),
    ),
)
ALL_KEYS: tuple[tuple[str, ...], ...] = tuple(dict.fromkeys(k for ks in KEY_SETS for k in ks))
"""Every key of :data:`KEY_SETS` at once (a layout holding all of them)."""


def keys_for(req: str) -> tuple[tuple[tuple[str, ...], ...], ...]:
    """The key sets ``req``'s domain tries: :data:`KEY_SETS`, less those with a name holding
    '.' for BUF-014 (a state dict joins nested names with '.', as ``nn.Module``'s and
    ``TensorDict.state_dict`` do: out of its scope in v1).

    Example:
        >>> len(keys_for("BUF-018")) - len(keys_for("BUF-014"))
        3
    """
    if req != "BUF-014":
        return KEY_SETS
    return tuple(ks for ks in KEY_SETS if not any("." in name for k in ks for name in k))


def with_keys(td: TensorDictBase, keys: tuple[tuple[str, ...], ...]) -> TensorDictBase:
    """``td`` with a leaf under each of ``keys``, distinct per key and per item.

    Alternately int64 [N] and float32 [N, 3], so keys that meet in one place differ in value
    (and shape), whichever one a buffer keeps.

    Example:
        >>> from posttrain.testing import llm_batch
        >>> td = with_keys(llm_batch(2), (("a.b",), ("a", "b")))
        >>> td["a.b"].tolist(), td["a", "b"].shape
        ([0, 2], torch.Size([2, 3]))
    """
    if not keys:
        return td
    uids = torch.as_tensor(item_uids(td), dtype=torch.int64)
    out = td.clone(recurse=False)
    for k, key in enumerate(keys):
        if k % 2 == 0:
            out.set(key, uids * len(keys) + k)
        else:
            out.set(key, (uids[:, None] * 3 + torch.arange(3)).float() + k / 64)
    return out


class Run:
    """A buffer under test plus the model of what it should hold (FIFO of uids)."""

    def __init__(
        self, ctx: Context, capacity: int = CAP, keys: tuple[tuple[str, ...], ...] = ()
    ) -> None:
        self.ctx = ctx
        self.capacity = capacity
        self.keys = keys  # beside the layout's, in every item (see KEY_SETS)
        self.rb: Any = ctx.make(capacity)
        self.table = Table()
        self.fifo: list[int] = []
        # Fresh uids per run: a buffer's unwritten memory may hold another run's rows, which
        # must never pass for this run's items.
        self.next_uid = next(UID_BASES) * 100_000

    def batch(self, n: int, t: int = T) -> TensorDictBase:
        td = llm_batch(n, t, uid_start=self.next_uid, seed=self.ctx.seed)
        self.next_uid += n
        return with_keys(td, self.keys)

    def write(self, n: int) -> torch.Tensor:
        return self.put(self.batch(n))

    def put(self, td: TensorDictBase) -> torch.Tensor:
        idx: torch.Tensor = self.rb.extend(td)
        self.table.add(td)
        self.fifo = (self.fifo + item_uids(td))[-self.capacity :]
        return idx

    def stored(self) -> set[int]:
        """The uids the buffer holds, found by sampling (and each sample checked bit-exactly).

        Draws ``sample(len)`` at least 10 and at most 60 times, until every expected item showed
        up: never more than ``len`` at once, so only BUF-007 depends on drawing beyond ``len``.
        """
        n = len(self.rb)
        if n == 0:
            return set()
        seen: set[int] = set()
        allowed, want = set(self.table.items), set(self.fifo)
        for draw in range(60):
            seen.update(self.table.check_sample(self.rb.sample(n), allowed))
            if draw >= 9 and seen >= want:  # at least 10 draws, so stray rows get their chance
                break
        return seen

    def expect_stored(self, what: str, *, complete: bool = True) -> None:
        """Sampling finds exactly the model's items; with ``complete=False`` only none other
        (that sampling reaches every stored item is BUF-007's and BUF-016's to say)."""
        try:
            got = self.stored()
        except ConformanceError as e:
            raise _fail(f"{what}: {e}") from None
        want = set(self.fifo)
        if got != want and (complete or not got <= want):
            raise _fail(
                f"{what}: buffer holds uids {id_list(sorted(got))}, expected "
                f"{id_list(sorted(want))} (missing {id_list(sorted(want - got))}, unexpected "
                f"{id_list(sorted(got - want))})"
            )

    def holds_fifo(self) -> bool:
        """Whether sampling finds exactly the FIFO model's items (uids only, never raising).

        Lets a check tell its own requirement's failure from a wrong eviction order, which
        BUF-003 reports: anything unexpected, an exception included, answers False.
        """
        want, seen = set(self.fifo), set()
        try:
            for _ in range(60):
                seen.update(item_uids(self.rb.sample(len(want))))
                if seen >= want:
                    break
        except Exception:  # a sample the kit cannot read is not this check's to report
            return False
        return seen == want


def indices(idx: Any, n: int, what: str) -> list[int]:
    if not isinstance(idx, torch.Tensor):
        raise _fail(f"{what}: extend returned {type(idx).__name__}, expected a 1-D integer tensor")
    if idx.dtype.is_floating_point or idx.dtype == torch.bool or idx.dtype.is_complex:
        raise _fail(
            f"{what}: extend returned indices of dtype {idx.dtype}, expected an integer dtype"
        )
    if idx.ndim != 1 or idx.shape[0] != n:
        raise _fail(f"{what}: extend returned indices of shape {list(idx.shape)}, expected [{n}]")
    return [int(i) for i in idx.tolist()]


def scribble(td: TensorDictBase) -> None:
    """Overwrite every tensor of ``td`` in place (uids included), as a caller reusing it would.

    Through ``apply_``, which reaches the tensors a lazy stack holds (a stacked view of them
    would be a copy, and filling it would reach nothing)."""
    td.apply_(lambda v: v.fill_(True if v.dtype == torch.bool else 99))


def short_err(e: BaseException) -> str:
    from posttrain.conformance.runner import remote_cause  # a Ray error: the actor's own error

    cause = remote_cause(e)
    return f"{type(cause).__name__}: {str(cause)[:200]}"
