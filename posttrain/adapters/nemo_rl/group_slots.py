"""NeMo-RL's reserve-then-commit prompt-group slots (``TQReplayBuffer``) over the data-plane client.

:class:`NemoGroupSlots` is the slot list of NeMo-RL's ``TQReplayBuffer``
(``nemo_rl/algorithms/async_utils/replay_buffer.py``, 7ea279a) over
:class:`~posttrain.adapters.nemo_rl.data_plane.NemoDataPlaneClient`, with synchronous calls;
:class:`NemoAsyncGroupSlots` has NeMo-RL's coroutine ``commit`` / ``remove_group`` /
``remove``. A distinct class of NeMo-RL's from ``ReplayBufferImpl``
(:mod:`posttrain.adapters.nemo_rl.replay_buffer`): its rows live in the data plane, the slots
only index them.
"""

from __future__ import annotations

import asyncio
from typing import Any

from tensordict import TensorDictBase

from posttrain.adapters.nemo_rl.data_plane import KVBatchMeta, NemoDataPlaneClient


class NemoGroupSlots:
    """Reserve-then-commit prompt-group slots over a data-plane client, as ``TQReplayBuffer``.

    ``nemo_rl/algorithms/async_utils/replay_buffer.py:TQReplayBuffer`` (7ea279a): ``reserve``
    appends an unready slot stamped with the weight version (and target step) before the
    rollout starts; ``commit`` writes the group's rows to the data plane and marks the slot
    ready, rolling the rows back with ``clear_samples`` if the write fails; ``remove_group`` /
    ``remove`` drop slots (and, asked, their rows). Differences, on purpose: calls are
    synchronous (NeMo-RL's ``commit``/``remove`` are coroutines), and ``commit`` takes the
    packed ``sample_ids`` and ``fields`` (NeMo-RL packs a ``PromptGroupRecord`` itself with
    ``record_to_train_batch`` / ``pack_payload``).

    Example:
        >>> import torch
        >>> from tensordict import TensorDict
        >>> from posttrain.reference_impls import RingBuffer
        >>> slots = NemoGroupSlots(NemoDataPlaneClient(RingBuffer, capacity=8), "train")
        >>> gid = slots.reserve(weight_version=3, target_step=4, group_id="g0")
        >>> slots.ready_list, slots.size()
        ([False], 1)
        >>> meta = slots.commit(gid, ["g0_0", "g0_1"], TensorDict({"input_lengths": torch.tensor([2, 3])}, [2]), 3, 4)
        >>> slots.ready_list, meta.sequence_lengths, slots.count_for_target_step(4)
        ([True], [2, 3], 1)
    """

    def __init__(self, dp_client: NemoDataPlaneClient, partition_id: str) -> None:
        self._dp = dp_client
        self._partition_id = partition_id
        self.meta_list: list[KVBatchMeta | None] = []
        self.start_weight_list: list[int] = []
        self.end_weight_list: list[int] = []
        self.target_step_list: list[int | None] = []
        self.ready_list: list[bool] = []
        self._group_ids: list[str] = []

    def reserve(
        self, *, weight_version: int, target_step: int | None = None, group_id: str | None = None
    ) -> str:
        """Append an unready slot; return its ``group_id`` (a fresh uuid4 by default)."""
        import uuid

        gid = str(uuid.uuid4()) if group_id is None else group_id
        if gid in self._group_ids:
            raise ValueError(f"group_id={gid!r}: already has a live slot")
        self.meta_list.append(None)
        self.start_weight_list.append(weight_version)
        self.end_weight_list.append(-1)
        self.target_step_list.append(target_step)
        self.ready_list.append(False)
        self._group_ids.append(gid)
        return gid

    def commit(
        self,
        group_id: str,
        sample_ids: list[str],
        fields: TensorDictBase,
        start_weight_version: int,
        end_weight_version: int,
        tags: list[dict[str, Any]] | None = None,
    ) -> KVBatchMeta:
        """Write the group's rows and mark its slot ready; unknown ``group_id``: ``ValueError``.

        ``sample_ids`` that already hold rows in the partition (another group's live rows) are
        refused with ``ValueError`` before anything is written. A failed write (a refused
        schema, :class:`DataPlaneFullError`) clears the rows this call wrote, and only those,
        and re-raises; the slot stays reserved and unready.
        """
        self._known(group_id)
        self._refuse_live(
            group_id, self._dp.live_sample_ids(self._partition_id, among=list(sample_ids))
        )
        tags = self._tags(group_id, len(sample_ids), tags, start_weight_version)
        try:
            meta = self._dp.put_samples(list(sample_ids), self._partition_id, fields, tags)
        except BaseException:
            # None of sample_ids was live before the write, so any now live are this call's.
            self._dp.clear_samples(list(sample_ids), self._partition_id)
            raise
        return self._mark(group_id, meta, start_weight_version, end_weight_version)

    def _known(self, group_id: str) -> None:
        """Refuse a ``group_id`` without a reserved slot."""
        if group_id not in self._group_ids:
            raise ValueError(
                f"commit called with unknown group_id={group_id!r}; reserve() must precede "
                "commit() (or the slot was already removed)"
            )

    def _refuse_live(self, group_id: str, live: set[str]) -> None:
        """Refuse a commit whose ids already hold rows in the partition, naming them."""
        taken = sorted(live)
        if taken:
            shown = ", ".join(repr(t) for t in taken[:10]) + (
                f" and {len(taken) - 10} more" if len(taken) > 10 else ""
            )
            raise ValueError(
                f"commit of group_id={group_id!r}: expected sample ids without live rows in "
                f"partition {self._partition_id!r}, found {shown} already live; nothing written"
            )

    @staticmethod
    def _tags(
        group_id: str, n: int, tags: list[dict[str, Any]] | None, start_weight_version: int
    ) -> list[dict[str, Any]]:
        """The tags to write: the caller's, else the group id and weight version per row."""
        if tags is None:
            return [{"group_id": group_id, "weight_version": start_weight_version}] * n
        return tags

    def _mark(self, group_id: str, meta: KVBatchMeta, start: int, end: int) -> KVBatchMeta:
        meta.task_name = "train"
        i = self._group_ids.index(group_id)
        self.meta_list[i] = meta
        self.start_weight_list[i] = start
        self.end_weight_list[i] = end
        self.ready_list[i] = True
        return meta

    def remove_group(self, group_id: str, *, remove_in_dp: bool = False) -> int:
        """Drop the slot of ``group_id`` (``ValueError`` if none is live)."""
        return self.remove([self._slot_of(group_id)], remove_in_dp=remove_in_dp)

    def _slot_of(self, group_id: str) -> int:
        try:
            return self._group_ids.index(group_id)
        except ValueError as error:
            raise ValueError(f"unknown group_id={group_id!r}") from error

    def remove(self, idxs: list[int], remove_in_dp: bool) -> int:
        """Drop the slots at ``idxs`` (and their rows when ``remove_in_dp``); how many."""
        ids = self._drop(idxs)
        if remove_in_dp and ids:
            self._dp.clear_samples(ids, self._partition_id)
        return len(set(idxs))

    def _drop(self, idxs: list[int]) -> list[str]:
        """Delete the slots at ``idxs`` (before any await, as NeMo-RL); their sample ids."""
        if not idxs:
            return []
        drop = sorted(set(idxs), reverse=True)
        if drop[0] >= len(self.meta_list) or drop[-1] < 0:
            raise IndexError(f"remove: indices out of range: {drop[0]}; size={len(self.meta_list)}")
        ids: list[str] = []
        for i in drop:
            meta = self.meta_list[i]
            if meta is not None:
                ids.extend(meta.sample_ids)
            for lst in (
                self.meta_list,
                self.start_weight_list,
                self.end_weight_list,
                self.target_step_list,
                self.ready_list,
                self._group_ids,
            ):
                del lst[i]
        return ids

    def promote_ready_group(self, *, to_target_step: int) -> int | None:
        """Re-stamp the ready slot of the furthest later target onto ``to_target_step``.

        Returns the target it was taken from, or ``None`` when no later target has a ready
        slot (``TQReplayBuffer.promote_ready_group``: fills a step's hole with a finished
        group; the caller repays the lender).

        Example:
            >>> import torch
            >>> from tensordict import TensorDict
            >>> from posttrain.reference_impls import RingBuffer
            >>> slots = NemoGroupSlots(NemoDataPlaneClient(RingBuffer, capacity=4), "train")
            >>> g = slots.reserve(weight_version=0, target_step=3)
            >>> _ = slots.commit(g, ["a"], TensorDict({"x": torch.ones(1)}, [1]), 0, 0)
            >>> slots.promote_ready_group(to_target_step=1), slots.target_step_list
            (3, [1])
        """
        later = [
            (t, i)
            for i, t in enumerate(self.target_step_list)
            if t is not None and t > to_target_step and self.ready_list[i]
        ]
        if not later:
            return None
        # The furthest target; among its slots the first (a strict > keeps the earliest).
        target = max(t for t, _ in later)
        i = next(i for t, i in later if t == target)
        self.target_step_list[i] = to_target_step
        return target

    def count_for_target_step(self, target_step: int) -> int:
        """Slots stamped with ``target_step``."""
        return sum(1 for t in self.target_step_list if t == target_step)

    def size(self) -> int:
        """Slots held, ready or not."""
        return len(self.meta_list)

    def __len__(self) -> int:
        return len(self.meta_list)


