"""Round-three blind one-bug replay buffers, written from ``specs/buffer-v1.md`` alone.

Each variant subclasses a correct design of :mod:`tests.independent.buffers`
(:class:`ListFifoBuffer` or :class:`KeyedArrayBuffer`) and changes one thing. Its docstring
names the bug, a system that shipped a bug of that kind (or says it is plausible), and the
requirement sentence it breaks; ``DEMOS[name]()`` shows the bug with plain code against that
sentence (True when the bug shows). Run by tests/conformance/independent/test_variants_by_contract.py.

Measured (``run_for(VARIANTS[v], BREAKS[v])``, depth 1; filled in below after the run):

| variant | breaks | outcome | base on that id |
|---|---|---|---|
| reserve_before_check | BUF-011 | caught (FAIL) | PASS |
| numpy_priority_state | BUF-014 | caught (FAIL) | PASS |
| unique_sorted_priority | BUF-017 | caught (FAIL) | PASS |
| age_order_read | BUF-022 | caught (FAIL) | PASS |
| dotted_file_checkpoint | BUF-018 | caught (FAIL) | PASS |
| recounted_cursor | BUF-014 | caught (FAIL) | PASS |

Messages:

- reserve_before_check: BUF-011: extend with key ('log_probs', 'full') as float64 instead of
  float32: the next extend wrote at [1, 2, 3, 4]; an untouched buffer writes at [6, 7, 0, 1]
  smallest failing input: Failing explicit example: test( value=(('log_probs', 'full'),
  torch.float64,
- numpy_priority_state: BUF-014: state_dict() holds objects that torch.load(weights_only=True)
  refuses (only tensors and plain data load without running code): it holds an instance of
  numpy._core.multiarray._reconstruct (see specs/buffer-v1.md#BUF-014)
- unique_sorted_priority: BUF-017: priorities 10 and 1 for uids 5600005 and 5600006 at indices 5
  and 6, 0 for the other 6 stored items, by the indices extend returned: 2000 draws drew zero-
  priority uids [5600004, 5600009] (2000 times) (see specs/buffer-v1.md#BUF-017)
- age_order_read: BUF-022: read([0, 5, 3, 1, 6, 4, 2, 7]) returned uids [7000003, 7000008,
  7000006, 7000004, 7000009, 7000007, 7000005, 7000010], expected [7000008, 7000005, 7000003,
  7000009, 7000006, 7000004, 7000010, 7000007] (the latest write per index) (see
  specs/buffer-v1.
- dotted_file_checkpoint: BUF-018: dumps/loads of items with keys ['a.b', ('a', 'b'),
  'next.reward', 'tokens.full', ('next', 'ref_log_probs.full'), ('x', 'y', 'z'), 'x.y.z', ...]
  beside the layout's: restoring raised RuntimeError: The expanded size of the tensor (8) must
  match the existing size (3) at non-singleton dimension 1. ... (see specs/buffer-v1.md#BUF-018)
- recounted_cursor: BUF-014: state_dict/load_state_dict: the restored buffer's next extend wrote
  at [0, 1, 2]; the original writes at [3, 4, 5] (see specs/buffer-v1.md#BUF-014)

Missed, and what the domain does not try: none since buffer 1.6. Under 1.5 the kit missed
dotted_file_checkpoint: BUF-018 round-tripped buffers of the LLM layout's keys (and BUF-001's),
none of which holds the '.' separator, so no two keys' joined file names collided; 1.6 adds
key sets whose names joined with '.' are one another's.

Example:
    >>> sorted(VARIANTS)[0]
    'age_order_read'
"""

from __future__ import annotations

import contextlib
import tempfile
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import torch
from tensordict import TensorDict, TensorDictBase

from posttrain.contracts import Implementation
from tests.independent.buffers import (
    KeyedArrayBuffer,
    ListFifoBuffer,
    _count,
    _leaves,
    _read_indices,
    _rows,
)

__all__ = ["BREAKS", "DEMOS", "VARIANTS"]


