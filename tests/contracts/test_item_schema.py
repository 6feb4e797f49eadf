"""A ragged buffer's schema check: the column-by-column fast path accepts exactly what the
full check accepts, and every bad lazy stack gets the full check's requirement id."""

from __future__ import annotations

from collections.abc import Callable

import pytest
import torch
from tensordict import LazyStackedTensorDict, TensorDict, TensorDictBase

from posttrain.contracts.schema import ItemSchema, _StackPlan
from posttrain.contracts.validation import ContractViolation
from posttrain.testing import ragged_llm_batch

LENGTHS = [5, 7, 6, 9]


def _schema() -> ItemSchema:
    return ItemSchema.of(ragged_llm_batch(LENGTHS), ragged=True)


def _plan(s: ItemSchema) -> _StackPlan:
    assert s._stack_plan is not None
    return s._stack_plan


def _with(change: Callable[[TensorDictBase], None], item: int = 2) -> LazyStackedTensorDict:
    items = [x.clone() for x in ragged_llm_batch([8, 4, 10, 6], seed=1).tensordicts]
    change(items[item])
    return LazyStackedTensorDict.lazy_stack(items, 0)


def test_a_good_stack_takes_the_fast_path() -> None:
    s = _schema()
    good = ragged_llm_batch([8, 4, 10, 6], seed=1)
    assert _plan(s).matches(good)
    assert s.validated_leaves(good) == {}
    assert s.violations(good) == []


BAD: dict[str, tuple[Callable[[TensorDictBase], None], list[str]]] = {
    "missing key in one item": (lambda x: x.del_("advantage"), ["BUF-009"]),
    "missing nested key in one item": (
        lambda x: x.del_(("masks", "all_assistant_mask")),
        ["BUF-009"],
    ),
    "extra key in one item": (lambda x: x.set("extra", torch.zeros(())), ["BUF-010"]),
    "extra nested key in one item": (
        lambda x: x.set(("next", "extra"), torch.zeros(())),
        ["BUF-010"],
    ),
    "wrong dtype in one item": (
        lambda x: x.set("advantage", x.get("advantage").double()),
        ["BUF-011"],
    ),
    "scalar made a vector": (lambda x: x.set("advantage", torch.zeros(3)), ["BUF-012"]),
    "tokens made 2-d": (
        lambda x: x.set(("tokens", "full"), x.get(("tokens", "full")).unsqueeze(-1)),
        ["BUF-012"],
    ),
    "mask shorter than its tokens": (
        lambda x: x.set(
            ("masks", "all_attention_mask"), x.get(("masks", "all_attention_mask"))[:-1]
        ),
        ["BUF-012"],
    ),
    "a mask made [1, T]: as many elements as the tokens": (
        lambda x: x.set(
            ("masks", "all_attention_mask"), x.get(("masks", "all_attention_mask")).unsqueeze(0)
        ),
        ["BUF-012"],
    ),
    "a non-tensor leaf": (lambda x: x.set_non_tensor("advantage", "high"), ["BUF-011"]),
    "a per-token float leaf that requires grad": (
        lambda x: x.set(
            ("next", "ref_log_probs", "full"),
            x.get(("next", "ref_log_probs", "full")).requires_grad_(),
        ),
        ["LAY-005"],
    ),
    "a scalar float leaf that requires grad": (
        lambda x: x.set("advantage", x.get("advantage").requires_grad_()),
        ["LAY-005"],
    ),
    "a leaf on meta": (
        lambda x: x.set(("tokens", "full"), x.get(("tokens", "full")).to("meta")),
        ["BUF-011"],
    ),
    "a sparse leaf": (
        lambda x: x.set(("log_probs", "full"), x.get(("log_probs", "full")).to_sparse()),
        ["BUF-011"],
    ),
}


