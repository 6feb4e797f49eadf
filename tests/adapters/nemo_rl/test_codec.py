"""NeMo-RL batch codec against the vectors NeMo-RL's own code produced (../shared/vectors).

nemo_rl is not installable here (the package index holds a 0.0.0 placeholder): these tests pin
posttrain's codec to outputs of NeMo-RL's code at commit 7ea279a. Where nemo_rl imports, the
last test also runs NeMo-RL's own BatchedDataDict on the same inputs.
"""

from __future__ import annotations

import json
from typing import Any

import pytest
import torch

from posttrain.adapters.nemo_rl.mirror.batching import (
    flatten_message_logs,
    from_batches,
    shard_by_batch_size,
)
from posttrain.adapters.nemo_rl.train_data import NemoFormatError, from_layout, to_layout
from posttrain.adapters.nemo_rl.wire import (
    layout_to_wire,
    materialize,
    pack_jagged_fields,
    wire_to_layout,
)
from posttrain.contracts import ContractViolation
from posttrain.contracts.layout import LLM_LAYOUT_V1
from posttrain.testing import llm_batch, ragged_llm_batch
from tests.paths import DATA, ROOT

K = LLM_LAYOUT_V1.key
# A verbatim copy of ../shared/vectors/nemo_rl.json (CI clones the project alone).
VECTORS = DATA / "nemo_rl.json"
SHARED = ROOT.parent / "shared" / "vectors" / "nemo_rl.json"
V: dict[str, Any] = json.loads(VECTORS.read_text())


def test_the_committed_vectors_are_the_shared_ones() -> None:
    if not SHARED.exists():
        pytest.skip("../shared is not next to this checkout (a CI clone)")
    assert json.loads(SHARED.read_text()) == V


def _train_data() -> dict[str, torch.Tensor]:
    """The clipped_pg_loss vector's data as NeMo-RL holds it (dtypes of grpo.py)."""
    d = V["clipped_pg_loss"]["data"]
    ids = torch.tensor(d["input_ids"], dtype=torch.int64)
    return {
        "input_ids": ids,
        "input_lengths": torch.tensor([5, 6], dtype=torch.int32),
        "token_mask": torch.tensor(d["token_mask"], dtype=torch.int64),
        "sample_mask": torch.tensor(d["sample_mask"], dtype=torch.float32),
        "advantages": torch.tensor(d["advantages"], dtype=torch.float32),
        "generation_logprobs": torch.tensor(d["generation_logprobs"], dtype=torch.float32),
        "prev_logprobs": torch.tensor(d["prev_logprobs"], dtype=torch.float32),
        "reference_policy_logprobs": torch.tensor(
            d["reference_policy_logprobs"], dtype=torch.float32
        ),
    }


def _same(a: dict[str, Any], b: dict[str, Any]) -> None:
    assert sorted(a) == sorted(b)
    for k in a:
        x, y = a[k], b[k]
        assert isinstance(x, torch.Tensor), k
        assert x.dtype == y.dtype, (k, x.dtype, y.dtype)
        assert torch.equal(x, y), k


def test_vector_from_batches() -> None:
    v = V["from_batches"]
    batches = [
        {
            "input_ids": torch.tensor(b["input_ids"]),
            "input_lengths": torch.tensor(b["input_lengths"]),
            "idx": list(b["idx"]),
        }
        for b in v["batches"]
    ]
    out = from_batches(batches, v["pad_value_dict"])
    assert out["input_ids"].tolist() == v["expected"]["input_ids"]
    assert out["input_lengths"].tolist() == v["expected"]["input_lengths"]
    assert out["idx"] == v["expected"]["idx"]
    assert len(out["idx"]) == v["expected"]["size"]


