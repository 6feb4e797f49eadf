"""NeMo-RL's async GRPO replay buffer, method for method, over any posttrain ``ReplayBufferV1``.

NeMo-RL's trajectory collector (``nemo_rl/algorithms/async_utils/trajectory_collector.py:
AsyncTrajectoryCollector._enqueue_rollout_group``, commit 7ea279a) pushes one prompt group at
a time with ``replay_buffer.add.remote(trajectory_group, generation_weight_version,
target_weight_version)``, where ``trajectory_group`` is ``{"batch": <the rollout's
BatchedDataDict on CPU: message_log, length, loss_multiplier, idx, extra_env_info,
total_reward, ...>, "rollout_metrics": {...}, "timestamp": float}`` plus ``"_ng_task_index"``
under NeMo Gym. ``async_grpo_train`` (``nemo_rl/algorithms/grpo.py``) then calls ``size``,
``has_complete_batch``, ``get_trajectories_needed``, ``sample`` and, around checkpoints,
``save_to_path`` / ``load_from_path``. :class:`NemoAsyncReplayBuffer` answers every one of
them as ``nemo_rl/algorithms/async_utils/replay_buffer.py:ReplayBufferImpl`` does, with the
same restore options (``num_prompts_per_step``, ``current_training_step``, ``max_age_steps``,
``drop_incomplete_targets_on_restore``), and keeps the data in a posttrain buffer.

Storage: each pushed group is encoded without pickle by :func:`encode_payload` (a JSON tree
plus raw tensor bytes, dtypes and shapes kept bit-exactly) and written to the backing buffer
as fixed-width chunks, one item per chunk, so any ``ReplayBufferV1`` with ``read``
holds it: posttrain's ``RingBuffer``, a TorchRL buffer behind ``ValidatedReplayBuffer``, or
either served from a Ray actor. ``sample`` hands back the group as it was pushed (``batch``
as ``nemo_rl``'s ``BatchedDataDict`` where it imports, else posttrain's mirror).

Full policy (explicit, never a silent drop): ``add`` answers ``"full"`` with nothing changed
when ``max_size`` entries are held (NeMo-RL's rule) or when the backing buffer's capacity
has no room for the group's chunks beside the live ones (a bound NeMo-RL's in-memory list
does not have); the collector then retries, as it does on NeMo-RL's ``"full"``. A FIFO
backing buffer's write position is advanced past live chunks by rewriting them in place, so
groups consumed out of order never lose rows; when the free items are fragmented so that no
run of the group's size lies within one turn of the ring, every live group is rewritten back
to back first (compaction), so a group that fits in the free items is never refused.

Checkpoints: ``save_to_path`` writes a posttrain checkpoint directory at ``path``
(``posttrain._checkpoint``): one file of plain tensors, lists and ints, sealed by a manifest
of its size and SHA-256 and swapped in whole (a crash leaves the previous checkpoint or the
new one). ``load_from_path`` verifies the manifest before anything is read, reads the file
with ``weights_only=True`` (NeMo-RL's own load unpickles a file, which can run code) and
checks the whole state before the buffer changes. Every failed save or load raises
``CheckpointError`` saying what happened, the OS error chained.
"""

from __future__ import annotations

import operator
import os
import threading
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

import torch
from tensordict import TensorDict

from posttrain._checkpoint import CheckpointError, load_verified, save_state
from posttrain.adapters.nemo_rl.mirror.replay_buffer import (
    NEMO_GYM_TASK_INDEX_KEY,
    NEXT_NEMO_GYM_TASK_INDEX_KEY,
    Row,
    mean_age,
    restore_plan,
    take_for_step,
    valid_for_target,
)
from posttrain.adapters.nemo_rl.payload import (
    PAYLOAD_FORMAT,
    decode_payload,
    encode_payload,
    prepare_payload,
)
from posttrain.adapters.nemo_rl.train_data import NemoFormatError, check_train_data
from posttrain.adapters.nemo_rl.upstream import nemo_rl_or_mirror
from posttrain.contracts.layout import LLM_LAYOUT_V1, Layout

STATE_FILE = "nemo_async_replay_buffer.pt"
"""The one file of a :meth:`NemoAsyncReplayBuffer.save_to_path` checkpoint directory."""

EARLIER_STATE_FILE = "nemo_replay_buffer.pt"
"""The file of the earlier ``NemoReplayBuffer`` checkpoints (layout rows); refused by name."""

