"""NeMo-RL's data-plane client (by-key part) over posttrain/TorchRL buffers."""

from __future__ import annotations

import asyncio
from typing import Any

import pytest
import torch
from tensordict import TensorDict

from posttrain.adapters.nemo_rl.data_plane import NemoDataPlaneClient
from posttrain.adapters.nemo_rl.wire import pack_jagged_fields
from posttrain.contracts.validation import ContractViolation
from posttrain.reference_impls import RingBuffer


def _ragged(capacity: int) -> Any:
    from torchrl.data import LazyStackStorage, TensorDictReplayBuffer

    from posttrain.adapters.torchrl import ValidatedReplayBuffer

    return ValidatedReplayBuffer(
        TensorDictReplayBuffer(storage=LazyStackStorage(capacity)), ragged=True
    )


def _client() -> NemoDataPlaneClient:
    return NemoDataPlaneClient(RingBuffer, make_ragged_buffer=_ragged, capacity=32)


def _wire() -> TensorDict:
    ids = torch.tensor([[11, 12, 13, 21, 22, 0], [11, 12, 14, 31, 32, 33], [5, 6, 0, 0, 0, 0]])
    lengths = torch.tensor([5, 6, 2], dtype=torch.int32)
    return pack_jagged_fields(
        {
            "input_ids": ids,
            "input_lengths": lengths,
            "token_mask": (ids > 20).long(),
            "sample_mask": torch.ones(3),
        },
        lengths=lengths,
    )


def test_put_then_get_by_id_in_any_order_and_stage_by_stage() -> None:
    dp = _client()
    wire = _wire()
    meta = dp.put_samples(["a", "b", "c"], "train", wire, tags=[{"k": 1}] * 3)
    assert meta.sample_ids == ["a", "b", "c"]
    assert meta.sequence_lengths == [5, 6, 2]
    assert set(meta.fields or []) == {"input_ids", "input_lengths", "token_mask", "sample_mask"}
    got = dp.get_samples(["c", "a"], "train", ["input_ids", "sample_mask"])
    assert got["input_ids"].is_nested
    assert [r.tolist() for r in got["input_ids"].unbind()] == [[5, 6], [11, 12, 13, 21, 22]]
    assert got["sample_mask"].tolist() == [1.0, 1.0]
    # A later stage adds a field for the same ids (NeMo-RL: advantages after rewards).
    adv = pack_jagged_fields(
        {"advantages": torch.tensor([[0.5] * 6, [-1.0] * 6, [2.0] * 6])},
        lengths=torch.tensor([5, 6, 2]),
    )
    dp.put_samples(["a", "b", "c"], "train", adv)
    both = dp.get_samples(["b"], "train", ["input_ids", "advantages"])
    assert both["advantages"].unbind()[0].tolist() == [-1.0] * 6
    assert both["input_ids"].unbind()[0].tolist() == [11, 12, 14, 31, 32, 33]


def test_clear_and_errors_name_what_is_missing() -> None:
    dp = _client()
    dp.put_samples(["a", "b", "c"], "train", _wire())
    dp.clear_samples(["a"], "train")
    with pytest.raises(KeyError, match=r"no value for sample ids \['a'\]"):
        dp.get_samples(["a", "b"], "train", ["input_ids"])
    with pytest.raises(KeyError, match="field 'nope': not in partition 'train'"):
        dp.get_samples(["b"], "train", ["nope"])
    with pytest.raises(ValueError, match="no implicit fetch-all"):
        dp.get_samples(["b"], "train", [])
    dp.clear_samples(None, "train")
    with pytest.raises(KeyError, match="no value for sample ids"):
        dp.get_samples(["b"], "train", ["input_ids"])
    with pytest.raises(ValueError, match=r"expected batch size \[2\]"):
        dp.put_samples(["x", "y"], "train", _wire())
    with pytest.raises(ValueError, match="is jagged: pass make_ragged_buffer="):
        NemoDataPlaneClient(RingBuffer).put_samples(["a", "b", "c"], "p", _wire())
    dp.close()
    with pytest.raises(RuntimeError, match="after close"):
        dp.get_samples(["b"], "train", ["input_ids"])


