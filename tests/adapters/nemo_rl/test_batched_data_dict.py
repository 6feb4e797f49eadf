"""The BatchedDataDict mirror against outputs of NeMo-RL's own class (7ea279a)."""

from __future__ import annotations

import json
from typing import Any

import pytest
import torch

from posttrain.adapters.nemo_rl.mirror.batched_data_dict import BatchedDataDict, SlicedDataDict
from tests.paths import DATA

V = json.loads((DATA / "nemo_rl_batched_data_dict.json").read_text())
_DT = {"torch.int64": torch.int64, "torch.float32": torch.float32}


def _dec(v: dict[str, Any]) -> Any:
    return torch.tensor(v["tensor"], dtype=_DT[v["dtype"]]) if "tensor" in v else v["list"]


def _same(got: Any, want: dict[str, Any]) -> None:
    assert type(got).__name__ == want["type"]
    assert list(got.keys()) == list(want["data"])
    for k, v in want["data"].items():
        w = _dec(v)
        if isinstance(w, torch.Tensor):
            assert isinstance(got[k], torch.Tensor), k
            assert got[k].dtype == w.dtype, k
            assert torch.equal(got[k], w), k
        else:
            assert got[k] == w, k


def _base() -> BatchedDataDict:
    return BatchedDataDict({k: _dec(v) for k, v in V["base"]["data"].items()})


def test_from_batches_is_a_classmethod_matching_nemo_rl() -> None:
    v = V["from_batches"]
    batches = [{k: _dec(x) for k, x in b.items()} for b in v["batches"]]
    out = BatchedDataDict.from_batches(batches, pad_value_dict=v["pad_value_dict"])
    assert isinstance(out, BatchedDataDict)
    _same(out, v["out"])  # a key missing from the empty batch; "mixed" is 1-D with 2-D
    assert isinstance(SlicedDataDict.from_batches(batches), SlicedDataDict)
    with pytest.raises(KeyError, match="expected in every non-empty batch"):
        BatchedDataDict.from_batches([{"a": torch.tensor([1])}, {"b": torch.tensor([2])}])
    assert V["from_batches_missing"]["error"] == "KeyError"


def test_row_methods_match_nemo_rl() -> None:
    d = _base()
    _same(d.chunk(1, 3), V["chunk_1_3"])
    _same(d.slice(1, 4), V["slice_1_4"])
    _same(d.select_indices([4, 0, 2]), V["select_indices_4_0_2"])
    rep = BatchedDataDict({"x": torch.tensor([[1, 2], [3, 4]]), "o": [{"k": 1}, {"k": 2}]})
    _same(rep.repeat_interleave(2), V["repeat_interleave_2"])
    for got, want in zip(d.make_microbatch_iterator(3), V["microbatches_3"], strict=True):
        _same(got, want)
    assert d.size == V["size"]
    assert d.to("cpu") is d
    with pytest.raises(ValueError, match="microbatch_size: expected a divisor of the batch's"):
        next(d.make_microbatch_iterator(4))


@pytest.mark.parametrize(
    ("key", "data", "shards", "kwargs"),
    [
        ("shard_2_bs4", {"id": list(range(8)), "t": torch.arange(8)}, 2, {"batch_size": 4}),
        (
            "shard_uneven_2",
            {"id": list(range(5)), "t": torch.arange(5)},
            2,
            {"allow_uneven_shards": True},
        ),
        (
            "shard_uneven_3",
            {"id": list(range(5)), "t": torch.arange(5)},
            3,
            {"allow_uneven_shards": True},
        ),
        ("shard_uneven_4", {"id": list(range(6))}, 4, {"allow_uneven_shards": True}),
    ],
)
def test_shard_by_batch_size_matches_nemo_rl(
    key: str, data: dict[str, Any], shards: int, kwargs: dict[str, Any]
) -> None:
    out = BatchedDataDict(data).shard_by_batch_size(shards, **kwargs)
    assert isinstance(out, list)
    for got, want in zip(out, V[key], strict=True):
        _same(got, want)


def test_dynamic_batching_matches_nemo_rl() -> None:
    v = V["dynamic"]
    lens = torch.tensor([5, 1, 7, 3, 8, 2, 6, 4])
    d = BatchedDataDict(
        {"input_ids": torch.arange(64).reshape(8, 8), "input_lengths": lens, "id": list(range(8))}
    )
    out = d.shard_by_batch_size(
        v["shards"], batch_size=v["batch_size"], dynamic_batching_args=v["args"]
    )
    assert isinstance(out, tuple)
    shards, idx = out
    assert idx == v["sorted_indices"]
    for got, want in zip(shards, v["out"], strict=True):
        _same(got, {"type": want["type"], "data": want["data"]})
        assert got.micro_batch_indices == want["micro_batch_indices"]
        assert got.micro_batch_lengths == want["micro_batch_lengths"]
    shapes = [
        [
            list(m["input_ids"].shape)
            for m in shards[0].get_batch(g, 2).make_microbatch_iterator_with_dynamic_shapes()
        ]
        for g in range(2)
    ]
    assert shapes == v["mb_shapes_shard0_gb"]


