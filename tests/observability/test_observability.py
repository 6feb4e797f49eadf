"""Catalogue hooks on crafted batches where the frameworks' formulas disagree."""

from __future__ import annotations

import math
import re
from collections.abc import Callable

import pytest
import torch
from tensordict import TensorDict

from posttrain.contracts import ContractViolation
from posttrain.contracts.layout import LLM_LAYOUT_V1
from posttrain.observability import (
    Accumulator,
    Timers,
    buffer_metrics,
    generation_server_metrics,
    loss_metrics,
    optim_metrics,
    policy_metrics,
    rollout_metrics,
)
from posttrain.testing import llm_batch, ragged_llm_batch

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


@pytest.mark.parametrize(
    ("value", "count", "message"),
    [
        (1.0, torch.tensor([3, 5]), "expected count to be one number, found a tensor of shape [2]"),
        (1.0, -1, "expected count to be finite and >= 0, found -1.0"),
        (1.0, math.nan, "expected count to be finite and >= 0, found nan"),
        (1.0, math.inf, "expected count to be finite and >= 0, found inf"),
        (
            torch.tensor([1.0, 2.0]),
            2,
            "expected value to be one number, found a tensor of shape [2]",
        ),
    ],
    ids=["count-per-sequence", "negative", "nan", "inf", "value-per-sequence"],
)
def test_accumulator_add_checks_value_and_count_before_any_change(
    value: float | torch.Tensor, count: float | torch.Tensor, message: str
) -> None:
    acc = Accumulator()
    acc.add("policy/kl_ref/k3", 3.0, 2)
    acc.add_moments("rollout/reward/std", 1.0, 1.0, 2)
    before = acc.values()
    with pytest.raises(ValueError, match=f"metric 'policy/kl_ref/k3': {re.escape(message)}"):
        acc.add("policy/kl_ref/k3", value, count)
    with pytest.raises(ValueError, match="metric 'rollout/reward/std': expected"):
        acc.add_moments("rollout/reward/std", value, 1.0, count)  # type: ignore[arg-type]
    assert acc.values() == before


def _batch_with(change: str) -> TensorDict:
    td = llm_batch(4, 8)
    if change == "advantage [4, 3]":
        td.set(K("advantage"), torch.zeros(4, 3))
    elif change == "no attention mask":
        td = td.exclude(K("attention_mask"))
    elif change == "float assistant mask":
        td.set(K("assistant_mask"), td.get(K("assistant_mask")).float())
    return td


@pytest.mark.parametrize(
    ("change", "kwargs", "message"),
    [
        ("advantage [4, 3]", {}, r"LAY-003 key 'advantage'"),
        ("no attention mask", {}, r"LAY-001 key \('masks', 'all_attention_mask'\)"),
        ("float assistant mask", {}, r"LAY-002 key \('masks', 'all_assistant_mask'\)"),
        ("", {"truncated": torch.ones(3)}, r"truncated: expected a tensor of 4 values"),
        ("", {"reward_fns": {"fmt": torch.ones(2)}}, r"reward_fns\['fmt'\]: expected"),
        ("", {"reward_fns": {"a/b": torch.ones(4)}}, r"rollout/reward_fn/a/b/mean"),
        ("", {"learner_version": "3"}, r"learner_version: expected an int, found '3'"),
    ],
    ids=[
        "advantage-shape",
        "no-attention-mask",
        "float-mask",
        "truncated",
        "reward_fn-size",
        "reward_fn-name",
        "learner_version",
    ],
)
def test_rollout_metrics_checks_the_batch_before_any_write(
    change: str, kwargs: dict[str, object], message: str
) -> None:
    acc = Accumulator()
    acc.add("rollout/reward/mean", 1.0, 1)
    with pytest.raises((ValueError, KeyError), match=message):
        rollout_metrics(_batch_with(change), acc, **kwargs)  # type: ignore[arg-type]
    assert acc.values() == {"rollout/reward/mean": 1.0}


class _Server:
    def stats(self) -> dict[str, object]:
        return {"queue_wait_s": 0.1, "forward_s": torch.ones(3)}


_LOGITS = torch.zeros(2, 6, 8)