def test_a_refused_write_leaves_every_id_as_it_was() -> None:
    dp = _client()
    dp.put_samples(["a"], "train", TensorDict({"x": torch.tensor([1.0])}, [1]))
    bad = TensorDict({"x": torch.tensor([2], dtype=torch.int64), "y": torch.tensor([3.0])}, [1])
    with pytest.raises(Exception, match="'value'"):  # the x store refuses int64 (BUF-011)
        dp.put_samples(["a"], "train", bad)
    assert dp.get_samples(["a"], "train", ["x"])["x"].tolist() == [1.0]
    with pytest.raises(KeyError, match="field 'y'"):
        dp.get_samples(["a"], "train", ["y"])


def test_a_write_refused_on_a_later_field_leaves_earlier_fields_of_other_ids_intact() -> None:
    dp = NemoDataPlaneClient(RingBuffer, capacity=2, full="evict_oldest")
    dp.put_samples(
        ["a", "b"],
        "train",
        TensorDict({"x": torch.tensor([1.0, 2.0]), "y": torch.tensor([10, 20])}, [2]),
    )
    bad = TensorDict({"x": torch.tensor([3.0, 4.0]), "y": torch.tensor([0.5, 0.5])}, [2])
    with pytest.raises(ContractViolation) as refused:
        dp.put_samples(["c", "d"], "train", bad)  # y's store holds int64, not float32
    got = dp.get_samples(["a", "b"], "train", ["x", "y"])
    assert got["x"].tolist() == [1.0, 2.0]  # the x store was not written: nothing evicted
    assert got["y"].tolist() == [10, 20]
    assert "field 'y' of partition 'train' (nothing written)" in str(refused.value)
    assert "BUF-011 key 'value': expected dtype int64, found dtype float32" in str(refused.value)
    with pytest.raises(KeyError, match=r"no value for sample ids \['c'\]"):
        dp.get_samples(["c"], "train", ["x"])


def test_an_id_whose_row_was_overwritten_raises_instead_of_reading_the_new_row() -> None:
    dp = NemoDataPlaneClient(RingBuffer, capacity=2, full="evict_oldest")
    dp.put_samples(["a", "b"], "train", TensorDict({"x": torch.tensor([1.0, 2.0])}, [2]))
    dp.put_samples(["c"], "train", TensorDict({"x": torch.tensor([3.0])}, [1]))  # over a's row
    with pytest.raises(KeyError, match=r"sample ids \['a'\] were evicted"):
        dp.get_samples(["a"], "train", ["x"])
    assert dp.get_samples(["c", "b"], "train", ["x"])["x"].tolist() == [3.0, 2.0]
    # Rewriting c writes the next row (b's): b is evicted, c reads its new value.
    dp.put_samples(["c"], "train", TensorDict({"x": torch.tensor([5.0])}, [1]))
    assert dp.get_samples(["c"], "train", ["x"])["x"].tolist() == [5.0]
    with pytest.raises(KeyError, match=r"sample ids \['b'\] were evicted"):
        dp.get_samples(["b"], "train", ["x"])
    dp.clear_samples(["a"], "train")  # forgetting an evicted id forgets its eviction too
    with pytest.raises(KeyError, match=r"field 'x': no value for sample ids \['a'\]") as e:
        dp.get_samples(["a"], "train", ["x"])
    assert "evicted" not in str(e.value)
    with pytest.raises(ValueError, match=r"at most capacity=2 ids per write, found 3"):
        dp.put_samples(["p", "q", "r"], "train", TensorDict({"x": torch.zeros(3)}, [3]))
    assert dp.get_samples(["c"], "train", ["x"])["x"].tolist() == [5.0]


