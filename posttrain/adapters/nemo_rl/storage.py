"""NeMo-RL's async replay buffer interface over any ``ReplayBufferV1`` (the storage on-ramp).

NeMo-RL's ``ReplayBufferImpl`` (``nemo_rl/algorithms/async_utils/replay_buffer.py``, commit
7ea279a; the ``async_utils`` package since v0.7, a single module with ``push_with_wait_signal``
since v0.4) holds one entry per prompt group: the trajectory, the weight version that
generated it and the weight version it is meant to train. :class:`NemoReplayBuffer` keeps that
bookkeeping and stores the data in a posttrain/TorchRL buffer in the LLM layout, so a NeMo-RL
loop can move its storage onto TorchRL (memmap, shared memory, a Ray-served buffer) unchanged.

Checkpoints (:meth:`NemoReplayBuffer.save_to_path` / :meth:`~NemoReplayBuffer.load_from_path`)
are posttrain checkpoint directories (``posttrain._checkpoint``): one file of tensors and
plain data, sealed by a manifest of its size and SHA-256 and verified before anything is read.
"""

from __future__ import annotations

import operator
import os
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any, Protocol, TypeVar

import torch

from posttrain._args import positive_int
from posttrain._checkpoint import CheckpointError, load_verified, save_state
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
    keys: list[str] | None = None  # the batch's keys as added, in order (None: every key)


STATE_FILE = "nemo_replay_buffer.pt"
"""The one file of a :meth:`NemoReplayBuffer.save_to_path` checkpoint directory."""

CHECKPOINT_FORMAT = "posttrain-nemo-replay-buffer/1"
"""Written into that file; a file of another format is refused by name."""


