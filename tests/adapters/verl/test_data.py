"""verl's DataProto through the layout codec (posttrain/adapters/verl/data.py), both ways.

The DataProtos are built with verl 0.9.1's own constructors and helpers (``DataProto.
from_single_dict``, ``repeat``, ``concat``, ``get_response_mask``,
``compute_position_id_with_mask``) the way its HF rollout builds one: prompts left-padded,
responses right-padded up to their EOS.
"""

from __future__ import annotations

import uuid
from typing import Any

import numpy as np
import pytest
import torch

from posttrain.adapters.verl.data import VerlFormatError, from_layout, to_layout
from posttrain.contracts.layout import LLM_LAYOUT_V1
from posttrain.contracts.validation import ContractViolation
from posttrain.testing import llm_batch, ragged_llm_batch

verl_protocol = pytest.importorskip("verl.protocol")
DataProto = verl_protocol.DataProto
from verl.utils import model as verl_model  # noqa: E402
from verl.utils import torch_functional as verl_f  # noqa: E402

# verl is untyped: its helpers are called through Any.
compute_position_id_with_mask: Any = verl_model.compute_position_id_with_mask
get_response_mask: Any = verl_f.get_response_mask

EOS, PAD = 2, 0


def rollout(
    prompt_lengths: list[int], p: int = 5, r: int = 6, group: int = 2, seed: int = 0
) -> Any:
    """A GRPO batch as verl's trainer holds it before the update: ``group`` answers a prompt."""
    g = torch.Generator().manual_seed(seed)
    n = len(prompt_lengths)
    pattn = (torch.arange(p) >= p - torch.tensor(prompt_lengths)[:, None]).long()
    prompts = torch.where(pattn.bool(), torch.randint(3, 100, (n, p), generator=g), PAD)
    gen = DataProto.from_single_dict(
        {
            "input_ids": prompts,
            "attention_mask": pattn,
            "uid": np.array([str(uuid.UUID(int=i)) for i in range(n)], dtype=object),
            # Ragged token lists, as verl keeps each prompt's unpadded ids.
            "raw_prompt_ids": _ragged_objects([[i + 3] * (i % 3 + 1) for i in range(n)]),
        },
        meta_info={"eos_token_id": EOS, "pad_token_id": PAD},
    ).repeat(group, interleave=True)
    b = n * group
    resp = torch.randint(3, 100, (b, r), generator=g)
    ends = torch.randint(0, r + 1, (b,), generator=g)  # r: no EOS, cut at the length limit
    hit = ends < r
    resp[hit.nonzero()[:, 0], ends[hit]] = EOS
    rmask = get_response_mask(response_id=resp, eos_token=EOS, dtype=torch.int64)
    resp = torch.where(rmask.bool(), resp, PAD)
    attn = torch.cat([gen.batch["attention_mask"], rmask], 1)
    lp = -torch.rand(b, r, generator=g) * rmask
    scores = torch.zeros(b, r)
    last = rmask.sum(-1) - 1
    scores[torch.arange(b), last] = torch.rand(b, generator=g).round()
    out = DataProto.from_single_dict(
        {
            "prompts": gen.batch["input_ids"],
            "responses": resp,
            "input_ids": torch.cat([gen.batch["input_ids"], resp], 1),
            "attention_mask": attn,
            "position_ids": compute_position_id_with_mask(attn),
            "response_mask": rmask,
            "old_log_probs": lp,
            "ref_log_prob": lp - 0.125,
            "rollout_log_probs": lp + 0.01,
            "token_level_scores": scores,
            "token_level_rewards": scores.clone(),
            "advantages": torch.randn(b, r, generator=g) * rmask,
            "returns": torch.randn(b, r, generator=g) * rmask,
            "__do_sample__": np.ones(b, dtype=bool),
        },
        meta_info={"temperature": 1.0, "global_token_num": attn.sum(-1).tolist()},
    )
    out.non_tensor_batch.update(gen.non_tensor_batch)
    out.meta_info.update(gen.meta_info)
    return out


def _ragged_objects(rows: list[list[int]]) -> np.ndarray:
    arr = np.empty(len(rows), dtype=object)
    for i, x in enumerate(rows):
        arr[i] = x
    return arr