def test_full_refuse_is_the_default_and_writes_nothing() -> None:
    from posttrain.adapters.nemo_rl.data_plane import DataPlaneFullError

    dp = NemoDataPlaneClient(RingBuffer, capacity=2)
    td = TensorDict({"x": torch.tensor([1.0, 2.0])}, [2])
    dp.put_samples(["a", "b"], "train", td)
    with pytest.raises(DataPlaneFullError, match=r"live ids 'a'"):
        dp.put_samples(["c"], "train", TensorDict({"x": torch.tensor([3.0])}, [1]))
    assert dp.get_samples(["a", "b"], "train", ["x"])["x"].tolist() == [1.0, 2.0]
    dp.put_samples(["a"], "train", TensorDict({"x": torch.tensor([5.0])}, [1]))  # a rewrite
    dp.clear_samples(["b"], "train")
    dp.put_samples(["c"], "train", TensorDict({"x": torch.tensor([3.0])}, [1]))
    assert dp.get_samples(["a", "c"], "train", ["x"])["x"].tolist() == [5.0, 3.0]


def test_reserve_then_commit_as_tq_replay_buffer() -> None:
    from posttrain.adapters.nemo_rl.data_plane import DataPlaneFullError
    from posttrain.adapters.nemo_rl.group_slots import NemoGroupSlots

    dp = NemoDataPlaneClient(RingBuffer, capacity=4)
    slots = NemoGroupSlots(dp, "train")
    g0 = slots.reserve(weight_version=0, target_step=1, group_id="g0")
    g1 = slots.reserve(weight_version=0, target_step=1)
    assert slots.ready_list == [False, False]
    with pytest.raises(ValueError, match="unknown group_id"):
        slots.commit("nope", ["x"], TensorDict({"x": torch.ones(1)}, [1]), 0, 0)
    lengths = TensorDict({"input_lengths": torch.tensor([3, 4])}, [2])
    meta = slots.commit(g1, ["g1_0", "g1_1"], lengths, 0, 1)  # commits land out of order
    assert slots.ready_list == [False, True]
    assert meta.sequence_lengths == [3, 4]
    assert slots.end_weight_list == [-1, 1]
    slots.commit(g0, ["g0_0", "g0_1"], lengths, 0, 1)
    g2 = slots.reserve(weight_version=1, target_step=2)
    with pytest.raises(DataPlaneFullError):  # the store is full of live rows: nothing kept
        slots.commit(g2, ["g2_0"], TensorDict({"input_lengths": torch.tensor([1])}, [1]), 1, 1)
    assert slots.ready_list == [True, True, False]
    assert slots.count_for_target_step(1) == 2
    # The ring writes FIFO: freeing g0's rows (written second) does not free the next row.
    assert slots.remove_group(g0, remove_in_dp=True) == 1
    with pytest.raises(DataPlaneFullError, match="'g1_0'"):
        slots.commit(g2, ["g2_0"], TensorDict({"input_lengths": torch.tensor([1])}, [1]), 1, 1)
    assert slots.remove_group(g1, remove_in_dp=True) == 1
    slots.commit(g2, ["g2_0"], TensorDict({"input_lengths": torch.tensor([1])}, [1]), 1, 1)
    got = dp.get_samples(["g2_0"], "train", ["input_lengths"])
    assert got["input_lengths"].tolist() == [1]
    with pytest.raises(IndexError):
        slots.remove([5], remove_in_dp=False)


