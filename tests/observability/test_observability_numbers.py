"""Every catalogue metric the hooks compute, against a float64 reference written here from the
catalogue's formulas with plain Python loops (no hook, no tensor reduction), on padded, ragged
and offset (left-padded) batches holding NaN outside their masks, a zero-length response and a
NaN reward; plus the numbers the previous hooks got wrong, with their values written out."""

from __future__ import annotations

import math
import statistics
from typing import Any

import pytest
import torch
from tensordict import LazyStackedTensorDict, TensorDict, TensorDictBase

from posttrain.contracts.layout import LLM_LAYOUT_V1
from posttrain.observability import Accumulator, policy_metrics, rollout_metrics
from posttrain.testing import llm_batch
from tests.paths import ROOT

K = LLM_LAYOUT_V1.key
NAN = math.nan
V = 5
CLIP = (0.2, 0.28)
TEMP = 0.7
LEARNER = 7


def _rows(case: str) -> list[dict[str, Any]]:
    """Sequences as plain lists: tokens, attention, assistant mask and per-token fields."""
    g = torch.Generator().manual_seed({"padded": 1, "ragged": 2, "offset": 3}[case])
    widths = {"padded": [9, 9, 9, 9], "ragged": [5, 9, 7, 3], "offset": [8, 8, 8, 8]}[case]
    rows = []
    for i, w in enumerate(widths):
        if case == "offset":  # left padding: the prompt starts after i columns of nothing
            attn = [0] * i + [1] * (w - i)
            asst = [0] * (i + 3) + [1] * (w - i - 3)
        elif case == "padded":  # right padding after a response of 1 + i tokens
            attn = [1] * (4 + i) + [0] * (w - 4 - i)
            asst = [0] * 3 + [1] * (1 + i) + [0] * (w - 4 - i)
        else:
            attn = [1] * w
            asst = [0] * 2 + [1] * (w - 2)
        if i == 3:  # a zero-length response: prompt only
            asst = [0] * w
        on = [bool(a and b) for a, b in zip(asst, attn, strict=True)]

        def field(scale: float, w: int = w, on: list[bool] = on) -> list[float]:
            x = (-torch.rand(w, generator=g) * scale).tolist()
            return [v if m else NAN for v, m in zip(x, on, strict=True)]  # NaN where unread

        rows.append(
            {
                "tokens": torch.randint(0, V, (w,), generator=g).tolist(),
                "attn": attn,
                "asst": asst,
                "sample": field(2.0),
                "old": field(2.0),
                "ref": field(2.0),
                "adv_tok": [
                    v if m else NAN
                    for v, m in zip(torch.randn(w, generator=g).tolist(), on, strict=True)
                ],
                "reward": [0.5, NAN, 2.0, -1.0][i],
                "fn": [1.0, NAN, 0.0, 1.0][i],
                "group": [0, 0, 1, 1][i],
                "version": [7, 6, 5, 7][i],
                "trunc": [1.0, 0.0, 0.0, 1.0][i],
                "logits": (torch.randn(w, V, generator=g) * 2).tolist(),
            }
        )
    return rows


def _td(rows: list[dict[str, Any]], ragged: bool) -> TensorDictBase:
    def item(r: dict[str, Any]) -> TensorDict:
        return TensorDict(
            {
                K("tokens"): torch.tensor(r["tokens"]),
                K("attention_mask"): torch.tensor(r["attn"], dtype=torch.bool),
                K("assistant_mask"): torch.tensor(r["asst"], dtype=torch.bool),
                K("sample_log_probs"): torch.tensor(r["sample"]),
                K("ref_log_probs"): torch.tensor(r["ref"]),
                K("advantage"): torch.tensor(r["adv_tok"]),
                K("reward"): torch.tensor(r["reward"]),
                K("group_id"): torch.tensor(r["group"]),
                K("policy_version"): torch.tensor(r["version"]),
            },
            batch_size=[],
        )

    items = [item(r) for r in rows]
    return LazyStackedTensorDict.lazy_stack(items, 0) if ragged else torch.stack(items)