def assert_same(a: Any, b: Any) -> None:
    assert list(a.batch.keys()) == list(b.batch.keys())
    for key in a.batch.keys():  # noqa: SIM118 (iterating a TensorDict yields its rows)
        x, y = a.batch[key], b.batch[key]
        assert x.dtype == y.dtype, key
        assert torch.equal(x, y), key
    assert list(a.non_tensor_batch) == list(b.non_tensor_batch)
    for key, x in a.non_tensor_batch.items():
        y = b.non_tensor_batch[key]
        assert x.dtype == y.dtype, key
        assert x.shape == y.shape, key
        assert [list(v) if isinstance(v, list) else v for v in x.tolist()] == y.tolist(), key
    assert a.meta_info == b.meta_info


def test_round_trip_is_lossless() -> None:
    proto = rollout([3, 5, 2, 4])
    td = to_layout(proto)
    LLM_LAYOUT_V1.validate_batch(
        td, require=("sample_log_probs", "ref_log_probs", "advantage", "reward")
    )
    assert_same(from_layout(td), proto)


def test_round_trip_after_verl_concat_and_without_response_mask() -> None:
    parts = [rollout([3, 5, 2, 4], seed=1), rollout([1, 5, 5, 2], seed=2)]
    for part in parts:  # concat refuses meta_info that differs between its parts
        part.meta_info.pop("global_token_num")
    proto = DataProto.concat(parts)
    assert_same(from_layout(to_layout(proto)), proto)
    bare = proto.select(batch_keys=["input_ids", "attention_mask", "responses"])
    back = from_layout(to_layout(bare))
    assert_same(back, bare)  # no response_mask added: the keys and their order are kept


def test_layout_side_carries_verl_meaning() -> None:
    proto = rollout([3, 5, 2, 4])
    b = proto.batch
    td = to_layout(proto)
    p = b["prompts"].shape[1]
    k = LLM_LAYOUT_V1.key
    assert torch.equal(td[k("assistant_mask")][:, p:], b["response_mask"].bool())
    assert not td[k("assistant_mask")][:, :p].any()
    # Same alignment: response column j is sequence position P + j.
    assert torch.equal(td[k("sample_log_probs")][:, p:], b["old_log_probs"])
    assert torch.equal(td[k("ref_log_probs")][:, p:], b["ref_log_prob"])
    assert torch.equal(td[k("reward")], b["token_level_rewards"].sum(-1))
    assert td[k("group_id")].tolist() == [0, 0, 1, 1, 2, 2, 3, 3]  # uid groups, in order
    assert torch.equal(td["verl", "position_ids"], b["position_ids"])


def test_edited_layout_fields_travel_back() -> None:
    proto = rollout([3, 5, 2, 4])
    td = to_layout(proto)
    td[LLM_LAYOUT_V1.key("advantage")] = torch.arange(8.0)  # a [B] advantage set by posttrain
    back = from_layout(td)
    assert torch.equal(
        back.batch["advantages"], torch.arange(8.0)[:, None] * proto.batch["response_mask"]
    )
    td = to_layout(proto)
    td[LLM_LAYOUT_V1.key("reward")] = td[LLM_LAYOUT_V1.key("reward")] + 1
    with pytest.raises(VerlFormatError, match=r"'reward'.*token_level_rewards"):
        from_layout(td)
    td = to_layout(proto)
    td[LLM_LAYOUT_V1.key("group_id")] = torch.arange(8)
    with pytest.raises(VerlFormatError, match=r"group_id.*'uid'"):
        from_layout(td)


def test_row_selection_on_the_layout_side_is_verl_row_selection() -> None:
    proto = rollout([3, 5, 2, 4])
    idx = torch.tensor([5, 0, 3])
    assert_same(from_layout(to_layout(proto)[idx]), proto[idx])