def test_sequence_packing_is_refused_not_ignored() -> None:
    with pytest.raises(NotImplementedError, match="sequence_packing_args"):
        BatchedDataDict({"x": [1, 2]}).shard_by_batch_size(
            2,
            sequence_packing_args={"max_tokens_per_microbatch": 4},
        )


def test_reorder_data_moves_row_i_to_its_position_and_refuses_non_permutations() -> None:
    b = BatchedDataDict({"t": torch.tensor([10, 11, 12, 13]), "s": ["a", "b", "c", "d"]})
    b.reorder_data([2, 0, 3, 1])  # row 0 -> 2, row 1 -> 0, row 2 -> 3, row 3 -> 1
    assert b["t"].tolist() == [11, 13, 10, 12]
    assert b["s"] == ["b", "d", "a", "c"]
    with pytest.raises(ValueError, match="permutation of range"):
        b.reorder_data([0, 0, 1, 2])


def test_micro_batch_plan_keeps_rows_times_longest_within_the_budget() -> None:
    from posttrain.adapters.nemo_rl.mirror.batched_data_dict import _plan_micro_batches

    assert _plan_micro_batches([4, 4, 8, 8, 16], 16, 4) == ([[0, 2], [2, 4], [4, 5]], [4, 8, 16])
    assert _plan_micro_batches([], 16, 4) == ([[0, 0]], [0])
    with pytest.raises(ValueError, match="found 16 for a row of 20"):
        _plan_micro_batches([4, 20], 16, 4)


def test_stacking_rule_casts_the_pad_per_value_and_promotes_like_concatenation() -> None:
    # 3+ dims: each value padded with the pad in its own dtype, then concatenated (promoted);
    # 2-D: rows padded in the first value's dtype. The expected tensors are built by hand.
    from posttrain.adapters.nemo_rl.mirror.batching import stack_values

    a = torch.tensor([[[1], [2]]])  # int64 [1, 2, 1]
    b = torch.tensor([[[0.5], [1.5], [2.5]]])  # float32 [1, 3, 1]
    got = stack_values([a, b], pad=-1.7)
    assert got.dtype == torch.float32
    assert got[:, :, 0].tolist() == [[1.0, 2.0, -1.0], [0.5, 1.5, 2.5]]  # -1.7 -> -1 as int64
    rows = stack_values([torch.tensor([[1, 2]]), torch.tensor([[1.5, 2.0, 3.0]])], pad=0.7)
    assert rows.dtype == torch.int64
    assert rows.tolist() == [[1, 2, 0], [1, 2, 3]]
    assert stack_values([[1], [2, 3]]) == [1, 2, 3]
    with pytest.raises(NotImplementedError, match="tuple"):
        stack_values([(1,), (2,)])


def test_refusals_name_the_argument_what_was_expected_and_what_was_found() -> None:
    d = BatchedDataDict({"x": torch.arange(6), "s": list("abcdef")})
    with pytest.raises(ValueError, match=r"chunk rank: expected below 2 .*found 2"):
        d.chunk(2, 3)  # NeMo-RL's bound: rows per part, not parts
    with pytest.raises(ValueError, match=r"chunk chunks: expected a divisor .*6 rows, found 4"):
        d.chunk(0, 4)
    with pytest.raises(ValueError, match=r"batch_size: expected a divisor .*6 rows, found 4"):
        d.shard_by_batch_size(2, batch_size=4)
    with pytest.raises(ValueError, match=r"shards: expected a divisor of batch_size 6, found 4"):
        d.shard_by_batch_size(4)
    with pytest.raises(ValueError, match=r"batch_size: expected None .*, found 6"):
        d.shard_by_batch_size(2, batch_size=6, allow_uneven_shards=True)
    with pytest.raises(ValueError, match="expected at most one of them, found both"):
        d.shard_by_batch_size(2, dynamic_batching_args={}, sequence_packing_args={})
    with pytest.raises(
        ValueError, match=r"batch keys: expected one row count, found \{'x': 6, 'y': 2\}"
    ):
        BatchedDataDict({"x": torch.arange(6), "y": [1, 2]}).chunk(0, 1)
    with pytest.raises(ValueError, match=r"slice end: expected at most key 'x''s 6 rows, found 7"):
        d.slice(0, 7)
    with pytest.raises(TypeError, match=r"select_indices key 'z': expected a tensor or a list"):
        BatchedDataDict({"z": (1, 2)}).select_indices([0])
