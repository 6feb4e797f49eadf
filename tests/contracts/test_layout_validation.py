"""The LLM layout v1 key contract: one clear ContractViolation per bad layout (LAY-*)."""

from __future__ import annotations

import pytest
import torch
from tensordict import LazyStackedTensorDict, TensorDict

from posttrain.contracts import LLM_LAYOUT_V1, ContractViolation
from posttrain.testing import llm_batch

K = LLM_LAYOUT_V1.key


def _one(td: TensorDict, **kw: object) -> ContractViolation:
    with pytest.raises(ContractViolation) as info:
        LLM_LAYOUT_V1.validate_batch(td, **kw)  # type: ignore[arg-type]
    assert len(info.value.violations) == 1, str(info.value)
    return info.value


def test_valid_batch_passes_metadata_and_deep_checks() -> None:
    td = llm_batch(4, 8)
    assert LLM_LAYOUT_V1.violations(td) == []
    assert LLM_LAYOUT_V1.violations(td, deep=True, strict=True) == []


def test_missing_key_names_key_and_id() -> None:
    e = _one(llm_batch(4, 8).exclude(K("attention_mask")))
    assert e.requirement_ids == ["LAY-001"]
    assert "('masks', 'all_attention_mask')" in str(e)
    assert "no such key" in str(e)


def test_optional_field_required_by_consumer() -> None:
    td = llm_batch(4, 8).exclude(K("advantage"))
    assert LLM_LAYOUT_V1.violations(td) == []
    e = _one(td, require=("advantage",))
    assert "LAY-001 key 'advantage'" in str(e)


def test_extra_dims_rejected() -> None:
    td = llm_batch(4, 8)
    td.set(K("tokens"), td.get(K("tokens")).unsqueeze(-1), inplace=False)
    e = _one(td)
    assert e.requirement_ids == ["LAY-003"]
    assert "('tokens', 'full')" in str(e)
    assert "[4, 8, 1]" in str(e)
    assert "[*B, T]" in str(e)


def test_wrong_dtype_rejected_without_cast() -> None:
    td = llm_batch(4, 8)
    td.set(K("sample_log_probs"), td.get(K("sample_log_probs")).double())
    e = _one(td)
    assert str(e.violations[0]) == (
        "LAY-002 key ('log_probs', 'full'): expected dtype float32, found dtype float64"
    )


def test_non_bool_mask_rejected() -> None:
    td = llm_batch(4, 8)
    td.set(K("assistant_mask"), td.get(K("assistant_mask")).long())
    e = _one(td)
    assert e.requirement_ids == ["LAY-002"]
    assert "all_assistant_mask" in str(e)
    assert "expected dtype bool, found dtype int64" in str(e)


def test_assistant_mask_outside_attention_mask_rejected_when_deep() -> None:
    td = llm_batch(4, 8)
    asst = td.get(K("assistant_mask")).clone()
    asst[0, -1] = True
    td.set(
        K("attention_mask"),
        td.get(K("attention_mask")).clone().index_fill_(1, torch.tensor([7]), False),
    )
    td.set(K("assistant_mask"), asst)
    for name in ("sample_log_probs", "ref_log_probs"):  # finite where the new mask reads them
        td.set(K(name), td.get(K(name)).nan_to_num(-1.0))
    assert LLM_LAYOUT_V1.violations(td) == []  # metadata only by default
    e = _one(td, deep=True)
    assert e.requirement_ids == ["LAY-004"]
    assert "all_assistant_mask" in str(e)
    assert "1 position(s)" in str(e)


def test_log_probs_with_requires_grad_rejected() -> None:
    td = llm_batch(4, 8)
    td.set(K("sample_log_probs"), td.get(K("sample_log_probs")).requires_grad_())
    e = _one(td)
    assert e.requirement_ids == ["LAY-005"]
    assert "('log_probs', 'full')" in str(e)
    assert "requires_grad=True" in str(e)


def test_time_dims_must_agree_across_fields() -> None:
    td = llm_batch(4, 8)
    td.set(K("sample_log_probs"), torch.zeros(4, 9), inplace=False)
    e = _one(td)
    assert "T=8 as at key ('tokens', 'full')" in str(e)
    assert "(T=9)" in str(e)


def test_advantage_per_sequence_or_per_token() -> None:
    td = llm_batch(4, 8)
    td.set(K("advantage"), torch.zeros(4, 8))
    assert LLM_LAYOUT_V1.violations(td) == []
    td.set(K("advantage"), torch.zeros(4, 8, 2), inplace=False)
    assert _one(td).requirement_ids == ["LAY-003"]


def test_strict_rejects_unexpected_keys() -> None:
    td = llm_batch(4, 8).set("junk", torch.zeros(4))
    assert LLM_LAYOUT_V1.violations(td) == []
    e = _one(td, strict=True)
    assert e.requirement_ids == ["LAY-006"]
    assert "'junk'" in str(e)


def test_every_violation_reported_at_once() -> None:
    td = llm_batch(4, 8).exclude(K("tokens"))
    td.set(K("advantage"), torch.zeros(4, dtype=torch.float64))
    td.set(K("reward"), torch.zeros(4, 2))
    with pytest.raises(ContractViolation) as info:
        LLM_LAYOUT_V1.validate_batch(td, context="MyLoss")
    assert info.value.requirement_ids == ["LAY-001", "LAY-002", "LAY-003"]
    assert str(info.value).startswith("MyLoss: 3 contract violation(s)")


def test_remapped_keys() -> None:
    layout = LLM_LAYOUT_V1.remap({"tokens": "input_ids"})
    td = llm_batch(4, 8)
    td.rename_key_(K("tokens"), "input_ids")
    assert layout.violations(td) == []
    assert LLM_LAYOUT_V1.violations(td)[0].requirement == "LAY-001"
    with pytest.raises(KeyError, match="no field 'token'"):
        LLM_LAYOUT_V1.remap({"token": "x"})