CHUNK_KEY = "nemo_trajectory_chunk"
"""The one key of the items this buffer writes to its backing buffer."""


@dataclass
class _Entry:
    indices: list[int]  # backing-buffer items holding the payload's chunks, in order
    nbytes: int
    version: int
    target: int
    task_index: int | None


class NemoAsyncReplayBuffer:
    """``ReplayBufferImpl`` of NeMo-RL (7ea279a) storing each prompt group in a ``ReplayBufferV1``.

    ``max_size`` and ``drop_incomplete_targets_on_restore`` are NeMo-RL's constructor
    arguments. ``buffer`` is the backing buffer (it needs ``read``); by default a posttrain
    ``RingBuffer`` of ``max_size * chunks_per_entry`` items, which allocates
    ``max_size * chunks_per_entry * chunk_bytes`` bytes (1 MiB per entry by default) at the
    first ``add``; a group may take more chunks than ``chunks_per_entry`` while the ring has
    room. ``chunk_bytes`` is the width of one item in bytes, stored as int64 words where 8
    divides it (``chunk_dtype``), else as uint8. Thread safe (one lock, as NeMo-RL's), so it runs as a Ray actor unchanged:
    see :func:`nemo_replay_buffer_actor`.

    Example:
        >>> rb = NemoAsyncReplayBuffer(max_size=4, drop_incomplete_targets_on_restore=False)
        >>> group = {"batch": {"message_log": [[{"role": "user", "token_ids": torch.tensor([5, 6])}]],
        ...                    "total_reward": torch.tensor([1.0])},
        ...          "rollout_metrics": {"mean_gen_tokens": 3.0}, "timestamp": 0.0}
        >>> rb.add(group, 0, 1), rb.size(), rb.has_complete_batch(1, 1)
        ('success', 1, True)
        >>> out = rb.sample(num_prompt_groups=1, current_weight_version=1, max_age_steps=1)
        >>> out["avg_trajectory_age"], out["trajectories"][0]["batch"]["message_log"][0][0]["token_ids"].tolist()
        (1.0, [5, 6])
        >>> rb.get_last_target_weight_already_generated()
        1
    """

    def __init__(
        self,
        max_size: int,
        drop_incomplete_targets_on_restore: bool = False,
        *,
        buffer: Any = None,
        chunk_bytes: int = 1 << 16,
        chunks_per_entry: int = 16,
    ) -> None:
        if max_size <= 0:
            raise ValueError(f"max_size must be positive, got {max_size}")
        if chunk_bytes < 1 or chunks_per_entry < 1:
            raise ValueError(
                f"chunk_bytes and chunks_per_entry: expected >= 1, found {chunk_bytes}, "
                f"{chunks_per_entry}"
            )
        if buffer is None:
            from posttrain.reference_impls import RingBuffer

            buffer = RingBuffer(max_size * chunks_per_entry)
        if not callable(getattr(buffer, "read", None)):
            raise TypeError(
                f"buffer: expected a ReplayBufferV1 with read(indices), found "
                f"{type(buffer).__name__} without it"
            )
        self.max_size = max_size
        self._drop_incomplete_targets_on_restore = drop_incomplete_targets_on_restore
        self.buffer = buffer
        self.capacity = _capacity_of(buffer)
        self.chunk_bytes = chunk_bytes
        # A chunk is stored as int64 words where its width allows: TorchRL's indexed reads
        # and writes of a [n, w] uint8 storage go one byte per element, about 4x slower (a read of
        # 8 x 160 KiB: ~1 ms against ~0.25 ms).
        self.chunk_dtype = torch.int64 if chunk_bytes % 8 == 0 else torch.uint8
        self._entries: list[_Entry] = []
        # Backing item -> the held entry whose chunk it is: what add's room check and the
        # walk of the write position read, kept up to date so that an add costs O(its chunks)
        # rather than O(everything held).
        self._owner: dict[int, _Entry] = {}
        self._written = 0  # items written to the backing buffer by this facade
        self.last_target_weight_already_generated = -1
        self._lock = threading.RLock()

    # -- NeMo-RL's parallel lists, read-only views ---------------------------------------------
    @property
    def trajectory_versions(self) -> list[int]:
        """The weight version that generated each held group (NeMo-RL's attribute)."""
        return [e.version for e in self._entries]

    @property
    def target_weight_versions(self) -> list[int]:
        """The weight version each held group is meant to train (NeMo-RL's attribute)."""
        return [e.target for e in self._entries]

    # -- storage -----------------------------------------------------------------------------
    def _chunks(self, payload: torch.Tensor) -> TensorDict:
        k = max(1, -(-payload.numel() // self.chunk_bytes))
        rows = torch.zeros(k * self.chunk_bytes, dtype=torch.uint8)
        rows[: payload.numel()] = payload
        return self._items(rows.reshape(k, self.chunk_bytes))

    def _items(self, rows: torch.Tensor) -> TensorDict:
        """uint8 [k, chunk_bytes] rows as the k items written (:attr:`chunk_dtype` words)."""
        k = int(rows.shape[0])
        return TensorDict({CHUNK_KEY: rows.view(self.chunk_dtype)}, batch_size=[k])

    def _rows(self, indices: list[int]) -> torch.Tensor:
        """The backing items at ``indices``, in that order, as one [n, width] tensor of words."""
        rows: torch.Tensor = self.buffer.read(torch.tensor(indices, dtype=torch.int64))[CHUNK_KEY]
        return rows

    def _payloads(self, entries: list[_Entry]) -> list[torch.Tensor]:
        """Each entry's payload bytes, all read in one call: views of that one read."""
        if not entries:
            return []
        rows = self._rows([i for e in entries for i in e.indices])
        out, at = [], 0
        for e in entries:
            n = len(e.indices)
            out.append(rows[at : at + n].reshape(-1).view(torch.uint8)[: e.nbytes])
            at += n
        return out

    def _hold(self, entries: list[_Entry]) -> None:
        """Keep ``entries`` (some of those held, in order); the others' items become free."""
        keep = {id(e) for e in entries}
        for e in self._entries:
            if id(e) not in keep:
                for i in e.indices:
                    if self._owner.get(i) is e:
                        del self._owner[i]
        self._entries = entries

    def _replace(self, entries: list[_Entry]) -> None:
        """Hold exactly ``entries``, their items owned anew (after a restore or compaction)."""
        self._entries = entries
        self._owner = {i: e for e in entries for i in e.indices}

    def _extend(self, td: TensorDict, expect: list[int] | None) -> list[int]:
        got = [int(i) for i in self.buffer.extend(td).tolist()]
        self._written += len(got)
        if expect is not None and got != expect:
            raise RuntimeError(
                f"{type(self.buffer).__name__} wrote at storage indices {got[:10]}, expected "
                f"{expect[:10]} (a FIFO ring of capacity {self.capacity}); this facade needs a "
                "FIFO backing buffer"
            )
        return got

    def _store(self, td: TensorDict) -> list[int] | None:
        """Write the chunks ``td``; ``None`` (nothing written) when they cannot fit."""
        k = int(td.batch_size[0])
        cap = self.capacity
        if cap is None:
            return self._extend(td, None)
        owner = self._owner
        if len(owner) + k > cap:  # the live items are distinct, each owned once
            return None
        # Plan the walk of the FIFO write position before writing anything: it steps over a
        # live entry whole (it is always at an entry's first item, entries being contiguous
        # runs) or over one dead item, until k free items lie ahead. One full turn without
        # such a run means the free items are fragmented: compact instead (walking on would
        # go round the ring forever, and NeMo-RL answers "full" only at max_size).
        start = self._written % cap
        steps: list[_Entry | int] = []
        walked = 0
        while any((start + walked + j) % cap in owner for j in range(k)):
            if walked >= cap:
                return self._compact_and_store(td)
            pos = (start + walked) % cap
            if pos in owner:
                steps.append(owner[pos])
                walked += len(owner[pos].indices)
            else:
                steps.append(pos)
                walked += 1
        for step in steps:  # rewrite each item passed over with its own bytes
            at = step.indices if isinstance(step, _Entry) else [step]
            self._extend(TensorDict({CHUNK_KEY: self._rows(at)}, batch_size=[len(at)]), at)
        return self._extend(td, [(self._written + j) % cap for j in range(k)])

    def _compact_and_store(self, td: TensorDict) -> list[int]:
        """Rewrite every live entry back to back from the write position, then ``td``.

        Called when live + k <= capacity but no k free items lie in a row. Every payload is
        read first and everything goes in one extend of at most ``capacity`` items: a moved
        entry may land on rows of one not yet moved, so item-by-item writes that failed
        part-way would leave an entry pointing at another's bytes, while the backing buffer's
        one write is all or nothing. The live items end up in one run, in FIFO order, followed
        by ``td``. Costs one read and one write of every live item.
        """
        cap = self.capacity
        assert cap is not None
        held = [i for e in self._entries for i in e.indices]
        rows = torch.cat([self._rows(held), td[CHUNK_KEY]]) if held else td[CHUNK_KEY]
        total = int(rows.shape[0])
        got = self._extend(
            TensorDict({CHUNK_KEY: rows}, batch_size=[total]),
            [(self._written + j) % cap for j in range(total)],
        )
        at = 0
        for e in self._entries:
            n = len(e.indices)
            e.indices = got[at : at + n]
            at += n
        self._replace(self._entries)
        return got[at:]

    # -- NeMo-RL's interface -------------------------------------------------------------------
    def add(
        self, trajectory: dict[str, Any], weight_version: int, target_weight_version: int
    ) -> str:
        """Store one prompt group: ``"success"``, or ``"full"`` with nothing changed.

        As NeMo-RL 7ea279a, ``last_target_weight_already_generated`` does not move here.
        """
        payload = prepare_payload(trajectory)  # PayloadError before anything changes
        k, nbytes = payload.chunks(self.chunk_bytes), payload.nbytes
        if self.capacity is not None and k > self.capacity:
            raise ValueError(
                f"trajectory: {nbytes} bytes need {k} items of {self.chunk_bytes} "
                f"bytes, more than the backing buffer's capacity {self.capacity}; it can never fit"
            )
        raw_task = trajectory.get(NEMO_GYM_TASK_INDEX_KEY)
        # Converted before the lock and any write, so a bad index leaves the buffer untouched.
        task = None if raw_task is None else int(raw_task)
        version, target = int(weight_version), int(target_weight_version)
        with self._lock:
            if len(self._entries) >= self.max_size:
                return "full"
            if self.capacity is not None and len(self._owner) + k > self.capacity:
                return "full"  # before the bytes are copied: a full buffer is asked often
            indices = self._store(self._items(payload.rows(self.chunk_bytes)))
            if indices is None:
                return "full"
            entry = _Entry(indices, nbytes, version, target, task)
            self._entries.append(entry)
            self._owner.update(dict.fromkeys(indices, entry))
            return "success"

    def push_with_wait_signal(
        self, trajectory: dict[str, Any], weight_version: int, target_weight_version: int
    ) -> str:
        """NeMo-RL's earlier name for ``add``, renamed ``add`` in a later NeMo-RL commit (4641794).

        That version also advanced ``last_target_weight_already_generated`` to the pushed
        target on success; so does this.
        """
        with self._lock:
            status = self.add(trajectory, weight_version, target_weight_version)
            if status == "success":
                self.last_target_weight_already_generated = max(
                    self.last_target_weight_already_generated, int(target_weight_version)
                )
            return status

    def get_debug_info(self) -> dict[str, Any]:
        """NeMo-RL's summary keys (no starvation diagnostics: they would decode every group)."""
        with self._lock:
            return {
                "total_trajectories": len(self._entries),
                "trajectory_versions": self.trajectory_versions,
                "target_weight_versions": self.target_weight_versions,
                "max_size": self.max_size,
            }

    def get_last_target_weight_already_generated(self) -> int:
        """The highest target a complete batch was consumed for (NeMo-RL's bookkeeping)."""
        with self._lock:
            return self.last_target_weight_already_generated

    def get_existing_target_weights(self) -> set[int]:
        """Target versions with at least one held group."""
        with self._lock:
            return {e.target for e in self._entries}

    def sample(
        self, num_prompt_groups: int, current_weight_version: int, max_age_steps: int
    ) -> dict[str, Any] | None:
        """NeMo-RL's ``sample``: evict stale groups, then take the first ``num_prompt_groups``
        meant for ``current_weight_version``, or ``None`` (stall) when there are fewer."""
        with self._lock:
            left, chosen = take_for_step(
                self._entries, num_prompt_groups, current_weight_version, max_age_steps
            )
            if chosen is None:
                self._hold(left)
                return None
            bdd = nemo_rl_or_mirror("BatchedDataDict")  # one look-up for every group
            items = [decode_payload(p, batched_data_dict=bdd) for p in self._payloads(chosen)]
            self._hold(left)  # only once every group decoded
            self.last_target_weight_already_generated = max(
                self.last_target_weight_already_generated, current_weight_version
            )
            return {
                "trajectories": items,
                "avg_trajectory_age": mean_age(chosen, current_weight_version),
            }

    def size(self) -> int:
        """Prompt groups held."""
        with self._lock:
            return len(self._entries)

    def clear(self) -> None:
        """Forget every group (``last_target_weight_already_generated`` stays, as in NeMo-RL)."""
        with self._lock:
            self._replace([])

    def state_dict(self) -> dict[str, Any]:
        """NeMo-RL's keys; ``trajectories`` are encoded payloads (uint8 tensors), not pickles."""
        with self._lock:
            return {
                "format": PAYLOAD_FORMAT,
                # Copies: each view would carry the whole read's bytes into a checkpoint.
                "trajectories": [p.clone() for p in self._payloads(self._entries)],
                "trajectory_versions": self.trajectory_versions,
                "target_weight_versions": self.target_weight_versions,
                "task_indices": [e.task_index for e in self._entries],
                "last_target_weight_already_generated": self.last_target_weight_already_generated,
                "max_size": self.max_size,
            }

    def save_to_path(self, path: str | os.PathLike[str]) -> int:
        """Write :meth:`state_dict` as the checkpoint directory ``path``; return the groups.

        ``path`` holds ``nemo_async_replay_buffer.pt`` and a manifest of its size and SHA-256;
        it is written beside ``path`` and swapped in whole, so a crash or an error leaves the
        previous checkpoint or the new one. A failure raises ``CheckpointError`` saying what
        happened, the OS error chained.
        """
        state = self.state_dict()
        try:
            save_state(path, STATE_FILE, state)
        except CheckpointError:
            raise
        except OSError as e:
            raise CheckpointError(
                f"{path}: the replay buffer checkpoint could not be written ({_os_error(e)}); "
                "what was there before is unchanged"
            ) from e
        return len(state["trajectories"])

    def load_from_path(
        self,
        path: str | os.PathLike[str],
        num_prompts_per_step: int | None = None,
        current_training_step: int | None = None,
        max_age_steps: int | None = None,
    ) -> dict[str, int]:
        """Restore :meth:`save_to_path`'s checkpoint; NeMo-RL's return keys.

        The manifest is verified before anything is read (a missing, extra, truncated or
        altered file is refused by name), the file is read with ``weights_only=True``, and
        the whole state, task indices included, is checked before anything changes. Every
        refusal raises ``CheckpointError`` (a ``ValueError``) saying why, with this buffer
        unchanged.
        """
        state = _load_checkpoint(path, STATE_FILE)
        try:
            if not isinstance(state, Mapping):
                raise ValueError(
                    f"expected a replay buffer state dict, found {type(state).__name__}"
                )
            plan = self._plan(state, num_prompts_per_step, current_training_step, max_age_steps)
        except ValueError as e:  # PayloadError is one too
            raise CheckpointError(f"{path}: {e} (buffer unchanged)") from e
        self._apply(*plan[:2])
        tasks = [t for t in plan[2] if t is not None]
        return {
            "num_trajectories": plan[3],
            NEXT_NEMO_GYM_TASK_INDEX_KEY: max(tasks, default=-1) + 1,
        }

    def load_state_dict(
        self,
        state: dict[str, Any],
        num_prompts_per_step: int | None = None,
        current_training_step: int | None = None,
        max_age_steps: int | None = None,
    ) -> None:
        """NeMo-RL's restore: stale rows out, then past/incomplete targets handled, then
        truncation to ``max_size``; the kept groups are written to the backing buffer.

        ``trajectories`` may be payloads (this class's ``state_dict``) or the trajectory dicts
        NeMo-RL's own ``state_dict`` holds. Every check runs before anything changes.
        """
        rows, last, _, _ = self._plan(
            state, num_prompts_per_step, current_training_step, max_age_steps
        )
        self._apply(rows, last)

    def _plan(
        self,
        state: Mapping[str, Any],
        num_prompts_per_step: int | None,
        current_training_step: int | None,
        max_age_steps: int | None,
    ) -> tuple[list[Row], int, list[int | None], int]:
        """The checked state: (rows kept, generation mark, every task index, groups read).

        Reads nothing of this buffer but its settings; raises ``ValueError`` (``TypeError``
        for a field of the wrong type is said as one too) naming the key, what was expected
        and what was found.
        """
        trajs, versions, targets = _checked_lists(state)
        payloads = [t if isinstance(t, torch.Tensor) else encode_payload(t) for t in trajs]
        bdd = nemo_rl_or_mirror("BatchedDataDict")
        for i, p in enumerate(payloads):
            # A malformed payload, or a group this buffer would not take, is refused before
            # anything changes.
            self._check_restored(
                decode_payload(p, batched_data_dict=bdd), f"state['trajectories'][{i}]"
            )
        tasks = _task_indices(state, trajs)
        rows = list(zip(payloads, versions, targets, tasks, strict=True))
        last = _int(
            state["last_target_weight_already_generated"],
            "state['last_target_weight_already_generated']",
        )
        rows, last = restore_plan(
            rows,
            last,
            self.max_size,
            self._drop_incomplete_targets_on_restore,
            num_prompts_per_step,
            current_training_step,
            max_age_steps,
        )
        k_total = sum(max(1, -(-p.numel() // self.chunk_bytes)) for p, *_ in rows)
        if self.capacity is not None and k_total > self.capacity:
            raise ValueError(
                f"Checkpoint: {len(rows)} groups need {k_total} items of {self.chunk_bytes} "
                f"bytes, more than the backing buffer's capacity {self.capacity}"
            )
        return rows, last, tasks, len(trajs)

    def _check_restored(self, trajectory: Any, where: str) -> None:
        """Refuse a restored group that :meth:`add` would refuse (any group here)."""

    def _apply(self, rows: list[Row], last: int) -> None:
        """Write the kept groups in one extend, then hold them (nothing changes if it raises)."""
        with self._lock:
            entries = []
            parts = []
            for p, v, t, task in rows:
                part = self._chunks(p)
                parts.append(part)
                entries.append(_Entry([], int(p.numel()), v, t, task))
            if parts:
                cap = self.capacity
                n = sum(int(part.batch_size[0]) for part in parts)
                expect = None if cap is None else [(self._written + j) % cap for j in range(n)]
                written = self._written
                try:
                    got = self._extend(torch.cat(parts, 0), expect)
                except BaseException:
                    if self._written != written:
                        # Written, but not where a FIFO ring would: the old groups' rows may
                        # be gone, so none of them can be handed back.
                        self._replace([])
                    raise
                at = 0
                for e, part in zip(entries, parts, strict=True):
                    e.indices = got[at : at + int(part.batch_size[0])]
                    at += len(e.indices)
            self._replace(entries)
            self.last_target_weight_already_generated = last

    def get_trajectories_needed(
        self, target_step: int, num_prompts_per_step: int, max_age_steps: int | None = None
    ) -> int:
        """How many more groups ``target_step`` needs for a complete batch."""
        with self._lock:
            return max(0, num_prompts_per_step - self._count_for_target(target_step, max_age_steps))

    def has_complete_batch(
        self, target_step: int, num_prompts_per_step: int, max_age_steps: int | None = None
    ) -> bool:
        """Whether ``target_step`` has ``num_prompts_per_step`` usable groups."""
        with self._lock:
            return self._count_for_target(target_step, max_age_steps) >= num_prompts_per_step

    def _count_for_target(self, target_step: int, max_age_steps: int | None) -> int:
        return sum(
            1
            for e in self._entries
            if e.target == target_step and valid_for_target(e.version, target_step, max_age_steps)
        )


def _checked_lists(state: Mapping[str, Any]) -> tuple[list[Any], list[int], list[int]]:
    """A state's trajectories, versions and targets, keys, types and lengths checked."""
    required = {
        "trajectories",
        "trajectory_versions",
        "target_weight_versions",
        "last_target_weight_already_generated",
    }
    if {"buffer", "written"} <= set(state):
        raise ValueError(
            f"state: expected a replay buffer state of format {PAYLOAD_FORMAT!r} (each group "
            "an encoded payload), found the earlier NemoReplayBuffer state (keys 'buffer' and "
            "'written': groups as rows of the backing buffer's state), which is not read"
        )
    missing = required - set(state)
    if missing:
        raise ValueError(
            f"state keys: expected {sorted(required)}, found {sorted(state)} "
            f"(without {sorted(missing)})"
        )
    if "format" in state and state["format"] != PAYLOAD_FORMAT:
        raise ValueError(
            f"Checkpoint format: expected {PAYLOAD_FORMAT!r}, found {state['format']!r}"
        )
    for key in ("trajectories", "trajectory_versions", "target_weight_versions"):
        if not isinstance(state[key], list | tuple):
            raise ValueError(f"state[{key!r}]: expected a list, found {type(state[key]).__name__}")
    trajs = list(state["trajectories"])
    versions = [_int(v, f"state['trajectory_versions'][{i}]") for i, v in
                enumerate(state["trajectory_versions"])]  # fmt: skip
    targets = [_int(t, f"state['target_weight_versions'][{i}]") for i, t in
               enumerate(state["target_weight_versions"])]  # fmt: skip
    if not len(trajs) == len(versions) == len(targets):
        raise ValueError(
            "state lists: expected one length for trajectories, trajectory_versions and "
            f"target_weight_versions, found {len(trajs)}, {len(versions)} and {len(targets)}"
        )
    for i, t in enumerate(trajs):
        if not isinstance(t, torch.Tensor | Mapping):
            raise ValueError(
                f"state['trajectories'][{i}]: expected an encoded payload or a trajectory "
                f"dict, found {type(t).__name__}"
            )
    return trajs, versions, targets


def _task_indices(state: Mapping[str, Any], trajs: list[Any]) -> list[int | None]:
    """Each trajectory's NeMo Gym task index: ``task_indices``, or the trajectory's own key."""
    raw_tasks = state.get("task_indices", [None] * len(trajs))
    if not isinstance(raw_tasks, list | tuple) or len(raw_tasks) != len(trajs):
        found = len(raw_tasks) if isinstance(raw_tasks, list | tuple) else raw_tasks
        raise ValueError(
            f"state['task_indices']: expected a list of {len(trajs)}, found {found!r:.80}"
        )
    tasks: list[int | None] = [
        None if t is None else _int(t, f"state['task_indices'][{i}]")
        for i, t in enumerate(raw_tasks)
    ]
    for i, t in enumerate(trajs):
        if not isinstance(t, torch.Tensor) and t.get(NEMO_GYM_TASK_INDEX_KEY) is not None:
            tasks[i] = _int(
                t[NEMO_GYM_TASK_INDEX_KEY],
                f"state['trajectories'][{i}][{NEMO_GYM_TASK_INDEX_KEY!r}]",
            )
    return tasks


def _int(value: Any, where: str) -> int:
    """``value`` as an int (numpy and 0-d tensor ints too); ``ValueError`` naming ``where``
    for anything else, bool and float included."""
    try:
        if isinstance(value, bool | float | str):
            raise TypeError
        return operator.index(value)
    except TypeError:
        raise ValueError(f"{where}: expected an int, found {value!r:.80}") from None


def _os_error(e: OSError) -> str:
    """An OS error in words: ``'No space left on device'`` rather than its repr."""
    return e.strerror or str(e) or type(e).__name__


def _load_checkpoint(path: str | os.PathLike[str], name: str) -> Any:
    """``load_verified(path, name)``, every failure a ``CheckpointError`` with the OS error
    chained (a missing path, a file where a directory should be, an unreadable file)."""
    earlier = os.path.join(path, EARLIER_STATE_FILE)
    if os.path.isfile(earlier) and not os.path.exists(os.path.join(path, name)):
        raise CheckpointError(
            f"{path}: expected {name} (groups as {PAYLOAD_FORMAT!r} payloads), found "
            f"{EARLIER_STATE_FILE}: a NemoReplayBuffer checkpoint of the earlier format "
            "(posttrain-nemo-replay-buffer/1, groups as rows of the backing buffer), which is "
            "not read; refill the buffer from the rollouts instead"
        )
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


def _capacity_of(buffer: Any) -> int | None:
    """The buffer's capacity in items where it tells: ``capacity``, or TorchRL's storage size."""
    storage = getattr(getattr(buffer, "rb", None), "storage", None)
    for value in (getattr(buffer, "capacity", None), getattr(storage, "max_size", None)):
        if isinstance(value, int) and not isinstance(value, bool) and value > 0:
            return value
    return None


def nemo_replay_buffer_actor(
    max_size: int,
    drop_incomplete_targets_on_restore: bool = False,
    *,
    buffer_factory: Callable[..., Any] | None = None,
    buffer_args: tuple[Any, ...] = (),
    actor_options: Mapping[str, Any] | None = None,
    **kwargs: Any,
) -> Any:
    """A Ray actor handle for :class:`NemoAsyncReplayBuffer`, called as NeMo-RL's ``ReplayBuffer``.

    ``handle.add.remote(...)``, ``ray.get(handle.sample.remote(...))`` and the rest work as
    on ``nemo_rl.algorithms.async_utils.ReplayBuffer``. The backing buffer is built inside the
    actor by ``buffer_factory(*buffer_args)`` (default: a ``RingBuffer``), so the data stays
    there. Joins the running cluster or starts the local one (``adapters/_ray.py``).

    Example (not run by the doctests: tests own the cluster's lifetime):
        >>> rb = nemo_replay_buffer_actor(8)  # doctest: +SKIP
        >>> ray.get(rb.size.remote())  # doctest: +SKIP
        0
    """
    from posttrain.adapters._ray import ensure_cluster

    ray = ensure_cluster()
    actor = ray.remote(_ActorBody).options(**{"num_cpus": 0, **(actor_options or {})})
    return actor.remote(
        max_size, drop_incomplete_targets_on_restore, buffer_factory, buffer_args, kwargs
    )


class _ActorBody(NemoAsyncReplayBuffer):
    """Builds the backing buffer inside the actor process."""

    def __init__(
        self,
        max_size: int,
        drop_incomplete_targets_on_restore: bool,
        buffer_factory: Callable[..., Any] | None,
        buffer_args: tuple[Any, ...],
        kwargs: dict[str, Any],
    ) -> None:
        buffer = None if buffer_factory is None else buffer_factory(*buffer_args)
        super().__init__(max_size, drop_incomplete_targets_on_restore, buffer=buffer, **kwargs)


class NemoReplayBuffer(NemoAsyncReplayBuffer):
    """:class:`NemoAsyncReplayBuffer` for groups of NeMo-RL train data, checked on the way in.

    The same buffer (NeMo-RL's ``ReplayBufferImpl``, stored in ``buffer``) with two checks
    of posttrain's: ``add`` refuses a ``trajectory["batch"]`` that is not NeMo-RL train data
    (``input_ids`` int64 [B, S], masks, log-probs ...: :func:`~posttrain.adapters.nemo_rl.train_data.to_layout`'s
    checks against ``layout``) with ``NemoFormatError`` naming the key, and ``sample``
    refuses ``num_prompt_groups`` < 1 or ``max_age_steps`` < 0 with ``ValueError`` before
    anything is dropped (NeMo-RL checks neither: 0 ends in a ``ZeroDivisionError``). Groups
    come back bit-exactly (keys in order, dtypes, NaN and infinite log-probs included).

    Example:
        >>> from posttrain.reference_impls import RingBuffer
        >>> from posttrain.adapters.nemo_rl.train_data import from_layout
        >>> from posttrain.testing import llm_batch
        >>> nemo = NemoReplayBuffer(RingBuffer(16), max_size=4, chunk_bytes=4096)
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
        self, buffer: Any, max_size: int, *, layout: Layout = LLM_LAYOUT_V1, **kwargs: Any
    ) -> None:
        super().__init__(max_size, buffer=buffer, **kwargs)
        self.layout = layout

    def add(
        self, trajectory: dict[str, Any], weight_version: int, target_weight_version: int
    ) -> str:
        """Check ``trajectory["batch"]`` as NeMo-RL train data, then store the group."""
        if not isinstance(trajectory, Mapping) or "batch" not in trajectory:
            found = sorted(trajectory) if isinstance(trajectory, Mapping) else type(trajectory)
            raise KeyError(f"trajectory: expected a 'batch' key; found {found}")
        check_train_data(trajectory["batch"], layout=self.layout)  # NemoFormatError naming the key
        return super().add(trajectory, weight_version, target_weight_version)

    def _check_restored(self, trajectory: Any, where: str) -> None:
        """A restored group is checked as :meth:`add` checks one: train data under ``batch``."""
        if not isinstance(trajectory, Mapping) or "batch" not in trajectory:
            found = (
                sorted(str(k) for k in trajectory)
                if isinstance(trajectory, Mapping)
                else type(trajectory).__name__
            )
            raise ValueError(f"{where}: expected a trajectory with a 'batch' key, found {found}")
        try:
            check_train_data(trajectory["batch"], layout=self.layout)
        except NemoFormatError as e:
            raise NemoFormatError(f"{where}['batch']: {e}") from None

    def sample(
        self, num_prompt_groups: int, current_weight_version: int, max_age_steps: int
    ) -> dict[str, Any] | None:
        """:meth:`NemoAsyncReplayBuffer.sample`, bad counts refused before anything is dropped."""
        if _int(num_prompt_groups, "num_prompt_groups") < 1:
            raise ValueError(f"num_prompt_groups: expected >= 1, found {num_prompt_groups}")
        if _int(max_age_steps, "max_age_steps") < 0:
            raise ValueError(f"max_age_steps: expected >= 0, found {max_age_steps}")
        return super().sample(num_prompt_groups, current_weight_version, max_age_steps)