def test_vector_shard_by_batch_size() -> None:
    v = V["shard_by_batch_size"]
    data = {k: torch.tensor(x) for k, x in v["data"].items()}
    assert [s["x"].tolist() for s in shard_by_batch_size(data, 2)] == v["shards_2"]
    four = shard_by_batch_size(data, 2, batch_size=4)
    assert [s["x"].tolist() for s in four] == v["shards_2_batch_size_4"]
    assert [s["problem_id"].tolist() for s in four] == [[0, 0, 2, 2], [1, 1, 3, 3]]


def test_vector_flatten_message_logs() -> None:
    v = V["flatten_message_logs"]
    out = flatten_message_logs(
        v["message_logs"],
        pad_value=v["pad_value"],
        make_sequence_length_divisible_by=v["make_sequence_length_divisible_by"],
    )
    e = v["expected"]
    assert out["token_ids"].tolist() == e["token_ids"]
    assert str(out["token_ids"].dtype) == f"torch.{e['token_ids_dtype']}"
    assert out["token_loss_mask"].tolist() == e["token_loss_mask"]
    torch.testing.assert_close(out["generation_logprobs"], torch.tensor(e["generation_logprobs"]))
    assert out["input_lengths"].tolist() == e["input_lengths"]
    assert str(out["input_lengths"].dtype) == f"torch.{e['input_lengths_dtype']}"


def test_flattened_logs_become_a_valid_layout_batch() -> None:
    v = V["flatten_message_logs"]
    flat = flatten_message_logs(v["message_logs"], make_sequence_length_divisible_by=4)
    data = {
        "input_ids": flat["token_ids"],
        "input_lengths": flat["input_lengths"],
        "token_mask": flat["token_loss_mask"],
        "generation_logprobs": flat["generation_logprobs"],
    }
    td = to_layout(data)
    assert LLM_LAYOUT_V1.violations(td) == []
    assert td.get(K("assistant_mask")).sum(-1).tolist() == [2, 4]


def test_vector_data_plane_wire_and_back() -> None:
    data = _train_data()
    wire = pack_jagged_fields(data, lengths=data["input_lengths"])
    assert wire.batch_size == torch.Size([2])
    assert [r.tolist() for r in wire["input_ids"].unbind()] == [
        [11, 12, 13, 21, 22],
        [11, 12, 14, 31, 32, 33],
    ]
    assert not wire["sample_mask"].is_nested
    assert not wire["input_lengths"].is_nested
    back = dict(materialize(wire, "padded"))
    assert back["input_ids"].shape == (2, 6)
    # materialize pads with 0 (NeMo-RL's default): equal on real tokens, 0 past each length.
    real = torch.arange(6) < data["input_lengths"][:, None]
    assert sorted(back) == sorted(data)
    for k, v in data.items():
        assert back[k].dtype == v.dtype, k
        if v.ndim == 2:
            assert torch.equal(back[k][real], v[real]), k
            assert (back[k][~real] == 0).all(), k
        else:
            assert torch.equal(back[k], v), k


def test_train_data_to_layout_and_back_is_lossless() -> None:
    data = _train_data()
    td = to_layout(data)
    assert LLM_LAYOUT_V1.violations(td) == []
    assert td.get(K("attention_mask")).sum(-1).tolist() == [5, 6]
    assert torch.equal(td.get(K("assistant_mask")), data["token_mask"].bool())
    assert torch.equal(td.get(K("sample_log_probs")), data["generation_logprobs"])
    assert torch.equal(td.get(("nemo", "prev_logprobs")), data["prev_logprobs"])
    _same(dict(from_layout(td)), data)


def test_nan_outside_writes_torchrl_padding_and_still_returns_nemo_zeros() -> None:
    data = _train_data()
    td = to_layout(data, nan_outside=True)
    lp = td.get(K("sample_log_probs"))
    assert torch.isnan(lp[~td.get(K("assistant_mask"))]).all()
    back = from_layout(td)
    assert torch.equal(back["generation_logprobs"], data["generation_logprobs"])


