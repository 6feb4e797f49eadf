"""Catalogue hooks on crafted batches where the frameworks' formulas disagree."""

from __future__ import annotations

import math

import pytest
import torch
from tensordict import TensorDict

from posttrain.conformance.data import llm_batch, ragged_llm_batch
from posttrain.contracts.layout import LLM_LAYOUT_V1
from posttrain.observability import (
    Accumulator,
    Timers,
    loss_metrics,
    policy_metrics,
    rollout_metrics,
)

K = LLM_LAYOUT_V1.key


def _crafted() -> TensorDict:
    """Two sequences: prompt 2 tokens; responses of 3 and 1 tokens; one padded column."""
    attn = torch.tensor([[1, 1, 1, 1, 1, 0], [1, 1, 1, 0, 0, 0]], dtype=torch.bool)
    asst = torch.tensor([[0, 0, 1, 1, 1, 0], [0, 0, 1, 0, 0, 0]], dtype=torch.bool)
    return TensorDict(
        {
            K("tokens"): torch.tensor([[1, 2, 3, 4, 5, 0], [1, 2, 6, 0, 0, 0]]),
            K("attention_mask"): attn,
            K("assistant_mask"): asst,
            K("sample_log_probs"): torch.full((2, 6), -1.0),
            K("ref_log_probs"): torch.full((2, 6), -1.5),
            K("advantage"): torch.tensor([1.0, -1.0]),
            K("reward"): torch.tensor([1.0, 0.0]),
            K("group_id"): torch.tensor([0, 0]),
            K("policy_version"): torch.tensor([3, 5]),
        },
        batch_size=[2],
    )


def _logits_for(td: TensorDict, logp: torch.Tensor, vocab: int = 8) -> torch.Tensor:
    """Logits whose log-prob of each next token is ``logp`` (others share the rest evenly)."""
    tokens = td.get(K("tokens"))
    b, t = tokens.shape
    rest = torch.log((1 - logp.exp()) / (vocab - 1))
    logits = rest[..., None].expand(b, t, vocab).clone()
    nxt = torch.cat([tokens[:, 1:], tokens[:, :1]], dim=1)
    logits.scatter_(-1, nxt[..., None], logp[..., None])
    return logits  # logits at t predict token t+1


def test_rollout_values_by_hand() -> None:
    v = rollout_metrics(_crafted(), learner_version=6).values()
    assert v["rollout/reward/mean"] == 0.5
    assert v["rollout/reward/std"] == 0.5  # population std of {1, 0}
    assert (v["rollout/reward/min"], v["rollout/reward/max"]) == (0.0, 1.0)
    assert v["rollout/group/zero_std_frac"] == 0.0
    assert v["rollout/response_len/mean"] == 2.0
    assert (v["rollout/response_len/min"], v["rollout/response_len/max"]) == (1.0, 3.0)
    assert v["rollout/prompt_len/mean"] == 2.0
    assert v["staleness/mean"] == 2.0  # (6-3 + 6-5) / 2
    assert v["staleness/max"] == 3.0
    assert v["staleness/policy_version"] == 6.0


def test_padding_never_dilutes_token_metrics() -> None:
    td = _crafted()
    logp = torch.full((2, 6), -0.5)
    base = policy_metrics(td, _logits_for(td, torch.cat([logp[:, 1:], logp[:, :1]], 1))).values()
    wide = TensorDict(
        {
            key: torch.cat([v, torch.zeros(2, 4, dtype=v.dtype)], 1) if v.ndim == 2 else v
            for key, v in td.items(include_nested=True, leaves_only=True)
        },
        batch_size=[2],
    )
    lw = torch.full((2, 10), -0.5)
    padded = policy_metrics(wide, _logits_for(wide, torch.cat([lw[:, 1:], lw[:, :1]], 1))).values()
    for name in (
        "policy/kl_ref/k3",
        "policy/entropy",
        "policy/ratio/mean",
        "policy/clip_frac/high",
    ):
        assert padded[name] == pytest.approx(base[name], abs=1e-6), name
    # k3 per assistant token: ref - logp = -1.0 -> e^-1 + 1 - 1; TorchRL's mean over every
    # position of the padded batch would be 4/12 of that (4 assistant tokens of 12 positions).
    k3 = math.exp(-1.0)
    assert base["policy/kl_ref/k3"] == pytest.approx(k3, abs=1e-6)
    assert base["policy/kl_ref/k1"] == pytest.approx(1.0, abs=1e-6)
    assert base["policy/kl_ref/seq_k1"] == pytest.approx((3.0 + 1.0) / 2, abs=1e-6)