def _td(values: list[int], dtype: torch.dtype = torch.int64) -> TensorDict:
    return TensorDict({"x": torch.tensor(values, dtype=dtype)}, batch_size=[len(values)])


class ReserveBeforeCheckBuffer(KeyedArrayBuffer):
    """BUG: ``extend`` reserves its slots first (advances the write position, the fetch-add
    of a lock-free ring) and validates the batch afterwards, so a batch refused for a wrong
    dtype has already moved the write position: contents and len are intact, but the next
    valid write lands one batch further on and overwrites a newer item than the oldest.
    Plausible (exception safety: state changed before the check that refuses the call).

    Breaks BUF-011 ("extend with a wrong dtype MUST raise an error naming the key ... and
    MUST leave the buffer unchanged").
    """

    def extend(self, data: TensorDictBase, /) -> torch.Tensor:
        """Reserve the slots, then check and write."""
        n = _rows(data)
        leaves = _leaves(data)
        if self._schema is None or n == 0:
            return super().extend(data)
        idx = (self._cursor + torch.arange(n)) % self.capacity
        self._cursor = (self._cursor + n) % self.capacity  # reserved before the check
        self._validate(leaves)
        m = min(n, self.capacity)
        dst = idx[n - m :]
        self._write(leaves, dst, n - m)
        self._fresh[dst] = True
        self._size = min(self.capacity, self._size + n)
        return idx


def demo_reserve_before_check() -> bool:
    """A refused float write moves the next valid write's slot."""

    def next_slot(rb: KeyedArrayBuffer) -> int:
        rb.extend(_td([1, 2]))
        with contextlib.suppress(TypeError):
            rb.extend(_td([3], torch.float32))
        return int(rb.extend(_td([4]))[0])

    return next_slot(ReserveBeforeCheckBuffer(4)) != next_slot(KeyedArrayBuffer(4))


class NumpyPriorityStateBuffer(ListFifoBuffer):
    """BUG: ``state_dict`` keeps the priorities as the NumPy array a vectorised sum tree
    holds (``np.asarray(self._prio)``), so the state no longer loads with
    ``torch.load(weights_only=True)`` (NumPy's ``_reconstruct`` is not an allowed global).
    The class of huggingface/transformers#40500 ("torch.load fails to load RNG state in
    PyTorch 2.6+ due to weights_only=True"): NumPy objects in a checkpoint.

    Breaks BUF-014 ("the state MUST survive torch.save and torch.load(weights_only=True)").
    """

    def state_dict(self) -> dict[str, Any]:
        """The base state with the priorities as a NumPy array."""
        sd = super().state_dict()
        sd["prio"] = np.asarray(sd["prio"], dtype=np.float64)
        return sd

    def load_state_dict(self, state_dict: dict[str, Any], /) -> None:
        """Accept the priorities as a NumPy array or a list."""
        sd = dict(state_dict)
        sd["prio"] = [float(p) for p in np.asarray(sd["prio"]).tolist()]
        super().load_state_dict(sd)


def demo_numpy_priority_state() -> bool:
    """The state does not survive torch.save + torch.load(weights_only=True)."""
    rb = NumpyPriorityStateBuffer(4)
    rb.extend(_td([1, 2, 3]))
    with tempfile.TemporaryDirectory() as d:
        f = Path(d) / "s.pt"
        torch.save(rb.state_dict(), f)
        try:
            torch.load(f, weights_only=True)
        except Exception:
            return True
    return False


class UniqueSortedPriorityBuffer(ListFifoBuffer):
    """BUG: ``update_priority`` deduplicates the indices with ``torch.unique`` (to avoid
    ambiguous repeated writes), which also *sorts* them, then pairs them with the priorities
    in the caller's order: any index tensor not already sorted (the indices a wrapped extend
    returned, a shuffled minibatch) gets its priorities permuted. Plausible (``torch.unique``
    sorts by default; ``sorted=False`` is ignored on CPU for most dtypes).

    Breaks BUF-017 ("an item with zero priority MUST NOT be drawn while items with positive
    priority remain").
    """

    def update_priority(self, index: Any, priority: Any, /) -> None:
        """Deduplicate the indices, then set the priorities."""
        idx = torch.unique(torch.as_tensor(index).reshape(-1))
        super().update_priority(idx, priority)