def test_commit_refuses_ids_live_for_another_group_and_clears_only_its_own_rows() -> None:
    from posttrain.adapters.nemo_rl.group_slots import NemoGroupSlots

    dp = NemoDataPlaneClient(RingBuffer, capacity=8)
    slots = NemoGroupSlots(dp, "train")
    g0 = slots.reserve(weight_version=0, group_id="g0")
    g1 = slots.reserve(weight_version=0, group_id="g1")
    slots.commit(g0, ["s0", "s1"], TensorDict({"input_lengths": torch.tensor([3, 4])}, [2]), 0, 1)
    with pytest.raises(ValueError, match=r"found 's1' already live; nothing written"):
        slots.commit(
            g1, ["s1", "s2"], TensorDict({"input_lengths": torch.tensor([5, 6])}, [2]), 0, 1
        )
    # A write refused by the store's schema (int64 stored, float32 given) clears only its own ids.
    with pytest.raises(ContractViolation):
        slots.commit(g1, ["s2", "s3"], TensorDict({"input_lengths": torch.ones(2)}, [2]), 0, 1)
    assert dp.live_sample_ids("train") == {"s0", "s1"}
    got = dp.get_samples(["s0", "s1"], "train", ["input_lengths"])
    assert got["input_lengths"].tolist() == [3, 4]  # g0's rows untouched
    assert slots.ready_list == [True, False]
    slots.commit(g1, ["s2", "s3"], TensorDict({"input_lengths": torch.tensor([5, 6])}, [2]), 0, 1)
    assert dp.live_sample_ids("train") == {"s0", "s1", "s2", "s3"}


# -- task-mediated half: the call sequences of nemo_rl/data_plane (7ea279a) ------------------
# TQPolicy.prepare_step registers "train" with DP_TRAIN_FIELDS and the consumer tasks
# ["prev_lp", "ref_lp", "train"]; the async flow of data_plane/docs/data-plane-async-proposal.md
# then claims per task, fetches with get_data, waits on check_consumption_status and clears.
TASKS = ["prev_lp", "ref_lp", "train"]


def test_interface_contract_sequences_as_nemo_rls_own_tests() -> None:
    # tests/unit/data_plane/test_interface_contract.py, run on this client.
    dp = NemoDataPlaneClient(RingBuffer, capacity=8)
    dp.register_partition(partition_id="p", fields=["x"], num_samples=4, consumer_tasks=["read"])
    keys = ["a", "b", "c", "d"]
    dp.put_samples(
        sample_ids=keys, partition_id="p", fields=TensorDict({"x": torch.arange(4)}, [4])
    )
    out = dp.get_samples(sample_ids=keys, partition_id="p", select_fields=["x"])
    assert torch.equal(out["x"], torch.arange(4))
    dp.clear_samples(sample_ids=None, partition_id="p")
    with pytest.raises(KeyError):
        dp.get_samples(sample_ids=keys, partition_id="p", select_fields=["x"])

    dp.register_partition(partition_id="q", fields=["x"], num_samples=2, consumer_tasks=["read"])
    fields = TensorDict({"x": torch.tensor([10, 20])}, batch_size=[2])
    dp.put_samples(sample_ids=["a", "b"], partition_id="q", fields=fields)
    meta = dp.claim_meta(partition_id="q", task_name="read", required_fields=["x"], batch_size=2)
    assert meta.size == 2
    assert meta.task_name == "read"
    assert meta.fields == ["x"]
    assert dp.check_consumption_status("q", ["read"])

    from posttrain.adapters.nemo_rl.data_plane import KVBatchMeta

    with pytest.raises(ValueError, match="name the fields to read"):
        dp.get_data(KVBatchMeta(partition_id="q", task_name=None, sample_ids=["a"], fields=None))
    dp.close()
    dp.close()  # idempotent