def test_layout_batches_left_padded_or_ragged_become_right_padded_train_data() -> None:
    td = llm_batch(4, 8)
    right = from_layout(td)
    left = td.clone()
    attn = td.get(K("attention_mask"))
    order = torch.sort(attn.to(torch.int8), dim=-1, stable=True).indices  # pads first
    for key, v in td.items(include_nested=True, leaves_only=True):
        if isinstance(v, torch.Tensor) and v.shape == attn.shape:
            left.set(key, v.gather(-1, order))
    from_left = from_layout(left)
    real = right["token_mask"].bool()
    for k in ("input_ids", "input_lengths", "token_mask"):
        assert torch.equal(from_left[k], right[k]), k
    assert torch.equal(from_left["generation_logprobs"][real], right["generation_logprobs"][real])
    ragged = from_layout(ragged_llm_batch([4, 7, 5]))
    assert ragged["input_ids"].shape == (3, 7)
    lengths = ragged["input_lengths"]
    assert (ragged["token_mask"].bool() <= (torch.arange(7) < lengths[:, None])).all()


def test_layout_defaults_for_fields_nemo_needs() -> None:
    out = from_layout(llm_batch(3, 6))
    assert torch.equal(out["sample_mask"], torch.ones(3))
    assert torch.equal(out["prev_logprobs"], out["generation_logprobs"])  # on-policy
    assert not torch.isnan(out["generation_logprobs"]).any()
    assert out["advantages"].shape == (3, 6)
    assert out["total_reward"].shape == (3,)


def test_ragged_layout_through_the_wire_format_and_back() -> None:
    src = ragged_llm_batch([4, 7, 5])
    wire = layout_to_wire(src)
    assert wire["input_ids"].is_nested
    back = wire_to_layout(wire)
    for a, b in zip(src.tensordicts, back.tensordicts, strict=True):
        n = int(a.get(K("attention_mask")).sum())
        assert torch.equal(b.get(K("tokens")), a.get(K("tokens"))[:n])
        assert torch.equal(b.get(K("assistant_mask")), a.get(K("assistant_mask"))[:n])
        assert b.get(K("attention_mask")).all()


@pytest.mark.parametrize(
    ("change", "message"),
    [
        (lambda d: d.pop("input_lengths"), "'input_lengths': expected a tensor, found NoneType"),
        (
            lambda d: d.update(input_ids=d["input_ids"].int()),
            "'input_ids': expected int64 \\(NeMo-RL's token ids\\), found torch.int32",
        ),
        (
            lambda d: d.update(input_lengths=d["input_lengths"].long()),
            "'input_lengths': expected int32, found torch.int64",
        ),
        (
            lambda d: d.update(input_lengths=torch.tensor([3, 6], dtype=torch.int32)),
            "'token_mask': rows \\[0\\] mark tokens beyond input_lengths",
        ),
        (
            lambda d: d.update(prev_logprobs=torch.zeros(3, 6)),
            "'prev_logprobs': expected a tensor with batch dim 2, found Tensor\\[3, 6\\]",
        ),
        (
            lambda d: d.update(generation_logprobs=torch.zeros(2, 6, dtype=torch.float64)),
            "'generation_logprobs': expected \\[2, 6\\] float32, found \\[2, 6\\] torch.float64",
        ),
    ],
)
def test_bad_nemo_data_is_refused_naming_the_key(change: Any, message: str) -> None:
    data = _train_data()
    change(data)
    with pytest.raises(NemoFormatError, match=message):
        to_layout(data)


def test_real_batched_data_dict_where_nemo_rl_imports() -> None:
    nemo = pytest.importorskip(
        "nemo_rl.distributed.batched_data_dict",
        reason="nemo_rl is not on the package index (0.0.0 placeholder); the vectors above "
        "pin its format instead",
    )
    data = nemo.BatchedDataDict(_train_data())
    _same(dict(from_layout(to_layout(data))), dict(data))