def _pad(rows: list[dict[str, Any]], key: str, fill: float) -> torch.Tensor:
    w = max(len(r["tokens"]) for r in rows)
    out = []
    for r in rows:
        x = r[key]
        out.append(list(x) + [fill if not isinstance(x[0], list) else [0.0] * V] * (w - len(x)))
    return torch.tensor(out)


def _reference(rows: list[dict[str, Any]]) -> dict[str, float]:
    """The catalogue, formula by formula, in float64 Python."""
    out: dict[str, float] = {}
    rewards = [r["reward"] for r in rows if math.isfinite(r["reward"])]
    out["rollout/reward/mean"] = sum(rewards) / len(rewards)
    out["rollout/reward/std"] = statistics.pstdev(rewards)
    out["rollout/reward/min"], out["rollout/reward/max"] = min(rewards), max(rewards)
    groups: dict[int, list[float]] = {}
    for r in rows:
        groups.setdefault(r["group"], []).append(r["reward"])
    flat = [all(math.isfinite(x) for x in v) and len(set(v)) == 1 for v in groups.values()]
    out["rollout/group/zero_std_frac"] = sum(flat) / len(flat)
    advs = []
    for r in rows:
        on = [a and b for a, b in zip(r["asst"], r["attn"], strict=True)]
        if any(on):
            vals = [x for x, m in zip(r["adv_tok"], on, strict=True) if m]
            advs.append(sum(vals) / len(vals))
    out["rollout/advantage/mean"] = sum(advs) / len(advs)
    out["rollout/advantage/std"] = statistics.pstdev(advs)
    out["rollout/advantage/min"], out["rollout/advantage/max"] = min(advs), max(advs)
    lens = [sum(a and b for a, b in zip(r["asst"], r["attn"], strict=True)) for r in rows]
    out["rollout/response_len/mean"] = sum(lens) / len(lens)
    out["rollout/response_len/min"], out["rollout/response_len/max"] = min(lens), max(lens)
    prompts = []
    for r in rows:
        n = 0
        for a, m in zip(r["attn"], r["asst"], strict=True):
            if m:
                break
            n += a
        prompts.append(n)
    out["rollout/prompt_len/mean"] = sum(prompts) / len(prompts)
    out["rollout/prompt_len/max"] = max(prompts)
    out["rollout/truncated_frac"] = sum(r["trunc"] for r in rows) / len(rows)
    fn = [r["fn"] for r in rows if math.isfinite(r["fn"])]
    out["rollout/reward_fn/fmt/mean"] = sum(fn) / len(fn)
    out["rollout/reward_fn/fmt/std"] = statistics.pstdev(fn)
    ages = [LEARNER - r["version"] for r in rows]
    out["staleness/mean"], out["staleness/max"] = sum(ages) / len(ages), max(ages)
    out["staleness/policy_version"] = LEARNER

    sums: dict[str, float] = {}
    ratios: list[float] = []
    seq_k1: list[float] = []
    n = 0
    for r in rows:
        seq = 0.0
        scored = False
        for t in range(1, len(r["tokens"])):
            if not (r["asst"][t] and r["attn"][t]):
                continue
            scored = True
            n += 1
            z = [x / TEMP for x in r["logits"][t - 1]]
            top = max(z)
            lse = top + math.log(sum(math.exp(x - top) for x in z))
            logq = [x - lse for x in z]
            logp = logq[r["tokens"][t]]
            old, sample, ref = r["old"][t], r["sample"][t], r["ref"][t]
            ratio = math.exp(logp - old)
            ratios.append(ratio)
            adv = r["adv_tok"][t]
            d_ref = ref - logp
            d_mis = old - sample
            lw = logp - old
            terms = {
                "policy/entropy": -sum(math.exp(q) * q for q in logq),
                "policy/entropy/sampled": -logp,
                "policy/ratio/mean": ratio,
                "policy/clip_frac/low": float(ratio < 1 - CLIP[0] and adv < 0),
                "policy/clip_frac/high": float(ratio > 1 + CLIP[1] and adv > 0),
                "policy/update_kl/k1": old - logp,
                "policy/update_kl/k3": math.exp(lw) - lw - 1,
                "policy/mismatch_kl": math.exp(d_mis) - d_mis - 1,
                "policy/kl_ref/k1": logp - ref,
                "policy/kl_ref/k3": math.exp(d_ref) - d_ref - 1,
            }
            for k, v in terms.items():
                sums[k] = sums.get(k, 0.0) + v
            seq += logp - ref
        if scored:
            seq_k1.append(seq)
    out.update({k: v / n for k, v in sums.items()})
    out["policy/ratio/min"], out["policy/ratio/max"] = min(ratios), max(ratios)
    out["policy/ratio/ess"] = sum(ratios) ** 2 / (len(ratios) * sum(w * w for w in ratios))
    out["policy/kl_ref/seq_k1"] = sum(seq_k1) / len(seq_k1)
    return out