def test_async_flow_claims_each_sample_once_per_task_when_its_fields_are_produced() -> None:
    dp = NemoDataPlaneClient(RingBuffer, capacity=16)
    dp.register_partition("train", ["input_ids", "prev_logprobs"], 6, TASKS, grpo_group_size=2)
    ids = [f"v0_p{p}_g{g}" for p in range(3) for g in range(2)]
    tags = [{"input_lengths": 3 + i, "weight_version": 0} for i in range(6)]
    dp.put_samples(ids[:4], "train", TensorDict({"input_ids": torch.arange(4)}, [4]), tags[:4])
    # prev_lp needs only the bulk: it claims what is there, in write order, up to batch_size
    meta = dp.claim_meta("train", "prev_lp", ["input_ids"], batch_size=3)
    assert meta.sample_ids == ids[:3]
    assert meta.sequence_lengths == [3, 4, 5]  # lifted from the input_lengths tags
    assert meta.tags == tags[:3]
    assert dp.claim_meta("train", "prev_lp", ["input_ids"], 8).sample_ids == [ids[3]]
    # nothing new for prev_lp: non-blocking gives an empty meta, blocking times out
    empty = dp.claim_meta("train", "prev_lp", ["input_ids"], 8, blocking=False)
    assert empty.sample_ids == []
    assert dp.get_data(empty).batch_size == torch.Size([0])
    with pytest.raises(TimeoutError, match="prev_lp"):
        dp.claim_meta("train", "prev_lp", ["input_ids"], 8, timeout_s=0.01)
    # train needs prev_logprobs too: nothing is claimable until that stage writes it
    assert (
        dp.claim_meta("train", "train", ["input_ids", "prev_logprobs"], 8, blocking=False).size == 0
    )
    dp.put_samples(ids[:2], "train", TensorDict({"prev_logprobs": torch.tensor([-1.0, -2.0])}, [2]))
    meta = dp.claim_meta("train", "train", ["input_ids", "prev_logprobs"], 8)
    assert meta.sample_ids == ids[:2]
    got = dp.get_data(meta)
    assert got["input_ids"].tolist() == [0, 1]
    assert got["prev_logprobs"].tolist() == [-1.0, -2.0]
    assert dp.get_data(meta, select_fields=["prev_logprobs"])["prev_logprobs"].shape == (2,)
    # the barrier: every task must have claimed every live sample
    assert not dp.check_consumption_status("train", TASKS)
    dp.claim_meta("train", "ref_lp", ["input_ids"], 8)
    dp.put_samples(ids[2:4], "train", TensorDict({"prev_logprobs": torch.zeros(2)}, [2]))
    dp.claim_meta("train", "train", ["input_ids", "prev_logprobs"], 8)
    assert dp.check_consumption_status("train", TASKS)
    assert not dp.check_consumption_status("train", [*TASKS, "unknown"])
    dp.clear_samples(ids[:4], "train")
    # re-registering for the next step keeps no stale claim of a cleared id
    dp.register_partition("train", ["input_ids", "prev_logprobs"], 6, TASKS)
    dp.put_samples(ids[:1], "train", TensorDict({"input_ids": torch.tensor([7])}, [1]))
    assert dp.claim_meta("train", "prev_lp", ["input_ids"], 8).sample_ids == ids[:1]


def test_a_blocked_claim_wakes_on_a_put_from_another_thread() -> None:
    import threading

    dp = NemoDataPlaneClient(RingBuffer, capacity=8)
    dp.register_partition("train", ["x"], 2, ["train"])
    started = threading.Event()
    out: list[Any] = []

    def consumer() -> None:
        started.set()
        out.append(dp.claim_meta("train", "train", ["x"], batch_size=2, timeout_s=30.0))

    t = threading.Thread(target=consumer, daemon=True)
    t.start()
    started.wait()
    dp.put_samples(["a", "b"], "train", TensorDict({"x": torch.ones(2)}, [2]))
    t.join(timeout=30)
    assert not t.is_alive()
    assert out[0].sample_ids == ["a", "b"]  # one put under one lock: both ready at once


def test_claims_name_what_is_not_registered() -> None:
    dp = NemoDataPlaneClient(RingBuffer, capacity=4)
    with pytest.raises(KeyError, match="register_partition first"):
        dp.claim_meta("train", "train", ["x"], 1, blocking=False)
    dp.register_partition("train", ["x"], 1, ["train"])
    with pytest.raises(KeyError, match="one of \\['train'\\]\\), found 'ref_lp'"):
        dp.claim_meta("train", "ref_lp", ["x"], 1, blocking=False)
    with pytest.raises(ValueError, match="batch_size"):
        dp.claim_meta("train", "train", ["x"], 0)