def test_the_fast_path_reads_requires_grad_only_where_the_dtype_allows_it() -> None:
    # The fast path skips requires_grad on integer and bool columns: torch refuses it there
    # by every route (the attribute, requires_grad_, Parameter, .data).
    plan = _plan(_schema())
    skipped = [c[1] for c in plan.cols if not c[4]]
    assert {torch.int64, torch.bool} <= set(skipped)
    for dtype in skipped:
        t = torch.zeros(3, dtype=dtype)
        with pytest.raises(RuntimeError, match="floating point"):
            t.requires_grad_()
        with pytest.raises(RuntimeError, match="floating point"):
            torch.nn.Parameter(t)
        f = torch.zeros(3, requires_grad=True)
        with pytest.raises(RuntimeError, match="floating point"):
            f.data = t
    assert all(c[1].is_floating_point for c in plan.cols if c[4])


@pytest.mark.parametrize("name", list(BAD))
def test_every_bad_stack_misses_the_fast_path_and_fails_the_full_check(name: str) -> None:
    change, ids = BAD[name]
    s = _schema()
    bad = _with(change)
    assert not _plan(s).matches(bad)
    with pytest.raises(ContractViolation) as info:
        s.validated_leaves(bad)
    assert info.value.requirement_ids == ids, str(info.value)


def test_a_key_in_some_items_only_is_named_with_the_items() -> None:
    bad = _with(lambda x: x.set("extra", torch.zeros(())), item=1)
    with pytest.raises(ContractViolation) as info:
        _schema().validated_leaves(bad)
    (v,) = info.value.violations
    assert (v.key, v.requirement) == (("extra",), "BUF-010")
    assert v.found == "an extra key (missing in item(s) 0, 2, 3: held by the others)"
    missing = _with(lambda x: x.del_("group_id"), item=3)
    (v,) = _schema().violations(missing)
    assert (v.key, v.found) == (("group_id",), "missing in item(s) 3")
    with pytest.raises(ContractViolation, match=r"BUF-009 key 'group_id'.*missing in item"):
        ItemSchema.of(missing, ragged=True)


def test_unusual_stacks_take_the_full_path_and_are_accepted_as_before() -> None:
    s = _schema()
    items = list(ragged_llm_batch([8, 4], seed=1).tensordicts)
    param = items[0].clone()
    param.set("advantage", torch.nn.Parameter(torch.zeros(()), requires_grad=False))
    stacked = LazyStackedTensorDict.lazy_stack([param, items[1]], 0)
    assert not _plan(s).matches(stacked)
    assert s.validated_leaves(stacked) == {}
    flat = ItemSchema.of(
        LazyStackedTensorDict.lazy_stack([TensorDict({"x": torch.zeros(n)}) for n in (2, 3)], 0),
        ragged=True,
    )
    nested = torch.nested.nested_tensor([torch.zeros(2), torch.zeros(3)])
    odd = LazyStackedTensorDict.lazy_stack(
        [TensorDict({"x": torch.zeros(4)}), TensorDict({"x": nested})], 0
    )
    assert not _plan(flat).matches(odd)
    with pytest.raises(ContractViolation, match=r"BUF-011 key 'x'.*a nested tensor"):
        flat.validated_leaves(odd)


def test_a_fixed_schema_reads_a_lazy_stack_dense() -> None:
    same = ragged_llm_batch([6, 6, 6])
    s = ItemSchema.of(same)
    assert _plan(s).matches(same)
    leaves = s.validated_leaves(same)
    assert leaves[("tokens", "full")].shape == (3, 6)
    with pytest.raises(ContractViolation, match="BUF-012"):
        s.validated_leaves(ragged_llm_batch([6, 7, 6]))


def test_mixed_numbers_of_dims_are_a_shape_error_on_the_first_write_too() -> None:
    items = [x.clone() for x in ragged_llm_batch([5, 6]).tensordicts]
    items[1].set("advantage", torch.zeros(2))
    with pytest.raises(ContractViolation) as info:
        ItemSchema.of(LazyStackedTensorDict.lazy_stack(items, 0), ragged=True)
    assert info.value.requirement_ids == ["BUF-012"], str(info.value)


@pytest.mark.parametrize("lengths", [[6, 6, 6], [4, 5], [4], [9, 4, 9, 4]])
def test_what_the_fast_path_accepts_the_full_check_accepts(lengths: list[int]) -> None:
    s = _schema()
    stack = ragged_llm_batch(lengths, seed=2)
    assert _plan(s).matches(stack)
    assert s.violations(stack) == []