class NemoReplayBuffer:
    """``add`` / ``sample`` / ``size`` / ``clear`` / ``state_dict`` as NeMo-RL's async buffer.

    ``buffer`` is any ``ReplayBufferV1`` with the ``read`` capability (posttrain's
    ``RingBuffer``; TorchRL's behind ``ValidatedReplayBuffer``, ragged storage when groups
    differ in length). ``trajectory["batch"]`` is NeMo-RL train data of one prompt group
    (``input_ids``, ``input_lengths``, masks, log-probs, advantages ...); it is stored as
    LLM-layout items and given back bit-exactly: the same keys in the same order, dtypes, and
    every value, NaN and infinite log-probs included; the trajectory's other keys
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
        self._ring = known  # the backing ring's size, where it tells (>= capacity)
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
                keys=[str(k) for k in _batch_keys(trajectory["batch"])],
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
        # The stored values as they were added: from_layout's NaN -> 0 is for TorchRL's NaN
        # padding, which data that came in through to_layout does not have.
        data = dict(from_layout(rows, layout=self.layout, nan_to_zero=False))
        trajectories = []
        start = 0
        for e in chosen:
            stop = start + len(e.indices)
            wide = data["input_ids"].shape[1]  # the widest chosen group: cut back to this one's
            batch = {
                k: v[start:stop, : e.width] if v.ndim == 2 and v.shape[1] == wide else v[start:stop]
                for k, v in data.items()
                if e.keys is None or k in e.keys
            }
            if e.keys is not None:  # the keys as added, in that order (no derived extras)
                absent = [k for k in e.keys if k not in batch]
                if absent:  # only a loaded state can say so; nothing has changed yet
                    raise ValueError(
                        f"sample: the entry of weight version {e.version} lists keys {absent} "
                        f"that its stored rows do not hold (found {sorted(batch)})"
                    )
                batch = {k: batch[k] for k in e.keys}
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
                {
                    "indices": e.indices,
                    "offset": e.offset,
                    "width": e.width,
                    "extras": e.extras,
                    "keys": e.keys,
                }
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
        owned by one entry each, their offsets within the items written and in the order they
        were written, no more entries than ``max_size``; where the backing ring's size is
        known, each entry's indices must be the ring positions its offset gives (the same
        shift for every entry), so indices swapped between entries or offsets that do not
        match their rows are refused rather than sampled as another group's items. A bad state raises ``ValueError`` (also a ``KeyError`` for a missing key
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

    def save_to_path(self, path: str | os.PathLike[str]) -> int:
        """Write this buffer to the checkpoint directory ``path``; return the entries held.

        One file, ``nemo_replay_buffer.pt`` (:meth:`state_dict`, the backing buffer's state
        included, each entry's extras encoded without pickle), sealed by a manifest of its
        size and SHA-256 and swapped in whole: a crash or an error leaves the previous
        checkpoint at ``path`` or the new one. Any failure raises ``CheckpointError`` saying
        what happened, the OS error chained; extras the codec cannot encode are refused here,
        not at load.

        Example:
            >>> import tempfile
            >>> from pathlib import Path
            >>> from posttrain.reference_impls import RingBuffer
            >>> from posttrain.testing import llm_batch
            >>> nemo = NemoReplayBuffer(RingBuffer(8), max_size=2)
            >>> group = dict(from_layout(llm_batch(2, 6)))
            >>> nemo.add({"batch": group, "timestamp": 1.5}, 0, 1)
            'success'
            >>> path = Path(tempfile.mkdtemp()) / "replay_buffer"
            >>> nemo.save_to_path(path)
            1
            >>> copy = NemoReplayBuffer(RingBuffer(8), max_size=2)
            >>> copy.load_from_path(path), copy.sample(1, 1, 1)["trajectories"][0]["timestamp"]
            ({'num_trajectories': 1}, 1.5)
        """
        from posttrain.adapters.nemo_rl.async_buffer import PayloadError, encode_payload

        state = self.state_dict()
        try:
            for t in state["trajectories"]:
                t["extras"] = encode_payload(t["extras"])
        except PayloadError as e:
            raise CheckpointError(f"{path}: nothing written: {e}") from e
        try:
            save_state(path, STATE_FILE, {"format": CHECKPOINT_FORMAT, "state": state})
        except CheckpointError:
            raise
        except OSError as e:
            raise CheckpointError(
                f"{path}: the replay buffer checkpoint could not be written ({_os_error(e)}); "
                "what was there before is unchanged"
            ) from e
        return len(state["trajectories"])

    def load_from_path(self, path: str | os.PathLike[str]) -> dict[str, int]:
        """Restore what :meth:`save_to_path` wrote, or refuse it with this buffer unchanged.

        The manifest is verified before anything is read (a missing, extra, truncated or
        altered file is refused by name), the file is read with ``weights_only=True`` and the
        state checked whole by :meth:`load_state_dict`. Every refusal is a ``CheckpointError``
        (a ``ValueError``) saying why, the OS error chained where there was one. Returns
        ``{"num_trajectories": n}``.
        """
        from posttrain.adapters.nemo_rl.async_buffer import PayloadError, decode_payload

        raw = _load_checkpoint(path, STATE_FILE)
        if not isinstance(raw, Mapping) or raw.get("format") != CHECKPOINT_FORMAT:
            found = raw.get("format") if isinstance(raw, Mapping) else type(raw).__name__
            raise CheckpointError(
                f"{path}: {STATE_FILE}: expected format {CHECKPOINT_FORMAT!r}, found {found!r}"
            )
        state = raw.get("state")
        try:
            if not isinstance(state, Mapping) or not isinstance(
                state.get("trajectories"), list | tuple
            ):
                raise ValueError(
                    f"expected a state with a 'trajectories' list, found {state!r:.100}"
                )
            trajectories = []
            for n, t in enumerate(state["trajectories"]):
                if not isinstance(t, Mapping) or not isinstance(t.get("extras"), torch.Tensor):
                    raise ValueError(
                        f"state['trajectories'][{n}]['extras']: expected an encoded payload, "
                        f"found {t!r:.100}"
                    )
                extras = decode_payload(t["extras"])
                if not isinstance(extras, dict):
                    raise ValueError(
                        f"state['trajectories'][{n}]['extras']: expected a dict, found "
                        f"{type(extras).__name__}"
                    )
                trajectories.append({**t, "extras": extras})
            self.load_state_dict({**state, "trajectories": trajectories})
        except (ValueError, TypeError, KeyError, PayloadError) as e:
            raise CheckpointError(f"{path}: {e} (buffer unchanged)") from e
        return {"num_trajectories": len(trajectories)}

    def _check_entries(self, entries: list[_Entry], written: int) -> None:
        if written < 0:
            raise ValueError(f"state['written']: expected >= 0, found {written}")
        owner: dict[int, int] = {}
        # With the ring's size known, add writes FIFO: an entry's rows are the ring positions
        # after its offset, shifted by one constant (where the ring stood when this facade
        # began). Rows that break that are another entry's (swapped indices) or nobody's.
        shift: tuple[int, int] | None = None
        end = 0  # where the previous entry's items ended, in items written
        for n, e in enumerate(entries):
            where = f"state['trajectories'][{n}]"
            if e.offset < end:
                raise ValueError(
                    f"{where}['offset']: expected >= {end} (entries are held in the order they "
                    f"were written, each after the previous one's {len(entries[n - 1].indices)} "
                    f"items), found {e.offset}"
                )
            end = e.offset + len(e.indices)
            if not e.indices or len(set(e.indices)) != len(e.indices):
                raise ValueError(
                    f"{where}['indices']: expected distinct storage indices, found {e.indices}"
                )
            hi = self._ring if self._ring is not None else self.capacity
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
            if self._ring is not None:
                cap = self._ring
                if shift is None:
                    shift = (n, (e.indices[0] - e.offset) % cap)
                want = [(e.offset + shift[1] + j) % cap for j in range(len(e.indices))]
                if e.indices != want:
                    raise ValueError(
                        f"{where}['indices']: expected {want} (the ring positions of items "
                        f"{e.offset}..{e.offset + len(e.indices) - 1} written, as entry "
                        f"{shift[0]}'s offset and indices place them), found {e.indices}"
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
    keys = t.get("keys")
    if keys is not None and (
        not isinstance(keys, list | tuple)
        or not keys
        or not all(isinstance(k, str) for k in keys)
        or len(set(keys)) != len(keys)
        or "input_ids" not in keys
    ):
        raise _StateTypeError(
            f"{where}['keys']: expected None or distinct key names including 'input_ids', "
            f"found {keys!r:.200}"
        )
    return _Entry(
        [_int(i, f"{where}['indices'][{j}]") for j, i in enumerate(t["indices"])],
        _int(t["offset"], f"{where}['offset']"),
        _int(t["width"], f"{where}['width']"),
        _int(version, f"state['trajectory_versions'][{n}]"),
        _int(target, f"state['target_weight_versions'][{n}]"),
        dict(t["extras"]),
        None if keys is None else list(keys),
    )


def _batch_keys(batch: Any) -> list[Any]:
    """The keys of a dict or of a ``BatchedDataDict`` (a ``UserDict``), in order."""
    inner = getattr(batch, "data", None)
    return list((inner if isinstance(inner, dict) else batch).keys())


def _os_error(e: OSError) -> str:
    """An OS error in words: ``'No space left on device'`` rather than its repr."""
    return e.strerror or str(e) or type(e).__name__


def _load_checkpoint(path: str | os.PathLike[str], name: str) -> Any:
    """``load_verified(path, name)``, every failure a ``CheckpointError`` with the OS error
    chained (a missing path, a file where a directory should be, an unreadable file)."""
    if os.path.isfile(path):
        raise CheckpointError(
            f"{path}: a file, not a checkpoint directory (posttrain writes replay buffer "
            "checkpoints as a directory with a manifest; a file written by another version "
            "or by NeMo-RL's own save_to_path is not read, as it could run code)"
        )
    try:
        return load_verified(path, name)
    except CheckpointError:
        raise
    except FileNotFoundError as e:
        raise CheckpointError(f"{path}: no checkpoint directory there") from e
    except OSError as e:
        raise CheckpointError(f"{path}: could not be read ({_os_error(e)})") from e


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