def demo_unique_sorted_priority() -> bool:
    """The item given priority 0 keeps being drawn."""
    rb = UniqueSortedPriorityBuffer(3)
    rb.extend(_td([10, 11, 12]))
    rb.update_priority(torch.tensor([2, 0, 1]), torch.tensor([0.0, 1.0, 1.0]))
    return 12 in rb.sample(200)["x"].tolist()


class AgeOrderReadBuffer(ListFifoBuffer):
    """BUG: ``read`` indexes the items by age (index 0 = oldest stored, as a deque-backed
    buffer does), while ``extend`` returns storage slots: the two agree until the ring
    wraps, and after it ``read(extend(batch))`` returns other items. Plausible.

    Breaks BUF-022 ("read(indices) MUST return, in the order asked, bit-exactly the item the
    latest write put at each index").
    """

    def read(self, indices: torch.Tensor, /) -> Any:
        """The items at positions ``indices`` counted from the oldest."""
        with self._lock:
            size = len(self._slots)
            idx = _read_indices(indices, size)
            if not idx and not self._slots:
                return TensorDict({}, batch_size=[0])
            start = self._cursor if size == self.capacity else 0
            return self._stack([(start + i) % size for i in idx])


def demo_age_order_read() -> bool:
    """After a wrap, read(extend(batch)) is not the batch."""
    rb = AgeOrderReadBuffer(3)
    rb.extend(_td([1, 2, 3]))
    idx = rb.extend(_td([4]))
    return bool(rb.read(idx)["x"].tolist() != [4])


class DottedFileCheckpointBuffer(KeyedArrayBuffer):
    """BUG: ``dumps`` writes one file per column, named by joining the nested key with dots
    (``"next.reward.pt"``), so two keys whose joined names agree (``("a.b",)`` and
    ``("a", "b")``) write the same file: the second overwrites the first and ``loads``
    restores one column's values under both keys. Plausible: flattening nested keys to
    ``"."``-joined names is how TensorDict's ``flatten_keys`` and many checkpoint writers
    name them, and it is not injective when a key already holds the separator.

    Breaks BUF-018 ("loads(path) into a fresh buffer after dumps(path) MUST reproduce
    contents and write position bit-exactly").
    """

    @staticmethod
    def _file(d: Path, k: tuple[str, ...]) -> Path:
        return d / (".".join(k) + ".pt")

    def dumps(self, path: Any, /) -> None:
        """Write the counters and one file per column under ``path``."""
        d = Path(path)
        d.mkdir(parents=True, exist_ok=True)
        sd = self.state_dict()
        cols = sd.pop("cols")
        sd["keys"] = [list(k) for k in cols]
        torch.save(sd, d / "meta.pt")
        for k, col in cols.items():
            torch.save(col, self._file(d, k))

    def loads(self, path: Any, /) -> None:
        """Read the counters and the column files back."""
        d = Path(path)
        sd = torch.load(d / "meta.pt", weights_only=True)
        keys = [tuple(k) for k in sd.pop("keys")]
        sd["cols"] = {k: torch.load(self._file(d, k), weights_only=True) for k in keys}
        self.load_state_dict(sd)


def demo_dotted_file_checkpoint() -> bool:
    """A buffer with keys ('a.b',) and ('a', 'b') does not round-trip through dumps/loads."""
    td = TensorDict({"a.b": torch.tensor([1, 2]), "a": {"b": torch.tensor([7, 8])}}, [2])
    rb = DottedFileCheckpointBuffer(4)
    rb.extend(td)
    with tempfile.TemporaryDirectory() as d:
        rb.dumps(d)
        fresh = DottedFileCheckpointBuffer(4)
        fresh.loads(d)
    return bool(fresh.read(torch.tensor([0, 1]))["a.b"].tolist() != [1, 2])


