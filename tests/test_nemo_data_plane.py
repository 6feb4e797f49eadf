"""NeMo-RL's data-plane client (by-key part) over posttrain/TorchRL buffers."""

from __future__ import annotations

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
    assert set(meta.fields) == {"input_ids", "input_lengths", "token_mask", "sample_mask"}
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
    from posttrain.adapters.nemo_rl.data_plane import DataPlaneFullError, NemoGroupSlots

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
    from posttrain.adapters.nemo_rl.data_plane import NemoGroupSlots

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