def _hooks(rows: list[dict[str, Any]], ragged: bool, split: bool = False) -> dict[str, float]:
    td = _td(rows, ragged)
    logits = _pad(rows, "logits", 0.0)
    old = _pad(rows, "old", NAN)
    parts = [slice(0, 2), slice(2, 4)] if split else [slice(0, 4)]
    acc = Accumulator()
    for sl in parts:  # groups 0 and 1 are not split
        part = td[sl]
        rollout_metrics(
            part,
            acc,
            learner_version=LEARNER,
            truncated=torch.tensor([r["trunc"] for r in rows[sl]]),
            reward_fns={"fmt": torch.tensor([r["fn"] for r in rows[sl]])},
        )
        w = max(len(r["tokens"]) for r in rows[sl])
        policy_metrics(
            part,
            logits[sl, :w],
            acc,
            clip=CLIP,
            old_log_probs=old[sl, :w],
            temperature=TEMP,
        )
    return acc.values()


@pytest.mark.parametrize("split", [False, True], ids=["whole", "two-microbatches"])
@pytest.mark.parametrize("case", ["padded", "ragged", "offset"])
def test_every_metric_matches_a_float64_reference(case: str, split: bool) -> None:
    rows = _rows(case)
    want = _reference(rows)
    got = _hooks(rows, ragged=case == "ragged", split=split)
    assert sorted(got) == sorted(want)
    bad = {
        k: (got[k], want[k])
        for k in want
        if not math.isclose(got[k], want[k], rel_tol=1e-5, abs_tol=1e-7)
    }
    assert not bad, bad
    assert len(want) == 34  # every rollout, policy and staleness metric


def _two(adv: torch.Tensor | None = None) -> TensorDict:
    """Two sequences of width 4: positions 2-3 assistant in the first, 2 in the second."""
    attn = torch.tensor([[1, 1, 1, 1], [1, 1, 1, 0]], dtype=torch.bool)
    asst = torch.tensor([[0, 0, 1, 1], [0, 0, 1, 0]], dtype=torch.bool)
    return TensorDict(
        {
            K("tokens"): torch.tensor([[1, 2, 0, 1], [1, 2, 3, 0]]),
            K("attention_mask"): attn,
            K("assistant_mask"): asst,
            K("sample_log_probs"): torch.full((2, 4), -1.0),
            K("advantage"): adv if adv is not None else torch.tensor([1.0, -1.0]),
        },
        batch_size=[2],
    )


def test_advantages_nan_outside_the_mask_do_not_leak() -> None:
    adv = torch.tensor([[NAN, NAN, 1.0, 3.0], [NAN, NAN, -1.0, NAN]])
    v = rollout_metrics(_two(adv)).values()
    # Sequence means 2.0 and -1.0: mean 0.5, population std 1.5.
    assert (v["rollout/advantage/mean"], v["rollout/advantage/std"]) == (0.5, 1.5)
    assert (v["rollout/advantage/min"], v["rollout/advantage/max"]) == (-1.0, 2.0)


def test_a_nan_inside_the_mask_makes_ratio_mean_min_and_max_nan() -> None:
    td = _two()
    slp = td.get(K("sample_log_probs"))
    slp[0, 3] = NAN
    v = policy_metrics(td, torch.zeros(2, 4, 4)).values()
    assert all(
        math.isnan(v[k]) for k in ("policy/ratio/mean", "policy/ratio/min", "policy/ratio/max")
    )
    acc = Accumulator()
    acc.add("policy/ratio/min", 0.5)
    acc.add("policy/ratio/min", NAN)
    acc.add("policy/ratio/min", 0.1)
    assert math.isnan(acc.values()["policy/ratio/min"])