class NemoAsyncGroupSlots(NemoGroupSlots):
    """:class:`NemoGroupSlots` with NeMo-RL's coroutines: ``await commit / remove_group / remove``.

    ``TQReplayBuffer`` (7ea279a) awaits its data-plane calls through ``_call_dp``: a Ray actor
    method's ``.remote`` is awaited, a coroutine is awaited, a plain call is returned. So does
    this class, so the client may be :class:`NemoDataPlaneClient` itself or a Ray actor
    serving it. A slot's list entries are deleted before the first await of ``remove``, as
    NeMo-RL does, so an index picked by a concurrent selection is not shifted under it.

    Example:
        >>> import asyncio
        >>> import torch
        >>> from tensordict import TensorDict
        >>> from posttrain.reference_impls import RingBuffer
        >>> slots = NemoAsyncGroupSlots(NemoDataPlaneClient(RingBuffer, capacity=4), "train")
        >>> g = slots.reserve(weight_version=0, target_step=1)
        >>> meta = asyncio.run(slots.commit(g, ["a"], TensorDict({"x": torch.ones(1)}, [1]), 0, 1))
        >>> meta.sample_ids, slots.ready_list
        (['a'], [True])
        >>> asyncio.run(slots.remove_group(g, remove_in_dp=True)), slots.size()
        (1, 0)
    """

    def __init__(self, dp_client: NemoDataPlaneClient, partition_id: str) -> None:
        super().__init__(dp_client, partition_id)
        self._commit_lock: tuple[asyncio.AbstractEventLoop, asyncio.Lock] | None = None
        # Which reservation holds each group_id now: a slot removed and reserved again under
        # the same id during a commit's write is a different slot, not the one it checked.
        self._reservation: dict[str, int] = {}
        self._reservations = 0

    def reserve(
        self, *, weight_version: int, target_step: int | None = None, group_id: str | None = None
    ) -> str:
        """As :meth:`NemoGroupSlots.reserve`."""
        gid = super().reserve(
            weight_version=weight_version, target_step=target_step, group_id=group_id
        )
        self._reservations += 1
        self._reservation[gid] = self._reservations
        return gid

    async def commit(  # type: ignore[override]
        self,
        group_id: str,
        sample_ids: list[str],
        fields: TensorDictBase,
        start_weight_version: int,
        end_weight_version: int,
        tags: list[dict[str, Any]] | None = None,
    ) -> KVBatchMeta:
        """As :meth:`NemoGroupSlots.commit`, awaited, and atomic with respect to other commits.

        One commit at a time runs its check, write and mark (an ``asyncio.Lock`` of this
        object), so two concurrent commits of the same ids cannot both find them free: the
        second is refused with ``ValueError``. A slot removed while its rows were being written
        (``remove_group`` does not wait for the lock: NeMo-RL drops slots before any await)
        gets its rows cleared again and ``ValueError``; no row outlives its slot.
        """
        async with self._lock():
            self._known(group_id)
            reservation = self._reservation.get(group_id)
            live = await self._call_dp(
                "live_sample_ids", partition_id=self._partition_id, among=list(sample_ids)
            )
            self._refuse_live(group_id, set(live))
            tags = self._tags(group_id, len(sample_ids), tags, start_weight_version)
            try:
                meta = await self._call_dp(
                    "put_samples",
                    sample_ids=list(sample_ids),
                    partition_id=self._partition_id,
                    fields=fields,
                    tags=tags,
                )
            except BaseException:
                await self._clear(sample_ids)
                raise
            if group_id not in self._group_ids or self._reservation.get(group_id) != reservation:
                await self._clear(sample_ids)
                raise ValueError(
                    f"commit of group_id={group_id!r}: expected its slot to stay reserved, "
                    "found it removed while its rows were written; rows cleared"
                )
            return self._mark(group_id, meta, start_weight_version, end_weight_version)

    async def _clear(self, sample_ids: list[str]) -> None:
        # Under the lock none of sample_ids was live before the write: any now live are ours.
        await self._call_dp(
            "clear_samples", sample_ids=list(sample_ids), partition_id=self._partition_id
        )

    def _lock(self) -> asyncio.Lock:
        """This object's commit lock for the running loop (a lock is bound to one loop)."""
        loop = asyncio.get_running_loop()
        if self._commit_lock is None or self._commit_lock[0] is not loop:
            self._commit_lock = (loop, asyncio.Lock())
        return self._commit_lock[1]

    async def remove_group(self, group_id: str, *, remove_in_dp: bool = False) -> int:  # type: ignore[override]
        """As :meth:`NemoGroupSlots.remove_group`, awaited."""
        return await self.remove([self._slot_of(group_id)], remove_in_dp=remove_in_dp)

    async def remove(self, idxs: list[int], remove_in_dp: bool) -> int:  # type: ignore[override]
        """As :meth:`NemoGroupSlots.remove`, awaited; the slots go before the first await."""
        ids = self._drop(idxs)
        if remove_in_dp and ids:
            await self._call_dp("clear_samples", sample_ids=ids, partition_id=self._partition_id)
        return len(set(idxs))

    async def _call_dp(self, method_name: str, **kwargs: Any) -> Any:
        method = getattr(self._dp, method_name)
        remote = getattr(method, "remote", None)
        if remote is not None:
            return await remote(**kwargs)
        result = method(**kwargs)
        if asyncio.iscoroutine(result):
            return await result
        return result