@pytest.mark.parametrize("ragged", [False, True])
def test_a_posttrain_batch_in_verl_layout(ragged: bool) -> None:
    td = ragged_llm_batch([5, 8, 6, 7]) if ragged else llm_batch(4, 8)
    proto = from_layout(td)
    b = proto.batch
    p = b["prompts"].shape[1]
    assert torch.equal(b["input_ids"], torch.cat([b["prompts"], b["responses"]], 1))
    pa, ra = b["attention_mask"][:, :p], b["attention_mask"][:, p:]
    # verl's shape: prompts left-padded, responses right-padded, response_mask within them.
    assert torch.equal(pa, pa.cummax(-1).values)
    assert torch.equal(ra, ra.flip(-1).cummax(-1).values.flip(-1))
    assert not (b["response_mask"].bool() & ~ra.bool()).any()
    assert torch.equal(b["position_ids"], compute_position_id_with_mask(b["attention_mask"]))
    assert not b["old_log_probs"].isnan().any()  # NaN off the assistant mask would survive * mask
    back = to_layout(proto)
    dense = td if not ragged else from_layout_dense(td)
    k = LLM_LAYOUT_V1.key
    for i in range(4):
        a0, a1 = dense[k("attention_mask")][i], back[k("attention_mask")][i]
        assert dense[k("tokens")][i][a0].tolist() == back[k("tokens")][i][a1].tolist()
        s0 = dense[k("assistant_mask")][i]
        s1 = back[k("assistant_mask")][i]
        assert dense[k("tokens")][i][s0].tolist() == back[k("tokens")][i][s1].tolist()
        assert torch.equal(dense[k("sample_log_probs")][i][s0], back[k("sample_log_probs")][i][s1])
        assert torch.equal(
            dense[k("advantage")][i].expand(int(s0.sum())), back[k("advantage")][i][s1]
        )
    assert torch.allclose(back[k("reward")], dense[k("reward")])
    assert back[k("group_id")].tolist() == [0, 0, 1, 1]
    assert proto.non_tensor_batch["uid"].tolist() == ["0", "0", "1", "1"]


def from_layout_dense(td: Any) -> Any:
    from posttrain.adapters._layout import to_padded

    return to_padded(td)


def test_verl_estimator_runs_on_a_posttrain_batch() -> None:
    from verl.trainer.ppo.core_algos import compute_grpo_outcome_advantage

    proto = from_layout(llm_batch(4, 8))
    adv, _ = compute_grpo_outcome_advantage(
        proto.batch["token_level_rewards"],
        proto.batch["response_mask"],
        proto.non_tensor_batch["uid"],
    )
    assert adv.shape == proto.batch["responses"].shape


def _broken(key: str) -> Any:
    proto = rollout([3, 5, 2, 4])
    b = proto.batch
    if key == "input_ids":
        b["input_ids"] = b["input_ids"].int()
    elif key == "attention_mask":
        b["attention_mask"] = b["attention_mask"] * 2
    elif key == "responses":
        b["responses"] = b["responses"].flip(-1)
    elif key == "prompts":
        b["prompts"] = b["prompts"] + 1
    elif key == "response_mask":
        b["response_mask"] = torch.ones_like(b["response_mask"])
    elif key == "old_log_probs":
        b["old_log_probs"] = b["old_log_probs"].long()
    elif key == "token_level_rewards":
        b["token_level_rewards"] = torch.zeros(b.batch_size[0], 3)
    elif key == "uid":
        proto.non_tensor_batch["uid"] = np.zeros((8, 2), dtype=object)
    return proto


@pytest.mark.parametrize(
    "key",
    ["input_ids", "attention_mask", "responses", "prompts", "response_mask", "old_log_probs",
     "token_level_rewards", "uid"],
)  # fmt: skip
def test_bad_data_proto_is_refused_naming_the_key(key: str) -> None:
    with pytest.raises(VerlFormatError, match=key):
        to_layout(_broken(key))


def test_bad_inputs_are_refused() -> None:
    with pytest.raises(VerlFormatError, match="data: expected a verl DataProto"):
        to_layout({"input_ids": torch.zeros(1, 2)})
    proto = rollout([3, 5, 2, 4]).select(batch_keys=["input_ids", "attention_mask"])
    with pytest.raises(VerlFormatError, match="'responses'"):
        to_layout(proto)
    clash = rollout([3, 5, 2, 4])
    clash.non_tensor_batch["returns"] = np.zeros(8)
    with pytest.raises(VerlFormatError, match="'returns'"):
        to_layout(clash)
    with pytest.raises(VerlFormatError, match="td: expected an LLM-layout TensorDict"):
        from_layout(rollout([3, 5, 2, 4]))
    td = llm_batch(2, 6)
    del td[LLM_LAYOUT_V1.key("attention_mask")]
    with pytest.raises(ContractViolation, match="all_attention_mask"):
        from_layout(td)