@pytest.mark.parametrize(
    ("mean", "spread", "b"), [(20, 0.3, 64), (50, 0.05, 256), (1000, 0.01, 256)]
)
def test_reward_std_is_exact_far_from_zero(mean: float, spread: float, b: int) -> None:
    g = torch.Generator().manual_seed(0)
    for dtype in (torch.float64, torch.float32):
        r = (mean + spread * torch.randn(b, generator=g, dtype=torch.float64)).to(dtype)
        td = llm_batch(b, 4)
        td.set(K("reward"), r)
        want = statistics.pstdev(r.double().tolist())  # of the values the hook was given
        acc = Accumulator()
        for sl in (slice(0, b // 3), slice(b // 3, b)):  # and merged from two parts
            rollout_metrics(td[sl], acc)
        got = acc.values()["rollout/reward/std"]
        assert abs(got - want) <= 1e-6 * want, (dtype, got, want)


def test_ratio_and_clip_use_the_trainers_old_log_probs_when_given() -> None:
    td = _two()
    logits = torch.zeros(2, 4, 4)  # uniform: logp = -log 4 = -1.386 at every token
    # Sampler -1.0: ratio exp(-0.386) = 0.68 (low clip binds for the A < 0 token: 1 of 3).
    v = policy_metrics(td, logits).values()
    assert v["policy/clip_frac/low"] == pytest.approx(1 / 3)
    assert v["policy/clip_frac/high"] == 0.0
    # The trainer's old log-probs -2.0: ratio exp(0.614) = 1.85 (high clip for A > 0: 2 of 3).
    old = torch.full((2, 4), -2.0)
    v = policy_metrics(td, logits, old_log_probs=old).values()
    assert v["policy/ratio/mean"] == pytest.approx(math.exp(2.0 - math.log(4)), rel=1e-6)
    assert v["policy/clip_frac/low"] == 0.0
    assert v["policy/clip_frac/high"] == pytest.approx(2 / 3)
    d = -1.0  # old - sampler: k3 = e^-1 + 1 - 1
    assert v["policy/mismatch_kl"] == pytest.approx(math.exp(d) - d - 1, rel=1e-6)
    assert v["policy/update_kl/k1"] == pytest.approx(-2.0 + math.log(4), rel=1e-6)
    assert v["policy/ratio/ess"] == pytest.approx(1.0)  # equal weights


def test_entropy_and_log_probs_use_the_sampling_temperature() -> None:
    td = _two()
    logits = torch.tensor([0.0, 0.0, math.log(3.0), 0.0]).expand(2, 4, 4)
    # At T = 1 the distribution is (1, 1, 3, 1)/6; at T = 2 the logits halve: (1, 1, sqrt 3, 1).
    for t, p in ((1.0, [1, 1, 3, 1]), (2.0, [1, 1, math.sqrt(3), 1])):
        z = sum(p)
        q = [x / z for x in p]
        ent = -sum(x * math.log(x) for x in q)
        # Tokens scored at positions 2, 3 (row 0) and 2 (row 1): ids 0, 1 and 3, each p 1/z.
        v = policy_metrics(td, logits, temperature=t).values()
        assert v["policy/entropy"] == pytest.approx(ent, rel=1e-6)
        assert v["policy/entropy/sampled"] == pytest.approx(math.log(z), rel=1e-6)


def test_staleness_is_zero_on_policy_and_the_lag_off_policy() -> None:
    """The documented wiring: the source stamps the weights version that generated each
    sequence (TorchRL's collector: its ``policy_version``, bumped by
    ``update_policy_weights_``), and ``learner_version`` is that of the weights the batch's
    step starts from, counted the same way."""
    version = 0  # the learner's weights version: optimizer steps synced to the source
    on, off = [], []
    queue: list[TensorDict] = []
    for step in range(40):
        batch = llm_batch(4, 6, seed=step)
        batch.set(K("policy_version"), torch.full((4,), version))  # the source's stamp
        on.append(rollout_metrics(batch, learner_version=version).values()["staleness/max"])
        queue.append(batch)  # off-policy: a buffer two steps deep
        if len(queue) > 2:
            old = queue.pop(0)
            vals = rollout_metrics(old, learner_version=version).values()
            off.append((vals["staleness/mean"], vals["staleness/max"]))
        version += 1  # noqa: SIM113 - the optimizer step, then the weights go to the source
    assert on == [0.0] * 40
    assert off == [(2.0, 2.0)] * 38


def test_wall_times_and_rates_combine_across_ranks() -> None:
    ranks = []
    for _ in range(2):  # each rank: 2 s of generation, 1,000 tokens
        acc = Accumulator()
        acc.add("time/rollout_s", 2.0)
        acc.add("perf/gen_tokens_per_s", 1000, 2.0)
        acc.add("loss/total", 0.25)  # a share normalized by the global counts
        acc.add("optim/lr", 1e-3)
        ranks.append(acc)
    ranks[0].merge_ranks([a.state() for a in ranks])
    assert ranks[0].values() == {
        "time/rollout_s": 2.0,
        "perf/gen_tokens_per_s": 1000.0,  # the job's rate: 2,000 tokens in 2 s
        "loss/total": 0.5,
        "optim/lr": 1e-3,
    }
    # A rank whose rewards were all NaN holds no reward min, std or mean count: the others'.
    full, empty = Accumulator(), Accumulator()
    full.add("rollout/reward/min", 0.5)
    full.add_values("rollout/reward/std", torch.tensor([1.0, 3.0], dtype=torch.float64))
    empty.add_values("rollout/reward/std", torch.tensor([], dtype=torch.float64))
    empty.add("policy/ratio/max", NAN)
    full.add("policy/ratio/max", 2.0)
    full.merge_ranks([full.state(), empty.state()])
    v = full.values()
    assert (v["rollout/reward/min"], v["rollout/reward/std"]) == (0.5, 1.0)
    assert math.isnan(v["policy/ratio/max"])  # a NaN on any rank is seen


# --- the recipes beyond GRPO: selection (expert iteration), reward-model pairs, SFT NLL ------

SELECTIONS = {
    "keep_nan_and_empty": [True, True, False, True],  # a NaN reward and a zero-length answer kept
    "keep_one": [False, False, True, False],
    "keep_none": [False, False, False, False],
}


def _selection_reference(rows: list[dict[str, Any]], keep: list[bool]) -> dict[str, float]:
    """The selection/* formulas in float64 Python."""
    kept = [r for r, k in zip(rows, keep, strict=True) if k]
    out = {"selection/rate": sum(keep) / len(keep)}
    if kept:
        lens = [sum(a and b for a, b in zip(r["asst"], r["attn"], strict=True)) for r in kept]
        out["selection/response_len/mean"] = sum(lens) / len(lens)
    rewards = [r["reward"] for r in kept if math.isfinite(r["reward"])]
    if rewards:
        out["selection/reward/mean"] = sum(rewards) / len(rewards)
        out["selection/reward/std"] = statistics.pstdev(rewards)
        out["selection/reward/min"], out["selection/reward/max"] = min(rewards), max(rewards)
    return out


@pytest.mark.parametrize("split", [False, True], ids=["whole", "two-microbatches"])
@pytest.mark.parametrize("selection", sorted(SELECTIONS))
@pytest.mark.parametrize("case", ["padded", "ragged", "offset"])
def test_selection_metrics_match_a_float64_reference(
    case: str, selection: str, split: bool
) -> None:
    from posttrain.observability import selection_metrics

    rows, keep = _rows(case), SELECTIONS[selection]
    td = _td(rows, ragged=case == "ragged")
    acc = Accumulator()
    for sl in [slice(0, 2), slice(2, 4)] if split else [slice(0, 4)]:
        selection_metrics(td[sl], torch.tensor(keep[sl]), acc)
    got, want = acc.values(), _selection_reference(rows, keep)
    # Nothing kept: a (0, 0) mean pair reads NaN, as any mean over no sequence.
    got = {k: v for k, v in got.items() if not math.isnan(v)}
    assert sorted(got) == sorted(want)
    bad = {k: (got[k], want[k]) for k in want if not math.isclose(got[k], want[k], abs_tol=1e-12)}
    assert not bad, bad


def test_selection_metrics_refuse_a_wrong_selection_and_keep_the_accumulator() -> None:
    from posttrain.observability import selection_metrics

    td, acc = _td(_rows("padded"), ragged=False), Accumulator()
    with pytest.raises(ValueError, match=r"selected: expected a tensor of 4 values .* shape \[3\]"):
        selection_metrics(td, torch.ones(3, dtype=torch.bool), acc)
    with pytest.raises(
        ValueError, match=r"selected: expected a bool tensor, found dtype torch\.int64"
    ):
        selection_metrics(td, torch.ones(4, dtype=torch.long), acc)
    assert acc.values() == {}


def _pairs_reference(chosen: list[float], rejected: list[float]) -> dict[str, float]:
    """reward_model/* in float64 Python: -log sigmoid(d) = log(1 + exp(-d))."""
    d = [c - r for c, r in zip(chosen, rejected, strict=True)]
    return {
        "reward_model/accuracy": sum(x > 0 for x in d) / len(d),
        "reward_model/margin": sum(d) / len(d),
        "reward_model/margin/std": statistics.pstdev(d),
        "reward_model/loss": sum(math.log1p(math.exp(-x)) for x in d) / len(d),
    }


@pytest.mark.parametrize("split", [False, True], ids=["whole", "two-microbatches"])
def test_reward_model_metrics_match_a_float64_reference(split: bool) -> None:
    from posttrain.observability import reward_model_metrics

    g = torch.Generator().manual_seed(5)
    chosen = [*(torch.randn(9, generator=g) * 3).tolist(), 40.0, -40.0, 2.5]
    rejected = [*(torch.randn(9, generator=g) * 3).tolist(), -40.0, 40.0, 2.5]  # +-80, a tie
    acc = Accumulator()
    for sl in [slice(0, 5), slice(5, 12)] if split else [slice(0, 12)]:
        reward_model_metrics(
            torch.tensor(chosen[sl], dtype=torch.float64),
            torch.tensor(rejected[sl], dtype=torch.float64),
            acc,
        )
    got, want = acc.values(), _pairs_reference(chosen, rejected)
    assert sorted(got) == sorted(want)
    bad = {k: (got[k], want[k]) for k in want if not math.isclose(got[k], want[k], rel_tol=1e-12)}
    assert not bad, bad
    assert math.isfinite(got["reward_model/loss"])  # exp(80) would overflow float32


def test_sft_nll_of_the_expert_iteration_example_matches_the_formula() -> None:
    """``loss/nll`` as the example's SFT step logs it, against the catalogue's formula from
    the same logits in float64 Python: -log softmax at the next token, over asst tokens after
    position 0, divided by their count."""
    import runpy

    from posttrain.testing import tiny_causal_lm

    ex = runpy.run_path(str(ROOT / "examples" / "expert_iteration.py"))
    rows = _rows("padded")
    td = _td(rows, ragged=False).exclude(K("sample_log_probs"), K("ref_log_probs"))
    tokens = td.get(K("tokens"))
    attn = td.get(K("attention_mask"))
    policy = tiny_causal_lm(vocab_size=V)
    with torch.no_grad():
        logits = policy(input_ids=tokens, attention_mask=attn.long()).logits.double().tolist()
    total, count = 0.0, 0
    for b, r in enumerate(rows):
        for t in range(1, len(r["tokens"])):
            if r["asst"][t] and r["attn"][t]:
                row = logits[b][t - 1]
                top = max(row)
                lse = top + math.log(sum(math.exp(x - top) for x in row))
                total += lse - row[r["tokens"][t]]
                count += 1
    acc = Accumulator()
    opt = torch.optim.SGD(policy.parameters(), lr=0.0)
    ex["sft_step"](policy, opt, td, acc)
    got = acc.values()
    assert math.isclose(got["loss/nll"], total / count, rel_tol=1e-5)
    assert got["loss/total"] == got["loss/nll"]
