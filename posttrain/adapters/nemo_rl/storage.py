"""NeMo-RL's async replay buffer interface over any ``ReplayBufferV1`` (the storage on-ramp).

NeMo-RL's ``ReplayBufferImpl`` (``nemo_rl/algorithms/async_utils/replay_buffer.py``, commit
7ea279a; the ``async_utils`` package since v0.7, a single module with ``push_with_wait_signal``
since v0.4) holds one entry per prompt group: the trajectory, the weight version that
generated it and the weight version it is meant to train. :class:`NemoReplayBuffer` keeps that
bookkeeping and stores the data in a posttrain/TorchRL buffer in the LLM layout, so a NeMo-RL
loop can move its storage onto TorchRL (memmap, shared memory, a Ray-served buffer) unchanged.
"""

from __future__ import annotations

import operator
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any, Protocol, TypeVar

import torch

from posttrain._args import positive_int
from posttrain.adapters.nemo_rl.train_data import batched_data_dict, from_layout, to_layout
from posttrain.contracts.layout import LLM_LAYOUT_V1, Layout
from posttrain.errors import PosttrainError


@dataclass
class _Entry:
    indices: list[int]
    offset: int  # items this facade had written before this entry
    width: int  # the group's S
    version: int
    target: int
    extras: dict[str, Any] = field(default_factory=dict)