def test_multiple_batch_dims() -> None:
    td = llm_batch(6, 8).reshape(2, 3)
    assert LLM_LAYOUT_V1.violations(td, deep=True) == []


def test_validation_reads_no_values() -> None:
    # Meta tensors have shapes and dtypes but no data: any pass over values would fail here.
    fields = {}
    for f in LLM_LAYOUT_V1.fields:
        dims = (256, 2048)[: len(f.shapes[0])]
        fields[f.key] = torch.empty(dims, dtype=getattr(torch, f.dtype), device="meta")
    td = TensorDict(fields, batch_size=[256])
    assert LLM_LAYOUT_V1.violations(td, strict=True) == []


def test_ragged_lazy_stack() -> None:
    items = [llm_batch(1, t, seed=t)[0] for t in (5, 7)]
    td = LazyStackedTensorDict.lazy_stack(items, 0)
    assert [v.requirement for v in LLM_LAYOUT_V1.violations(td)] == ["LAY-003"] * 5
    assert LLM_LAYOUT_V1.violations(td, ragged=True, deep=True) == []


def test_jagged_nested_tensor_needs_ragged() -> None:
    td = llm_batch(2, 6)
    toks = torch.nested.nested_tensor([torch.arange(3), torch.arange(5)], layout=torch.jagged)
    td2 = TensorDict({K("tokens"): toks}, batch_size=[2])
    layout = LLM_LAYOUT_V1.remap({})
    assert [v.requirement for v in layout.violations(td2)] == ["LAY-003", "LAY-001", "LAY-001"]
    assert [v.requirement for v in layout.violations(td2, ragged=True)] == ["LAY-001", "LAY-001"]
    assert LLM_LAYOUT_V1.violations(td) == []


def test_non_tensordict_input() -> None:
    with pytest.raises(TypeError, match="expected a TensorDict, found dict"):
        LLM_LAYOUT_V1.violations({"a": 1})


def test_a_batch_shaped_like_a_valid_one_is_still_checked_for_what_differs() -> None:
    # LLM_LAYOUT_V1.violations() remembers signatures of valid batches; anything a signature does not cover
    # (a changed dtype, requires_grad, a nested key moved, a non-tensor leaf) must still fail.
    td = llm_batch(4, 8)
    assert LLM_LAYOUT_V1.violations(td) == LLM_LAYOUT_V1.violations(td) == []
    grad = td.clone()
    grad.set(K("sample_log_probs"), grad.get(K("sample_log_probs")).requires_grad_())
    assert [v.requirement for v in LLM_LAYOUT_V1.violations(grad)] == ["LAY-005"]
    wide = td.clone()
    wide.set(K("sample_log_probs"), wide.get(K("sample_log_probs")).double())
    assert [v.requirement for v in LLM_LAYOUT_V1.violations(wide)] == ["LAY-002"]
    moved = td.clone()
    moved.set("tokens_full", moved.pop(K("tokens")))
    assert [v.requirement for v in LLM_LAYOUT_V1.violations(moved)] == ["LAY-001"]
    assert LLM_LAYOUT_V1.violations(td, strict=True) == []
    assert [
        v.requirement for v in LLM_LAYOUT_V1.violations(moved.exclude("tokens_full"), strict=True)
    ] == ["LAY-001"]
    extra = td.clone()
    extra.set("extra", torch.zeros(4))
    assert LLM_LAYOUT_V1.violations(extra) == []
    assert [v.requirement for v in LLM_LAYOUT_V1.violations(extra, strict=True)] == ["LAY-006"]
    tagged = td.clone()
    tagged.set_non_tensor("note", "a string leaf")
    assert [v.requirement for v in LLM_LAYOUT_V1.violations(tagged, strict=True)] == ["LAY-006"]


def test_the_remembered_signature_covers_layout_flags_and_nested_tensors() -> None:
    # The batch validated last is compared first; a different layout, flag or a nested
    # tensor (whose shape cannot be read) must still get the full check.
    td = llm_batch(4, 8)
    assert LLM_LAYOUT_V1.violations(td) == []
    renamed = LLM_LAYOUT_V1.remap({"tokens": ("tokens", "ids")})
    assert [v.requirement for v in renamed.violations(td)] == ["LAY-001"]
    assert [v.requirement for v in renamed.violations(td, strict=True)] == ["LAY-001", "LAY-006"]
    assert LLM_LAYOUT_V1.violations(td, require=["advantage"]) == []  # type: ignore[arg-type]  # a list too
    nested = td.clone()
    parts = [torch.zeros(n) for n in (2, 3, 4, 5)]
    nested.set("strided", torch.nested.nested_tensor(parts))
    assert [v.requirement for v in LLM_LAYOUT_V1.violations(nested, strict=True)] == ["LAY-006"]
    assert LLM_LAYOUT_V1.violations(td) == []


def test_any_float_lets_other_float_dtypes_through_and_nothing_else() -> None:
    td = llm_batch(2, 6)
    td.set(("log_probs", "full"), td.get(("log_probs", "full")).bfloat16())
    td.set(("next", "reward"), td.get(("next", "reward")).double())
    assert [v.requirement for v in LLM_LAYOUT_V1.violations(td)] == ["LAY-002", "LAY-002"]
    assert LLM_LAYOUT_V1.violations(td, any_float=True) == []
    td.set(("tokens", "full"), td.get(("tokens", "full")).float())  # ids are not floats
    assert [str(v) for v in LLM_LAYOUT_V1.violations(td, any_float=True)] == [
        "LAY-002 key ('tokens', 'full'): expected dtype int64, found dtype float32"
    ]