def test_clip_fractions_are_sign_aware() -> None:
    td = _crafted()
    # Ratios exp(logp - (-1)): sequence 0 (A > 0) gets 1.5, 1.0, 0.5; sequence 1 (A < 0): 0.5.
    logp = torch.full((2, 6), -1.0)
    logp[0, 2:5] = torch.log(torch.tensor([1.5, 1.0, 0.5])) - 1.0
    logp[1, 2] = math.log(0.5) - 1.0
    v = policy_metrics(td, _logits_for(td, torch.cat([logp[:, 1:], logp[:, :1]], 1))).values()
    # high: ratio > 1.2 with A > 0 -> 1 token of 4; low: ratio < 0.8 with A < 0 -> 1 of 4. The
    # 0.5 ratio of sequence 0 (A > 0) binds no clip: a sign-blind count (TorchRL's
    # clip_fraction) would count it too (3 of 4).
    assert v["policy/clip_frac/high"] == pytest.approx(0.25)
    assert v["policy/clip_frac/low"] == pytest.approx(0.25)
    assert v["policy/ratio/max"] == pytest.approx(1.5, rel=1e-5)
    assert v["policy/ratio/min"] == pytest.approx(0.5, rel=1e-5)


def test_microbatches_merge_to_the_full_batch_exactly() -> None:
    td = llm_batch(6, 8, vocab_size=16, seed=3)
    logits = torch.randn(6, 8, 16, generator=torch.Generator().manual_seed(0))
    full = policy_metrics(td, logits, rollout_metrics(td, learner_version=9)).values()
    acc = Accumulator()
    # Uneven token counts (a mean of means would differ); groups (ids 0-2) are not split.
    for sl in (slice(0, 2), slice(2, 6)):
        part = Accumulator()
        rollout_metrics(td[sl], part, learner_version=9)
        policy_metrics(td[sl], logits[sl], part)
        acc.merge(part)
    merged = acc.values()
    assert sorted(merged) == sorted(full)
    for name, value in full.items():
        assert merged[name] == pytest.approx(value, rel=1e-5, abs=1e-6), name


def test_ragged_batches_give_the_padded_values() -> None:
    ragged = ragged_llm_batch([5, 8, 6])
    dense = TensorDict(
        {
            key: torch.nn.utils.rnn.pad_sequence(
                [x.get(key) for x in ragged.tensordicts], batch_first=True
            )
            if ragged.tensordicts[0].get(key).ndim == 1
            else torch.stack([x.get(key) for x in ragged.tensordicts])
            for key in ragged.tensordicts[0].keys(include_nested=True, leaves_only=True)
        },
        batch_size=[3],
    )
    a, b = rollout_metrics(ragged).values(), rollout_metrics(dense).values()
    assert a == pytest.approx(b)


def test_losses_timers_and_rates() -> None:
    v = loss_metrics(
        {
            "loss_objective": torch.tensor(1.0),
            "loss_entropy": torch.tensor(-0.1),
            "clip_fraction": 0.3,
        }
    ).values()
    assert v == pytest.approx({"loss/total": 0.9, "loss/policy": 1.0, "loss/entropy": -0.1})
    timers = Timers()
    with timers.phase("weight_sync"):
        pass
    timers.last["rollout"] = 2.0
    timers.rate("perf/gen_tokens_per_s", tokens=100, phase="rollout")
    timers.last["rollout"] = 3.0
    timers.rate("perf/gen_tokens_per_s", tokens=400, phase="rollout")
    out = timers.acc.values()
    assert out["perf/gen_tokens_per_s"] == 100.0  # 500 tokens / 5 s, not mean(50, 133)
    assert out["time/weight_sync_s"] >= 0
    with pytest.raises(KeyError, match="not in catalogue"):
        Accumulator().add("made/up", 1.0)


def test_zero_std_groups_counted_per_group_id() -> None:
    td = llm_batch(10, 4)
    td.set(K("group_id"), torch.tensor([0, 0, 1, 1, 2, 2, 3, 3, 4, 4]))
    nan = float("nan")
    # 0 flat, 1 not, 2 and 4 hold a NaN (it equals nothing: not flat), 3 flat at +inf
    r = [1.0, 1.0, 0.0, 1.0, nan, nan, math.inf, math.inf, nan, 1.0]
    td.set(K("reward"), torch.tensor(r))
    assert rollout_metrics(td).values()["rollout/group/zero_std_frac"] == 2 / 5


def test_entropy_counts_a_masked_vocabulary_entry_as_zero() -> None:
    td = llm_batch(2, 6, vocab_size=8)
    logits = torch.randn(2, 6, 8, generator=torch.Generator().manual_seed(0))
    logits[:, :, 3] = -math.inf  # a token the sampler may never pick
    logits[td.get(K("tokens")).roll(-1, 1) == 3] = 0.0  # keep the sampled tokens possible
    got = policy_metrics(td, logits).values()["policy/entropy"]
    mask = (td.get(K("assistant_mask")) & td.get(K("attention_mask")))[:, 1:]
    lp = torch.log_softmax(logits[:, :-1], -1)
    want = torch.special.entr(lp.exp()).sum(-1)[mask].mean()
    assert math.isfinite(got)
    assert abs(got - float(want)) < 1e-5