class NemoReplayBuffer:
    """``add`` / ``sample`` / ``size`` / ``clear`` / ``state_dict`` as NeMo-RL's async buffer.

    ``buffer`` is any ``ReplayBufferV1`` with the ``read`` capability (posttrain's
    ``RingBuffer``; TorchRL's behind ``ValidatedReplayBuffer``, ragged storage when groups
    differ in length). ``trajectory["batch"]`` is NeMo-RL train data of one prompt group
    (``input_ids``, ``input_lengths``, masks, log-probs, advantages ...); it is stored as
    LLM-layout items and given back bit-exactly, dtypes included; the trajectory's other keys
    (``rollout_metrics``, ``timestamp``) stay here. ``capacity`` is the backing buffer's
    capacity in items: an ``add`` whose FIFO write would overwrite an entry not yet sampled
    answers ``"full"``, as one beyond ``max_size`` entries does, and changes nothing; a group
    of more rows than ``capacity`` can never fit and raises ``ValueError``. ``capacity``
    defaults to the buffer's own (``RingBuffer.capacity``; ``rb.storage.max_size`` of a
    TorchRL buffer behind ``ValidatedReplayBuffer``). Where neither says, an ``add`` that the
    buffer wrote over rows of unsampled entries raises ``RuntimeError`` and drops those
    entries (their rows are gone), so ``sample`` never hands back another group's rows.

    Sampling follows NeMo-RL: entries generated before ``current - max_age_steps`` are
    dropped; ``None`` unless at least ``num_prompt_groups`` entries are valid and meant for
    the current version (``target == current``); else the oldest such entries leave the
    buffer, returned as ``{"trajectories": [...], "avg_trajectory_age": float}``.
    ``num_prompt_groups`` < 1 or ``max_age_steps`` < 0 raises ``ValueError`` and drops nothing.

    Example:
        >>> from posttrain.reference_impls import RingBuffer
        >>> from posttrain.adapters.nemo_rl.train_data import from_layout
        >>> from posttrain.testing import llm_batch
        >>> nemo = NemoReplayBuffer(RingBuffer(16), max_size=4, capacity=16)
        >>> group = dict(from_layout(llm_batch(2, 6)))
        >>> nemo.add({"batch": group, "timestamp": 0.0}, weight_version=0, target_weight_version=1)
        'success'
        >>> nemo.sample(1, current_weight_version=0, max_age_steps=1) is None  # meant for 1
        True
        >>> out = nemo.sample(1, current_weight_version=1, max_age_steps=1)
        >>> torch.equal(out["trajectories"][0]["batch"]["input_ids"], group["input_ids"])
        True
    """

    def __init__(
        self,
        buffer: Any,
        max_size: int,
        *,
        capacity: int | None = None,
        layout: Layout = LLM_LAYOUT_V1,
    ) -> None:
        if max_size <= 0:
            raise ValueError(f"max_size: expected > 0, found {max_size}")
        if not callable(getattr(buffer, "read", None)):
            raise TypeError(
                f"buffer: expected a ReplayBufferV1 with read(indices) (capability 'read'), "
                f"found {type(buffer).__name__} without it; wrap a TorchRL buffer in "
                "posttrain.adapters.torchrl.ValidatedReplayBuffer"
            )
        known = _capacity_of(buffer)
        if capacity is not None:
            capacity = positive_int("capacity", capacity)
        if capacity is not None and known is not None and capacity > known:
            raise ValueError(
                f"capacity: expected at most the buffer's capacity {known}, found {capacity}"
            )
        self.buffer = buffer
        self.max_size = max_size
        self.capacity = known if capacity is None else capacity
        self.layout = layout
        self._entries: list[_Entry] = []
        self._written = 0
        self.last_target_weight_already_generated = -1

    def add(
        self, trajectory: dict[str, Any], weight_version: int, target_weight_version: int
    ) -> str:
        """Store one prompt group; ``"success"``, or ``"full"`` with nothing changed.

        A group of more rows than ``capacity`` raises ``ValueError`` (nothing changed), even
        at ``max_size`` entries: no amount of sampling makes room, and NeMo-RL's producer
        would wait on ``"full"`` forever.
        """
        if "batch" not in trajectory:
            raise KeyError(f"trajectory: expected a 'batch' key; found {sorted(trajectory)}")
        td = to_layout(trajectory["batch"], layout=self.layout)
        n = int(td.batch_size[0])
        if self.capacity is not None and n > self.capacity:
            raise ValueError(
                f"trajectory['batch']: expected a prompt group of at most {self.capacity} rows "
                f"(the buffer's capacity), found {n} rows; it can never fit, nothing stored"
            )
        if len(self._entries) >= self.max_size:
            return "full"
        if self.capacity is not None:
            oldest = min((e.offset for e in self._entries), default=self._written)
            if self._written + n - oldest > self.capacity:
                return "full"
        offset = self._written
        # extend raises on a schema mismatch: nothing recorded then.
        indices = [int(i) for i in self.buffer.extend(td).tolist()]
        self._written += n
        # Without a known capacity nothing stopped the write from landing on rows of entries
        # not sampled yet (or, longer than the buffer, on its own first rows): those rows now
        # hold this group, so those entries can only be dropped, never handed back.
        # With the capacity known, the check above already kept the write off their rows.
        hit = set(indices)
        lost = (
            [e for e in self._entries if hit.intersection(e.indices)]
            if self.capacity is None
            else []
        )
        if lost or len(hit) < n:
            gone = {id(e) for e in lost}
            self._entries = [e for e in self._entries if id(e) not in gone]
            raise RuntimeError(
                f"add: {type(self.buffer).__name__} wrote this group's {n} items at storage "
                f"indices {indices}, over rows of {len(lost)} unsampled entries (weight "
                f"versions {[e.version for e in lost]}, targets {[e.target for e in lost]})"
                + ("" if len(hit) == n else " and over its own first items")
                + "; those entries are dropped and this group is not stored. Pass capacity= "
                "(the buffer's capacity in items) so that add answers 'full' instead"
            )
        self._entries.append(
            _Entry(
                indices=indices,
                offset=offset,
                width=int(td.get(self.layout.key("tokens")).shape[1]),
                version=int(weight_version),
                target=int(target_weight_version),
                extras={k: v for k, v in trajectory.items() if k != "batch"},
            )
        )
        return "success"

    def sample(
        self, num_prompt_groups: int, current_weight_version: int, max_age_steps: int
    ) -> dict[str, Any] | None:
        """NeMo-RL's staleness rules; the chosen entries leave the buffer."""
        # Checked before the staleness pass drops anything. NeMo-RL checks neither: 0 ends in
        # a ZeroDivisionError, -1 takes all intended groups but the last.
        if _int(num_prompt_groups, "num_prompt_groups") < 1:
            raise ValueError(f"num_prompt_groups: expected >= 1, found {num_prompt_groups}")
        if _int(max_age_steps, "max_age_steps") < 0:
            raise ValueError(f"max_age_steps: expected >= 0, found {max_age_steps}")
        left, chosen = take_for_step(
            self._entries, num_prompt_groups, current_weight_version, max_age_steps
        )
        if chosen is None:
            self._entries = left
            return None
        # One read and one codec call for every chosen group; groups are row slices.
        rows = self.buffer.read(torch.tensor([i for e in chosen for i in e.indices]))
        data = dict(from_layout(rows, layout=self.layout))
        trajectories = []
        start = 0
        for e in chosen:
            stop = start + len(e.indices)
            wide = data["input_ids"].shape[1]  # the widest chosen group: cut back to this one's
            batch = {
                k: v[start:stop, : e.width] if v.ndim == 2 and v.shape[1] == wide else v[start:stop]
                for k, v in data.items()
            }
            trajectories.append({"batch": batched_data_dict(batch), **e.extras})
            start = stop
        self._entries = left  # only once the read succeeded: a failed read changes nothing
        self.last_target_weight_already_generated = max(
            self.last_target_weight_already_generated, current_weight_version
        )
        return {
            "trajectories": trajectories,
            "avg_trajectory_age": mean_age(chosen, current_weight_version),
        }

    def size(self) -> int:
        """Entries (prompt groups) held."""
        return len(self._entries)

    def clear(self) -> None:
        """Forget every entry (``last_target_weight_already_generated`` stays, as in NeMo-RL)."""
        self._entries = []

    def state_dict(self) -> dict[str, Any]:
        """NeMo-RL's keys (``trajectories`` as storage indices) plus the backing buffer's state."""
        return {
            "trajectories": [
                {"indices": e.indices, "offset": e.offset, "width": e.width, "extras": e.extras}
                for e in self._entries
            ],
            "trajectory_versions": [e.version for e in self._entries],
            "target_weight_versions": [e.target for e in self._entries],
            "last_target_weight_already_generated": self.last_target_weight_already_generated,
            "max_size": self.max_size,
            "written": self._written,
            "buffer": self.buffer.state_dict(),
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restore :meth:`state_dict`'s output (lists must agree in length).

        Every key is checked before anything is assigned or the backing buffer's state is
        loaded (that comes last): entries' storage indices distinct, within the capacity and
        owned by one entry each, their offsets within the items written, no more entries than
        ``max_size``. A bad state raises ``ValueError`` (also a ``KeyError`` for a missing key
        and a ``TypeError`` for a wrong type) naming the key, what was expected and what was
        found, and leaves this buffer as it was; so does a backing buffer's refusal, and a
        backing state holding fewer items than the entries point at (its previous state is
        put back).
        """
        if not isinstance(state, Mapping):
            raise _StateTypeError(f"state: expected a dict, found {type(state).__name__}")
        keys = ("trajectories", "trajectory_versions", "target_weight_versions")
        missing = [k for k in (*keys, "buffer") if k not in state]
        if missing:
            raise _StateKeyError(f"state: missing {missing}; found {sorted(state)}")
        extra = sorted(str(k) for k in state if k not in _STATE_KEYS)
        if extra:
            raise ValueError(f"state: expected only keys {list(_STATE_KEYS)}, found extra {extra}")
        for k in keys:
            if not isinstance(state[k], list | tuple):
                raise _StateTypeError(
                    f"state[{k!r}]: expected a list, found {type(state[k]).__name__}"
                )
        lengths = {k: len(state[k]) for k in keys}
        if len(set(lengths.values())) != 1:
            raise ValueError(f"state: lists differ in length: {lengths}")
        entries = [
            _entry(t, v, g, n)
            for n, (t, v, g) in enumerate(zip(*(state[k] for k in keys), strict=True))
        ]
        written = _int(state.get("written", 0), "state['written']")
        last = _int(
            state.get("last_target_weight_already_generated", -1),
            "state['last_target_weight_already_generated']",
        )
        max_size = _int(state.get("max_size", self.max_size), "state['max_size']")
        if max_size <= 0:
            raise ValueError(f"state['max_size']: expected > 0, found {max_size}")
        if len(entries) > max_size:
            raise ValueError(
                f"state['trajectories']: expected at most max_size={max_size} entries, "
                f"found {len(entries)}"
            )
        self._check_entries(entries, written)
        before = self.buffer.state_dict()
        self.buffer.load_state_dict(state["buffer"])  # last: if it raises, nothing here changed
        top = max((i for e in entries for i in e.indices), default=-1)
        if top >= len(self.buffer):
            self.buffer.load_state_dict(before)
            raise ValueError(
                f"state['trajectories']: expected storage indices below the backing state's "
                f"len {len(self.buffer)}, found {top} (the previous backing state was put back)"
            )
        self._entries = entries
        self._written = written
        self.last_target_weight_already_generated = last
        self.max_size = max_size

    def _check_entries(self, entries: list[_Entry], written: int) -> None:
        if written < 0:
            raise ValueError(f"state['written']: expected >= 0, found {written}")
        owner: dict[int, int] = {}
        for n, e in enumerate(entries):
            where = f"state['trajectories'][{n}]"
            if not e.indices or len(set(e.indices)) != len(e.indices):
                raise ValueError(
                    f"{where}['indices']: expected distinct storage indices, found {e.indices}"
                )
            hi = self.capacity
            out = [i for i in e.indices if i < 0 or (hi is not None and i >= hi)]
            if out:
                span = f"[0, {hi})" if hi is not None else ">= 0"
                raise ValueError(f"{where}['indices']: expected indices in {span}, found {out}")
            shared = sorted(i for i in e.indices if i in owner)
            if shared:
                raise ValueError(
                    f"{where}['indices']: expected rows of its own, found {shared} also held by "
                    f"entry {owner[shared[0]]}"
                )
            owner.update(dict.fromkeys(e.indices, n))
            if e.width < 1:
                raise ValueError(f"{where}['width']: expected >= 1, found {e.width}")
            if not 0 <= e.offset <= written - len(e.indices):
                raise ValueError(
                    f"{where}['offset']: expected in [0, written - {len(e.indices)} = "
                    f"{written - len(e.indices)}], found {e.offset}"
                )
            if self.capacity is not None and written - e.offset > self.capacity:
                raise ValueError(
                    f"{where}['offset']: expected >= written - capacity = "
                    f"{written - self.capacity} (older rows were overwritten), found {e.offset}"
                )


_E = TypeVar("_E", bound="_Versioned")


class _Versioned(Protocol):
    version: int
    target: int


def take_for_step(
    entries: list[_E], n: int, current: int, max_age_steps: int
) -> tuple[list[_E], list[_E] | None]:
    """NeMo-RL's sampling rule for one training step: ``(entries left, entries taken)``.

    An entry generated with weights ``version`` for step ``target`` is too old once
    ``version < max(0, current - max_age_steps)``: it is dropped whatever the answer. The
    step takes its ``n`` earliest entries with ``target == current`` and ``version <=
    current``, or none at all (``None``: the trainer stalls until the rest arrive).

    Example:
        >>> from types import SimpleNamespace as E
        >>> held = [E(version=0, target=2), E(version=1, target=2), E(version=2, target=3)]
        >>> left, taken = take_for_step(held, 1, current=2, max_age_steps=1)
        >>> [(e.version, e.target) for e in left], [(e.version, e.target) for e in taken]
        ([(2, 3)], [(1, 2)])
    """
    floor = max(0, current - max_age_steps)
    alive = [e for e in entries if e.version >= floor]
    for_step = [e for e in alive if e.target == current and e.version <= current]
    if len(for_step) < n:
        return alive, None
    taken = {id(e) for e in for_step[:n]}
    return [e for e in alive if id(e) not in taken], for_step[:n]


def mean_age(taken: list[_E], current: int) -> float:
    """``avg_trajectory_age``: ``current`` less the mean generating version (as a float).

    Example:
        >>> from types import SimpleNamespace as E
        >>> mean_age([E(version=1), E(version=2), E(version=2)], 3)
        1.3333333333333333
    """
    return current - sum(e.version for e in taken) / len(taken)


class _StateKeyError(PosttrainError, KeyError, ValueError):
    """A saved state without a key it must have: a ``ValueError`` as every refusal, and the
    ``KeyError`` it always was."""

    def __str__(self) -> str:
        return str(self.args[0]) if self.args else ""


class _StateTypeError(PosttrainError, TypeError, ValueError):
    """A saved state's field of the wrong type: a ``ValueError`` and a ``TypeError``."""


_ENTRY_KEYS = ("indices", "offset", "width", "extras")
_STATE_KEYS = (
    "trajectories",
    "trajectory_versions",
    "target_weight_versions",
    "last_target_weight_already_generated",
    "max_size",
    "written",
    "buffer",
)


def _entry(t: Any, version: Any, target: Any, n: int) -> _Entry:
    """Entry ``n`` of a saved state, every field checked."""
    where = f"state['trajectories'][{n}]"
    if not isinstance(t, Mapping):
        raise _StateTypeError(
            f"{where}: expected a dict with keys {list(_ENTRY_KEYS)}, found {t!r}"
        )
    absent = [k for k in _ENTRY_KEYS if k not in t]
    if absent:
        raise _StateKeyError(f"{where}: missing {absent}; found {sorted(t)}")
    if not isinstance(t["indices"], list | tuple):
        raise _StateTypeError(
            f"{where}['indices']: expected a list of ints, found {t['indices']!r}"
        )
    if not isinstance(t["extras"], Mapping):
        raise _StateTypeError(f"{where}['extras']: expected a dict, found {t['extras']!r}")
    return _Entry(
        [_int(i, f"{where}['indices'][{j}]") for j, i in enumerate(t["indices"])],
        _int(t["offset"], f"{where}['offset']"),
        _int(t["width"], f"{where}['width']"),
        _int(version, f"state['trajectory_versions'][{n}]"),
        _int(target, f"state['target_weight_versions'][{n}]"),
        dict(t["extras"]),
    )


def _int(value: Any, where: str) -> int:
    """``value`` as an int; ``TypeError`` naming ``where`` for anything else (bool included)."""
    try:
        if isinstance(value, bool):
            raise TypeError
        return operator.index(value)
    except TypeError:
        raise _StateTypeError(f"{where}: expected an int, found {value!r}") from None


def _capacity_of(buffer: Any) -> int | None:
    """The buffer's capacity in items where it tells: ``capacity``, or TorchRL's storage size."""
    storage = getattr(getattr(buffer, "rb", None), "storage", None)
    for value in (getattr(buffer, "capacity", None), getattr(storage, "max_size", None)):
        if isinstance(value, int) and not isinstance(value, bool) and value > 0:
            return value
    return None