def test_async_slots_await_as_tq_replay_buffer() -> None:
    import asyncio

    from posttrain.adapters.nemo_rl.data_plane import DataPlaneFullError
    from posttrain.adapters.nemo_rl.group_slots import NemoAsyncGroupSlots

    dp = NemoDataPlaneClient(RingBuffer, capacity=4)
    slots = NemoAsyncGroupSlots(dp, "train")

    async def run() -> None:
        g0 = slots.reserve(weight_version=0, target_step=1, group_id="g0")
        g1 = slots.reserve(weight_version=0, target_step=2, group_id="g1")
        lengths = TensorDict({"input_lengths": torch.tensor([3, 4])}, [2])
        # commits of concurrent rollouts land in any order
        m1, m0 = await asyncio.gather(
            slots.commit(g1, ["g1_0", "g1_1"], lengths, 0, 1),
            slots.commit(g0, ["g0_0", "g0_1"], lengths, 0, 1),
        )
        assert (m0.task_name, m1.sequence_lengths) == ("train", [3, 4])
        assert slots.ready_list == [True, True]
        g2 = slots.reserve(weight_version=1, target_step=3)
        with pytest.raises(DataPlaneFullError):
            await slots.commit(
                g2, ["g2_0"], TensorDict({"input_lengths": torch.tensor([1])}, [1]), 1, 1
            )
        assert slots.ready_list == [True, True, False]
        with pytest.raises(ValueError, match="already live"):
            await slots.commit(
                g2, ["g0_0"], TensorDict({"input_lengths": torch.tensor([1])}, [1]), 1, 1
            )
        # a later target lends its finished group to a step that lost one
        assert slots.promote_ready_group(to_target_step=1) == 2
        assert slots.target_step_list == [1, 1, 3]
        assert await slots.remove_group(g0, remove_in_dp=True) == 1
        assert await slots.remove([0, 1], remove_in_dp=True) == 2
        assert dp.live_sample_ids("train") == set()
        with pytest.raises(ValueError, match="unknown group_id"):
            await slots.remove_group("g1")

    asyncio.run(run())


class _AsyncDataPlane:
    """A data plane whose methods are coroutines (or Ray-style ``.remote``), as NeMo-RL's actor.

    Each call first yields to the loop, so concurrent commits interleave at every await. When
    ``pause`` is set, ``put_samples`` signals ``entered`` and waits for ``release`` before it
    writes: the test decides what runs in between.
    """

    def __init__(self, *, remote: bool = False, pause: bool = False) -> None:
        self.inner = NemoDataPlaneClient(RingBuffer, capacity=8)
        self.pause = pause
        self.entered = asyncio.Event()
        self.release = asyncio.Event()
        for name in ("live_sample_ids", "put_samples", "clear_samples"):
            fn = getattr(self, "_" + name)
            setattr(self, name, _Remote(fn) if remote else fn)

    async def _live_sample_ids(self, partition_id: str, among: list[str] | None = None) -> Any:
        await asyncio.sleep(0)
        return self.inner.live_sample_ids(partition_id, among=among)

    async def _put_samples(self, **kwargs: Any) -> Any:
        await asyncio.sleep(0)
        if self.pause:
            self.entered.set()
            await self.release.wait()
        return self.inner.put_samples(**kwargs)

    async def _clear_samples(self, sample_ids: list[str] | None, partition_id: str) -> None:
        await asyncio.sleep(0)
        self.inner.clear_samples(sample_ids, partition_id)


class _Remote:
    """A Ray actor method stand-in: not callable itself, awaited through ``.remote``."""

    def __init__(self, fn: Any) -> None:
        self.remote = fn


def _lengths(n: int) -> TensorDict:
    return TensorDict({"input_lengths": torch.arange(1, n + 1)}, [n])