class RecountedCursorBuffer(KeyedArrayBuffer):
    """BUG: ``load_state_dict`` recomputes the write position from the item count
    (``size % capacity``, "writing resumes after the stored items") instead of restoring
    it: right for a buffer that never wrapped, wrong after a wrap (a full buffer resumes at
    slot 0 and overwrites a newer item than the oldest). Plausible (derived state rebuilt
    from another field on resume).

    Breaks BUF-014 ("load_state_dict(state_dict()) ... MUST reproduce contents and write
    position bit-exactly ..., so the next extend writes where the original would have").
    """

    def load_state_dict(self, state_dict: dict[str, Any], /) -> None:
        """Restore the items; the write position follows from their count."""
        super().load_state_dict(state_dict)
        self._cursor = self._size % self.capacity


def demo_recounted_cursor() -> bool:
    """After a wrap, the restored buffer's next write goes to another slot."""
    rb = RecountedCursorBuffer(3)
    rb.extend(_td([1, 2, 3, 4]))
    fresh = RecountedCursorBuffer(3)
    fresh.load_state_dict(rb.state_dict())
    return bool(fresh.extend(_td([5])).tolist() != rb.extend(_td([5])).tolist())


_LIST_CAPS = {"priority", "thread_safe", "read"}
_KEYED_CAPS = {"checkpoint", "read"}
_KEYED_OPTS = {"sampling": "without_replacement"}


def _list(cls: type[ListFifoBuffer]) -> Implementation:
    return Implementation(
        "buffer",
        lambda capacity: cls(_count(capacity, "capacity")),
        name=f"r3.{cls.__name__}",
        capabilities=_LIST_CAPS,
    )


def _keyed(cls: type[KeyedArrayBuffer]) -> Implementation:
    return Implementation(
        "buffer",
        lambda capacity: cls(_count(capacity, "capacity")),
        name=f"r3.{cls.__name__}",
        capabilities=_KEYED_CAPS,
        options=_KEYED_OPTS,
    )


VARIANTS: dict[str, Implementation] = {
    "reserve_before_check": _keyed(ReserveBeforeCheckBuffer),
    "numpy_priority_state": _list(NumpyPriorityStateBuffer),
    "unique_sorted_priority": _list(UniqueSortedPriorityBuffer),
    "age_order_read": _list(AgeOrderReadBuffer),
    "dotted_file_checkpoint": _keyed(DottedFileCheckpointBuffer),
    "recounted_cursor": _keyed(RecountedCursorBuffer),
}

BREAKS: dict[str, str] = {
    "reserve_before_check": "BUF-011",
    "numpy_priority_state": "BUF-014",
    "unique_sorted_priority": "BUF-017",
    "age_order_read": "BUF-022",
    "dotted_file_checkpoint": "BUF-018",
    "recounted_cursor": "BUF-014",
}

DEMOS: dict[str, Callable[[], bool]] = {
    "reserve_before_check": demo_reserve_before_check,
    "numpy_priority_state": demo_numpy_priority_state,
    "unique_sorted_priority": demo_unique_sorted_priority,
    "age_order_read": demo_age_order_read,
    "dotted_file_checkpoint": demo_dotted_file_checkpoint,
    "recounted_cursor": demo_recounted_cursor,
}

# The correct design each variant subclasses, for the base check on the same id.
BASES: dict[str, Implementation] = {
    "reserve_before_check": _keyed(KeyedArrayBuffer),
    "numpy_priority_state": _list(ListFifoBuffer),
    "unique_sorted_priority": _list(ListFifoBuffer),
    "age_order_read": _list(ListFifoBuffer),
    "dotted_file_checkpoint": _keyed(KeyedArrayBuffer),
    "recounted_cursor": _keyed(KeyedArrayBuffer),
}


# What the kit misses of these variants (strict xfails in tests/conformance/independent/test_variants_by_contract.py):
# an entry goes once the kit fails the variant on the requirement it breaks.
KIT_DEFECTS: dict[str, str] = {}

# Variants the kit fails under another requirement (a foundation that blocks theirs).
OTHER_ID: dict[str, str] = {}
