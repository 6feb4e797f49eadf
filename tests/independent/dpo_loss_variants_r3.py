"""Round-three blind one-bug variants of a DPO loss (contract ``dpo_loss`` v1), written from
``specs/dpo_loss-v1.md`` alone (the suites unread), to measure the kit's reach.

Each variant subclasses ``losses_sft_dpo.ConcatDPO`` (chosen and rejected rows concatenated
into one forward, pairs as tensors; conforming) and changes one thing, a bug of a kind not
named in ``dpo_loss_variants.py`` nor in ``losses_sft_dpo.py``: reference log-probs kept in
half precision, a length mean without a guard for an empty answer, a mask applied by
multiplication, a win read off a rounded probability, reward metrics logged with β. ``DEMOS[name]()`` shows the bug with
plain code against the sentence (True when it shows).

Results (``run_for(VARIANTS[v], BREAKS[v])``, depth 1; the base ``ConcatDPO`` passes each
id):

- ``ref_log_probs_half`` breaks DPO-003: **caught** (DPO-003: token_reduction 'sum', beta
  0.1, 1 pairs x 2 columns (1 counted; β·Δ from -0.1468 to -0.1468) (rows 2i chosen, 2i + 1
  rejected): loss_preference is 0.7)
- ``mean_of_empty_answer`` breaks DPO-006: **caught under DPO-001** (DPO-006 reported
  "blocked by DPO-001": "loss_preference is nan, expected a finite value" on pairs with an
  empty rejected row)
- ``mask_by_multiply`` breaks DPO-003: **caught under DPO-001** (DPO-003 reported "blocked
  by DPO-001": "loss_preference is nan, expected a finite value"; the suite's batches carry
  NaN outside the answers)
- ``win_from_rounded_probability`` breaks DPO-005: **caught** (DPO-005: token_reduction
  'sum', beta 0.1, 2 pairs x 9 columns (2 counted; β·Δ from -0.04748 to 1e-09), its last pair
  a near-tie of two equal answers whose reference log-probs differ (β·Δ = 1e-09: a win, though
  σ(β·Δ) rounds to 1/2 in float32 below about 6e-8): accuracy is 0, expected 0.5); dpo_loss
  1.2's DPO-005 draws near-ties with β·Δ of either sign down to 1e-30 (missed under 1.1, whose
  domain had exact ties and margins far from them)
- ``reward_metrics_scaled_by_beta`` breaks DPO-005: **caught** (DPO-005: token_reduction
  'sum', beta 0.1, 3 pairs x 12 columns (3 counted; β·Δ from -0.6378 to 0.1623), its last
  pair's two answers equal (a tie, no win): rewar)

Base on the same ids and declarations (``_RatioHook``, ``ConcatDPO``'s terms): DPO-003,
DPO-005, DPO-006 all PASS.

Example:
    >>> from posttrain.testing import llm_batch, tiny_causal_lm
    >>> loss = RefLogProbsHalf(tiny_causal_lm(vocab_size=64), beta=0.1)
    >>> float(loss(llm_batch(4, 9, vocab_size=64))["loss_preference"]) > 0
    True
"""

from __future__ import annotations

import functools
import math
from collections.abc import Callable
from typing import Any

import torch
from tensordict import TensorDictBase

from posttrain.contracts import LLM_LAYOUT_V1, Implementation
from tests.independent.losses_sft_dpo import ConcatDPO, _Fields, _trained

__all__ = ["BREAKS", "DEMOS", "VARIANTS"]