@pytest.mark.parametrize(
    ("hook", "message"),
    [
        (
            lambda acc: policy_metrics(_crafted(), torch.zeros(2, 5, 8), acc),
            r"logits: expected .*\[2, 6, V\]",
        ),
        (
            lambda acc: policy_metrics(_crafted(), _LOGITS, acc, old_log_probs=torch.zeros(2, 5)),
            r"old_log_probs: expected a tensor of shape \[2, 6\]",
        ),
        (
            lambda acc: policy_metrics(_crafted(), _LOGITS, acc, clip=0.2),  # type: ignore[arg-type]
            r"clip: expected a \(low, high\)",
        ),
        (
            lambda acc: loss_metrics({"loss_entropy": 0.1, "loss_objective": torch.ones(2)}, acc),
            r"'loss_objective': expected one number, found a tensor of shape \[2\]",
        ),
        (
            lambda acc: optim_metrics(1.0, None, acc),  # type: ignore[arg-type]
            r"lr: expected one number, found NoneType",
        ),
        (
            lambda acc: buffer_metrics([1, 2], acc, capacity=4, reads=[1]),  # type: ignore[arg-type]
            r"reads: expected one number",
        ),
        (
            lambda acc: generation_server_metrics(_Server(), acc),
            r"stats\(\)\['forward_s'\]: expected one number",
        ),
    ],
    ids=["logits", "old_log_probs", "clip", "loss", "optim", "buffer", "gen_server"],
)
def test_other_hooks_check_their_inputs_before_any_write(
    hook: Callable[[Accumulator], Accumulator], message: str
) -> None:
    acc = Accumulator()
    acc.add("optim/lr", 1.0)
    with pytest.raises(ValueError, match=message):
        hook(acc)
    assert acc.values() == {"optim/lr": 1.0}


def test_hooks_and_the_codec_take_bf16_log_probs_and_float64_rewards() -> None:
    # TorchRL's TransformersWrapper on a bf16 model writes bf16 log-probs; rewards often
    # arrive as float64. Metrics are computed in float32 either way.
    from posttrain.adapters.nemo_rl.train_data import from_layout

    td = llm_batch(2, 6, vocab_size=8)
    mixed = td.clone()
    mixed.set(("log_probs", "full"), td.get(("log_probs", "full")).bfloat16())
    mixed.set(("next", "reward"), td.get(("next", "reward")).double())
    want = rollout_metrics(td, learner_version=3).values()
    got = rollout_metrics(mixed, learner_version=torch.tensor(3)).values()  # type: ignore[arg-type]
    assert got == pytest.approx(want, nan_ok=True)
    logits = torch.randn(2, 6, 8)
    assert policy_metrics(mixed, logits).values() == pytest.approx(
        policy_metrics(td, logits).values(), rel=1e-2
    )
    assert from_layout(mixed)["input_ids"].dtype == torch.int64


def test_a_ragged_batch_whose_items_disagree_is_refused_naming_the_items() -> None:
    # Padding would hide one item's float mask under the others' bools, and a key some
    # items lack ended in a TypeError on None.
    bad = ragged_llm_batch([4, 6])
    bad.tensordicts[1].set(("masks", "all_attention_mask"), torch.ones(6))
    acc = Accumulator()
    with pytest.raises(
        ContractViolation,
        match=re.escape(
            "LAY-002 key ('masks', 'all_attention_mask'): expected dtype bool in every item, "
            "found dtypes {'bool': [0], 'float32': [1]} (by items)"
        ),
    ):
        rollout_metrics(bad, acc=acc)
    missing = ragged_llm_batch([4, 6])
    del missing.tensordicts[1]["advantage"]
    with pytest.raises(
        ContractViolation,
        match=re.escape(
            "LAY-001 key 'advantage': expected advantage in every item, found missing from items [1]"
        ),
    ):
        rollout_metrics(missing, acc=acc)
    assert acc.values() == {}


def test_merge_of_a_name_this_catalogue_lacks_folds_in_nothing() -> None:
    from posttrain.contracts.catalogue import CATALOGUE_V1, Catalogue

    small = Catalogue(
        name="small",
        version="1.0",
        metrics=tuple(m for m in CATALOGUE_V1.metrics if m.name != "loss/total"),
    )
    mine = Accumulator(small)
    mine.add("policy/kl_ref/k3", 1.0, 1)
    other = Accumulator()
    other.add("policy/kl_ref/k3", 3.0, 1)
    other.add("loss/total", 2.0)
    with pytest.raises(KeyError, match="'loss/total' is not in catalogue small"):
        mine.merge(other)
    assert mine.values() == {"policy/kl_ref/k3": 1.0}