@pytest.mark.parametrize("leave_one_out", [True, False])
def test_vector_grpo_advantages(leave_one_out: bool) -> None:
    from posttrain.adapters.nemo_rl.mirror.advantages import grpo_advantages

    v = V["grpo_advantages"]
    out = grpo_advantages(v["prompt_rows"], v["rewards"], leave_one_out=leave_one_out)
    expected = v["leave_one_out"] if leave_one_out else v["no_leave_one_out"]
    for key, want in expected.items():
        torch.testing.assert_close(out[key], torch.tensor(want), atol=1e-5, rtol=0)


@pytest.mark.parametrize(
    ("data", "shards", "batch_size", "error", "message"),
    [
        ({"x": list(range(8))}, 0, None, ValueError, r"shards: expected a positive int, found 0"),
        ({"x": list(range(8))}, -2, None, ValueError, r"shards: expected a positive int, found -2"),
        (
            {"x": list(range(8))},
            2,
            -4,
            ValueError,
            r"batch_size: expected a positive int, found -4",
        ),
        ({"x": list(range(8))}, 2, 0, ValueError, r"batch_size: expected a positive int, found 0"),
        (
            {"x": list(range(8))},
            2.0,
            None,
            TypeError,
            r"shards: expected a positive int, found 2.0",
        ),
        ({}, 2, None, ValueError, r"data: expected at least one key, found an empty mapping"),
        ({"x": [1, 2], "y": [1]}, 1, None, ValueError, r"found lengths \{'x': 2, 'y': 1\}"),
    ],
)
def test_shard_by_batch_size_refuses_bad_arguments_naming_them(
    data: dict[str, Any], shards: Any, batch_size: Any, error: type[Exception], message: str
) -> None:
    with pytest.raises(error, match=message):
        shard_by_batch_size(data, shards, batch_size=batch_size)


def test_shard_by_batch_size_of_an_empty_batch_gives_empty_shards() -> None:
    out = shard_by_batch_size({"x": [], "t": torch.zeros(0, 3)}, 2)
    assert [s["x"] for s in out] == [[], []]
    assert [tuple(s["t"].shape) for s in out] == [(0, 3), (0, 3)]


@pytest.mark.parametrize(
    ("change", "message"),
    [
        (
            lambda td: td.exclude(K("attention_mask")),
            r"LAY-001 key \('masks', 'all_attention_mask'\): expected attention_mask "
            r"\(bool \[\*B, T\]\), found no such key",
        ),
        (
            lambda td: td.exclude(K("tokens")),
            r"LAY-001 key \('tokens', 'full'\): expected tokens \(int64 \[\*B, T\]\), "
            r"found no such key",
        ),
        (
            lambda td: td.set(K("tokens"), td.get(K("tokens")).float()),
            r"LAY-002 key \('tokens', 'full'\): expected dtype int64, found dtype float32",
        ),
        (
            lambda td: td.set(K("advantage"), torch.zeros(2, 3)),
            r"LAY-003 key 'advantage': expected \[\*B\] or \[\*B, T\] with T=6 .*found shape "
            r"\[2, 3\]",
        ),
    ],
    ids=["no-attention-mask", "no-tokens", "float-tokens", "advantage-2x3"],
)
def test_a_batch_off_the_layout_is_refused_naming_the_key(change: Any, message: str) -> None:
    td = change(llm_batch(2, 6))
    with pytest.raises(ContractViolation, match=message):
        from_layout(td)


def test_anything_but_a_tensordict_is_refused_by_from_layout() -> None:
    plain: Any = dict(llm_batch(2, 6).items(include_nested=True, leaves_only=True))
    with pytest.raises(NemoFormatError, match="td: expected an LLM-layout TensorDict, found dict"):
        from_layout(plain)


def test_shard_by_batch_size_takes_numpy_ints() -> None:
    import numpy as np

    data = {"x": list(range(8))}
    assert shard_by_batch_size(data, np.int64(2), np.int64(4)) == shard_by_batch_size(data, 2, 4)  # type: ignore[arg-type]