class _RatioHook(ConcatDPO):
    """``ConcatDPO.log_ratios`` with two hooks: the reference log-probs as read, and how the
    answer mask is applied to log p - log p_ref. Conforms as it stands."""

    def reference(self, ref: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
        return ref.to(dtype)

    def masked(self, diff: torch.Tensor, mm: torch.Tensor) -> torch.Tensor:
        return torch.where(mm, diff, torch.zeros_like(diff))

    def log_ratios(self, f: _Fields) -> tuple[torch.Tensor, torch.Tensor]:
        c, r = self.chosen_offset, 1 - self.chosen_offset
        cat = {k: torch.cat([v[c::2], v[r::2]]) for k, v in f.items()}
        tok, att = cat["tokens"], cat["attention_mask"]
        m = _trained(att, cat["assistant_mask"])
        ids = torch.where(att, tok, torch.zeros_like(tok))
        logits = self.policy(input_ids=ids, attention_mask=att.long()).logits
        logp = torch.log_softmax(logits[:, :-1], -1)
        lp = logp.gather(-1, tok[:, 1:, None])[..., 0]
        lp = self.policy_log_probs(lp, m.shape[0] // 2)
        ref = self.reference(cat["ref_log_probs"][:, 1:], lp.dtype)
        mm = m[:, 1:]
        return self.masked(lp - ref, mm), mm


class RefLogProbsHalf(_RatioHook):
    """BUG: the reference log-probs stored and read back in float16 (a precomputed reference
    column halved to save memory, as mixed-precision pipelines keep their caches): every
    log p_ref is rounded to 11 bits (0.03 nats at -50, 0.125 at -200), and the answer's
    reward sums those errors. Plausible (of the kind of TRL's DPO log-softmax in the model's
    dtype, here on the reference side). Breaks DPO-003 (within 1e-5 relative, absolute
    2e-7·max(1, β) of an answer's Σ|log p| + |log p_ref|)."""

    def reference(self, ref: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
        return ref.to(torch.float16).to(dtype)


class MeanOfEmptyAnswer(_RatioHook):
    """BUG: ``token_reduction='mean'`` divides each answer's sum by its token count with no
    guard, ``(logps * mask).sum(-1) / mask.sum(-1)`` (TRL's ``_get_batch_logps`` with
    ``average_log_prob``, IPO's path; fixed in allenai/open-instruct#1685, "Fix
    _get_batch_logps NaN on fully-masked sequences (DPO)", and huggingface/trl#5343 for
    CPO): an answer with no assistant token is 0/0 = NaN, and a
    counted pair whose rejected answer is empty makes the loss and its metrics NaN (and its
    gradient through ``where`` NaN wherever such a row sits). Breaks DPO-006 ("the first
    counts, its rejected reward 0")."""

    def rewards(self, lr: torch.Tensor, mm: torch.Tensor) -> torch.Tensor:
        tot = lr.sum(1)
        if self.token_reduction == "mean":
            return tot / mm.sum(1)
        return tot


class MaskByMultiply(_RatioHook):
    """BUG: log p - log p_ref masked by multiplication, ``(logps - ref) * mask`` (verl's and
    TRL's ``masked_mean`` style), instead of a select: a reference log-prob outside the
    answer that is NaN (TorchRL writes NaN outside the mask) or inf makes 0·NaN = NaN and the
    whole answer's reward NaN. Plausible (the layout says values outside the mask are
    unspecified and must never leak). Breaks DPO-003 (r the reduction "over the answer's
    assistant tokens")."""

    def masked(self, diff: torch.Tensor, mm: torch.Tensor) -> torch.Tensor:
        return diff * mm.to(diff.dtype)


class WinFromRoundedProbability(_RatioHook):
    """BUG: ``accuracy`` counts a pair as a win when σ(β·Δ) > 0.5, the preference
    probability the loss already computed, in float32: for 0 < β·Δ below about 6e-8,
    σ rounds to exactly 0.5 and a real (small) win reads as no win; the spec asks for
    r_chosen > r_rejected. Plausible (a rounding mode slip: the decision taken after a
    saturating float op). Breaks DPO-005 (the share of counted pairs whose r_chosen >
    r_rejected)."""

    def wins(self, delta: torch.Tensor) -> torch.Tensor:
        return torch.sigmoid((self.beta * delta).to(torch.float32)) > 0.5


class RewardMetricsScaledByBeta(_RatioHook):
    """BUG: ``rewards_chosen_mean`` and ``rewards_rejected_mean`` logged as the implicit
    rewards β·(log p - log p_ref), the quantity TRL's DPOTrainer logs as ``rewards/chosen``
    and ``rewards/rejected`` (``chosen_rewards = self.beta * (...)``), while the contract's
    metrics are r itself: with β = 0.1 every logged reward is ten times too small. The loss
    and ``accuracy`` are right. Shipped as designed in TRL (a convention mismatch, not a TRL
    bug). Breaks DPO-005 (``rewards_chosen_mean`` and ``rewards_rejected_mean`` the mean over
    counted pairs of r_chosen and r_rejected "(without β)")."""

    def reward_mean(self, r: torch.Tensor, counted: torch.Tensor, p: float) -> torch.Tensor:
        return super().reward_mean(self.beta * r, counted, p)


# ------------------------------------------------------------------------------------------
# declarations
# ------------------------------------------------------------------------------------------


def _dpo(cls: type, name: str, token_reduction: str = "sum", beta: float = 0.1) -> Implementation:
    return Implementation(
        "dpo_loss",
        functools.partial(cls, token_reduction=token_reduction, beta=beta),
        name=name,
        capabilities={"global_counts"},
        options={"token_reduction": token_reduction},
        extras={"beta": beta},
        description=(cls.__doc__ or "").split("\n\n")[0],
    )


BASE = _dpo(_RatioHook, "r3/dpo-base")
BASE_MEAN = _dpo(_RatioHook, "r3/dpo-base-mean", "mean")

VARIANTS: dict[str, Implementation] = {
    "ref_log_probs_half": _dpo(RefLogProbsHalf, "r3/dpo-ref-log-probs-half"),
    "mean_of_empty_answer": _dpo(MeanOfEmptyAnswer, "r3/dpo-mean-of-empty-answer", "mean"),
    "mask_by_multiply": _dpo(MaskByMultiply, "r3/dpo-mask-by-multiply"),
    "win_from_rounded_probability": _dpo(
        WinFromRoundedProbability, "r3/dpo-win-from-rounded-probability"
    ),
    "reward_metrics_scaled_by_beta": _dpo(
        RewardMetricsScaledByBeta, "r3/dpo-reward-metrics-scaled-by-beta"
    ),
}

# Each variant's correct design (the hooks as they conform, same reduction), by variant.
BASES: dict[str, Implementation] = {
    "ref_log_probs_half": BASE,
    "mean_of_empty_answer": BASE_MEAN,
    "mask_by_multiply": BASE,
    "win_from_rounded_probability": BASE,
    "reward_metrics_scaled_by_beta": BASE,
}

BREAKS: dict[str, str] = {
    "ref_log_probs_half": "DPO-003",
    "mean_of_empty_answer": "DPO-006",
    "mask_by_multiply": "DPO-003",
    "win_from_rounded_probability": "DPO-005",
    "reward_metrics_scaled_by_beta": "DPO-005",
}

# ------------------------------------------------------------------------------------------
# demos
# ------------------------------------------------------------------------------------------

_V = 32
_K = LLM_LAYOUT_V1.key


def _policy() -> Any:
    from posttrain.testing import tiny_causal_lm

    return tiny_causal_lm(vocab_size=_V, seed=3)


def _batch(n: int, t: int = 10, seed: int = 0) -> TensorDictBase:
    from posttrain.testing import llm_batch

    return llm_batch(n, t, vocab_size=_V, seed=seed)


def _out(cls: type, td: TensorDictBase, reduction: str = "sum") -> dict[str, float]:
    out = cls(_policy(), token_reduction=reduction, beta=0.1)(td)
    return {k: float(v.detach()) for k, v in out.items()}


def _log_ratio_sums(td: TensorDictBase) -> torch.Tensor:
    """Per row Σ (log p - log p_ref) over its assistant tokens, float64, row by row."""
    policy = _policy().double()
    tok, att = td.get(_K("tokens")), td.get(_K("attention_mask"))
    m = td.get(_K("assistant_mask")) & att
    ref = td.get(_K("ref_log_probs")).double()
    out = torch.zeros(tok.shape[0], dtype=torch.float64)
    for i in range(tok.shape[0]):
        ids = torch.where(att[i], tok[i], torch.zeros_like(tok[i]))[None]
        with torch.no_grad():
            lp = torch.log_softmax(
                policy(input_ids=ids, attention_mask=att[i][None].long()).logits[0], -1
            )
        for t in range(1, tok.shape[1]):
            if bool(m[i, t]):
                out[i] += float(lp[t - 1, int(tok[i, t])]) - float(ref[i, t])
    return out


def demo_ref_log_probs_half() -> bool:
    """Reference log-probs near -50 to -200 nats: the rounded ones move the loss."""
    td = _batch(4, 12, seed=1)
    ref = td.get(_K("ref_log_probs"))
    ref.copy_(torch.where(torch.isnan(ref), ref, ref - 123.4567))
    r = _log_ratio_sums(td)
    d = r[0::2] - r[1::2]
    spec = float((-torch.nn.functional.logsigmoid(0.1 * d)).mean())
    ok = abs(_out(_RatioHook, td)["loss_preference"] - spec) <= 1e-5 * abs(spec)
    bad = abs(_out(RefLogProbsHalf, td)["loss_preference"] - spec) > 1e-5 * abs(spec)
    return ok and bad


def demo_mean_of_empty_answer() -> bool:
    """A counted pair whose rejected answer is empty: the spec's reward is 0, the loss finite."""
    td = _batch(4, 10, seed=2)
    td.get(_K("assistant_mask"))[1] = False
    base = _out(_RatioHook, td, "mean")
    bug = _out(MeanOfEmptyAnswer, td, "mean")
    return math.isfinite(base["loss_preference"]) and math.isnan(bug["loss_preference"])


def demo_mask_by_multiply() -> bool:
    """NaN reference log-probs outside the answers (TorchRL's convention), none inside."""
    td = _batch(4, 10, seed=3)
    assert bool(torch.isnan(td.get(_K("ref_log_probs"))).any())
    base = _out(_RatioHook, td)["loss_preference"]
    bug = _out(MaskByMultiply, td)["loss_preference"]
    return math.isfinite(base) and math.isnan(bug)


def demo_win_from_rounded_probability() -> bool:
    """Δ = 1e-7 > 0 is a win; σ(0.1·1e-7) is 0.5 in float32."""
    delta = torch.tensor([1e-7, -1e-7, 2.0], dtype=torch.float64)
    spec = (delta > 0).tolist()
    base = _RatioHook(_policy(), beta=0.1).wins(delta).tolist()
    bug = WinFromRoundedProbability(_policy(), beta=0.1).wins(delta).tolist()
    return base == spec and bug != spec


def demo_reward_metrics_scaled_by_beta() -> bool:
    """The spec's rewards_chosen_mean: the mean of Σ (log p - log p_ref), no β."""
    td = _batch(4, 10, seed=6)
    r = _log_ratio_sums(td)
    spec = float(r[0::2].mean())
    base = _out(_RatioHook, td)["rewards_chosen_mean"]
    bug = _out(RewardMetricsScaledByBeta, td)["rewards_chosen_mean"]
    return abs(base - spec) <= 1e-5 * abs(spec) and abs(bug - spec) > 1e-5 * abs(spec)


DEMOS: dict[str, Callable[[], bool]] = {
    "ref_log_probs_half": demo_ref_log_probs_half,
    "mean_of_empty_answer": demo_mean_of_empty_answer,
    "mask_by_multiply": demo_mask_by_multiply,
    "win_from_rounded_probability": demo_win_from_rounded_probability,
    "reward_metrics_scaled_by_beta": demo_reward_metrics_scaled_by_beta,
}


# What the kit misses of these variants (strict xfails in tests/conformance/independent/test_variants_by_contract.py):
# an entry goes once the kit fails the variant on the requirement it breaks.
KIT_DEFECTS: dict[str, str] = {}

# Variants the kit fails under another requirement (a foundation that blocks theirs).
OTHER_ID: dict[str, str] = {
    "mean_of_empty_answer": "DPO-001",
    "mask_by_multiply": "DPO-001",
}