@pytest.mark.parametrize("remote", [False, True], ids=["coroutine", "ray_remote"])
def test_async_commit_of_live_ids_names_them_through_an_awaited_data_plane(remote: bool) -> None:
    from posttrain.adapters.nemo_rl.group_slots import NemoAsyncGroupSlots

    async def run() -> None:
        dp = _AsyncDataPlane(remote=remote)
        dp.inner.put_samples(["a", "b"], "train", _lengths(2))
        slots = NemoAsyncGroupSlots(dp, "train")  # type: ignore[arg-type]
        g = slots.reserve(weight_version=0, group_id="g")
        with pytest.raises(ValueError, match=r"found 'a', 'b' already live; nothing written"):
            await slots.commit(g, ["a", "b", "c"], _lengths(3), 0, 0)
        assert dp.inner.live_sample_ids("train") == {"a", "b"}
        assert slots.ready_list == [False]

    asyncio.run(run())


@pytest.mark.parametrize("remove_in_dp", [True, False])
def test_a_group_removed_while_its_rows_are_written_leaves_no_rows_live(
    remove_in_dp: bool,
) -> None:
    from posttrain.adapters.nemo_rl.group_slots import NemoAsyncGroupSlots

    async def run() -> None:
        dp = _AsyncDataPlane(pause=True)
        slots = NemoAsyncGroupSlots(dp, "train")  # type: ignore[arg-type]
        g = slots.reserve(weight_version=0, group_id="g")
        commit = asyncio.create_task(slots.commit(g, ["g_0", "g_1"], _lengths(2), 0, 1))
        await dp.entered.wait()
        # The slot goes while put_samples is suspended; then the write lands.
        assert await slots.remove_group(g, remove_in_dp=remove_in_dp) == 1
        dp.release.set()
        with pytest.raises(ValueError, match="removed while its rows were written"):
            await commit
        assert dp.inner.live_sample_ids("train") == set()
        assert slots.size() == 0

    asyncio.run(run())


def test_a_group_removed_and_reserved_again_mid_write_is_not_marked_by_the_old_commit() -> None:
    from posttrain.adapters.nemo_rl.group_slots import NemoAsyncGroupSlots

    async def run() -> None:
        dp = _AsyncDataPlane(pause=True)
        slots = NemoAsyncGroupSlots(dp, "train")  # type: ignore[arg-type]
        g = slots.reserve(weight_version=0, group_id="g")
        commit = asyncio.create_task(slots.commit(g, ["g_0"], _lengths(1), 0, 1))
        await dp.entered.wait()
        await slots.remove_group(g)
        slots.reserve(weight_version=5, group_id="g")  # a new rollout of the same group id
        dp.release.set()
        with pytest.raises(ValueError, match="removed while its rows were written"):
            await commit
        assert dp.inner.live_sample_ids("train") == set()
        assert (slots.ready_list, slots.start_weight_list) == ([False], [5])

    asyncio.run(run())


@pytest.mark.parametrize("same_group", [False, True], ids=["two_groups", "one_group"])
def test_concurrent_async_commits_of_the_same_ids_let_exactly_one_write(same_group: bool) -> None:
    from posttrain.adapters.nemo_rl.group_slots import NemoAsyncGroupSlots

    async def run() -> None:
        dp = _AsyncDataPlane()
        slots = NemoAsyncGroupSlots(dp, "train")  # type: ignore[arg-type]
        g0 = slots.reserve(weight_version=0, group_id="g0")
        g1 = g0 if same_group else slots.reserve(weight_version=0, group_id="g1")
        results = await asyncio.gather(
            slots.commit(g0, ["x", "y"], _lengths(2), 0, 1),
            slots.commit(g1, ["x", "y"], _lengths(2), 0, 2),
            return_exceptions=True,
        )
        errors = [r for r in results if isinstance(r, BaseException)]
        assert len(errors) == 1, results
        assert isinstance(errors[0], ValueError)
        assert "already live" in str(errors[0])
        assert slots.ready_list.count(True) == 1
        assert dp.inner.live_sample_ids("train") == {"x", "y"}

    asyncio.run(run())
