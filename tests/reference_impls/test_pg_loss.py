"""The reference loss's own checks beyond the suite: its options, an empty batch, the clipped
objective's figures in float64 and the dtype rule for float fields and masks.
posttrain.policy_loss's configurable loss has its own (tests/policy_loss/test_policy_loss.py)."""

from __future__ import annotations

import re
from typing import Any

import pytest
import torch
from tensordict import TensorDict

from posttrain.conformance.suites.loss_kit import logp_grads as _logp_grads
from posttrain.contracts import LLM_LAYOUT_V1
from posttrain.contracts.alignment import token_log_probs
from posttrain.reference_impls import PolicyGradientLoss
from posttrain.testing import llm_batch, tiny_causal_lm
from tests.mutants.losses import DualClipLoss

K = LLM_LAYOUT_V1.key
TOK, ATT, ASST = K("tokens"), K("attention_mask"), K("assistant_mask")
SLP, RLP = K("sample_log_probs"), K("ref_log_probs")


@pytest.mark.parametrize(
    ("option", "says"),
    [
        ({"clip_epsilon": "0.2"}, "clip_epsilon: expected a number or a (low, high) pair"),
        ({"clip_epsilon": (0.1, 0.2, 0.3)}, "found (0.1, 0.2, 0.3)"),
        (
            {"clip_epsilon": (1.5, 0.2)},
            "with 0 <= low <= 1 (1: no lower bound) and high >= 0, found (1.5, 0.2)",
        ),
        ({"kl_coef": -1.0}, "kl_coef: expected a number >= 0, found -1.0"),
        ({"kl_coef": float("nan")}, "kl_coef: expected a number >= 0, found nan"),
        ({"entropy_coef": float("inf")}, "entropy_coef: expected a finite number, found inf"),
    ],
)
def test_options_are_refused_by_name(option: dict[str, object], says: str) -> None:
    with pytest.raises(ValueError, match=re.escape(says)):
        PolicyGradientLoss(tiny_causal_lm(), **option)  # type: ignore[arg-type]


def test_an_empty_batch_is_refused_by_name() -> None:
    loss = PolicyGradientLoss(tiny_causal_lm())
    with pytest.raises(
        ValueError, match=re.escape("td: expected at least one item, found batch size [0]")
    ):
        loss(llm_batch(0, 8, vocab_size=64))


def _clip_batch(ratios: torch.Tensor) -> tuple[object, TensorDict, torch.Tensor]:
    """A batch whose behaviour log-probs put the policy's ratio at ``ratios`` [4, 12]."""
    policy = tiny_causal_lm(vocab_size=64, seed=3)
    td = llm_batch(4, 12, vocab_size=64, seed=5)
    td.set("advantage", torch.tensor([1.3, -0.7, 0.4, -1.9]))
    mask = td.get(ASST)
    with torch.no_grad():
        logits = policy(input_ids=td.get(TOK), attention_mask=td.get(ATT).long()).logits
    logp = token_log_probs(logits, td.get(TOK))
    td.set(SLP, torch.where(mask, logp - ratios.log(), float("nan")))
    return policy, td, logp


@pytest.mark.parametrize("dual", [None, 3.0])
def test_clipped_objective_gradient_and_clip_fraction_against_float64(dual: float | None) -> None:
    # Ratios spread over (0.3, 6), both advantage signs; the figures LOSS-014 relies on come
    # from an independent float64 autograd of max(-A r, -A clip(r)) (min with -A c, A < 0).
    g = torch.Generator().manual_seed(0)
    ratios = (torch.rand(4, 12, generator=g) * 3.0 - 1.2).exp()
    policy, td, logp = _clip_batch(ratios)
    mask = td.get(ASST)
    kw: dict[str, Any] = {"aggregation": "seq_mean_token_sum", "clip_epsilon": (0.2, 0.28)}
    loss = (
        PolicyGradientLoss(policy, **kw)
        if dual is None
        else DualClipLoss(policy, dual_clip=dual, **kw)
    )
    value, got = _logp_grads(policy, loss, td)
    with torch.no_grad():
        out = loss(td)

    lp = logp.double().requires_grad_()
    r = (lp - td.get(SLP).double()).exp()
    a = td.get("advantage").double()[:, None].expand(4, 12)
    unclipped, clipped = -a * r, -a * r.clamp(0.8, 1.28)
    per = torch.maximum(unclipped, clipped)
    if dual is not None:
        per = torch.where(a < 0, torch.minimum(per, -a * dual), per)
    total = (per * mask.double() / 4).where(mask, 0.0).sum()
    total.backward()
    assert lp.grad is not None
    assert torch.allclose(got.double()[mask], lp.grad[mask], rtol=1e-4, atol=1e-7)
    assert float(value) == pytest.approx(float(total.detach()), rel=1e-5)
    zero = (lp.grad[mask] == 0).sum()
    assert 0 < int(zero) < int(mask.sum())  # both clipped and unclipped tokens are exercised
    with torch.no_grad():
        active = (per != unclipped)[mask].double().mean()
    assert float(out["clip_fraction"]) == pytest.approx(float(active), rel=1e-6)


@pytest.mark.parametrize("dtype", [torch.float64, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("key", [SLP, "advantage", RLP])
def test_widened_float_fields_give_the_float32_figures(key: object, dtype: torch.dtype) -> None:
    policy = tiny_causal_lm(vocab_size=64, seed=1)
    loss = PolicyGradientLoss(policy, kl_coef=0.05, entropy_coef=0.01)
    td = llm_batch(4, 10, vocab_size=64, seed=2)
    value = td.get(key).to(dtype)
    narrow, wide = td.clone(), td.clone()
    narrow.set(key, value.float())
    wide.set(key, value)
    with torch.no_grad():
        a, b = loss(narrow), loss(wide)
    for k in a.keys():  # noqa: SIM118 - a TensorDict iterates over its batch, not keys
        assert b.get(k).dtype == torch.float32, k  # computed in the policy's precision
        assert torch.equal(a.get(k), b.get(k)), k


@pytest.mark.parametrize("key", [ASST, ATT])
@pytest.mark.parametrize("dtype", [torch.float32, torch.int64, torch.uint8])
def test_a_mask_of_another_dtype_is_refused_by_name(
    key: tuple[str, ...], dtype: torch.dtype
) -> None:
    loss = PolicyGradientLoss(tiny_causal_lm(vocab_size=64))
    td = llm_batch(2, 8, vocab_size=64)
    td.set(key, td.get(key).to(dtype))
    with pytest.raises(ValueError, match=re.escape(f"key {key!r}: expected dtype bool")):
        loss(td)


def test_global_counts_count_assistant_tokens_and_rows_holding_one() -> None:
    from tensordict import LazyStackedTensorDict

    from posttrain.contracts import GlobalCounts

    td = llm_batch(4, 8, vocab_size=64)
    asst = td.get(("masks", "all_assistant_mask")).clone()
    asst[1] = False  # a row without assistant tokens is no sequence
    asst[2, 0] = True  # position 0 is never predicted: not a token
    td.set(("masks", "all_assistant_mask"), asst)
    want = GlobalCounts(int(asst[:, 1:].sum()), 3)
    assert GlobalCounts.of(td) == want
    assert GlobalCounts.of(td[:2]) + GlobalCounts.of(td[2:]) == want
    ragged = LazyStackedTensorDict.lazy_stack([td[i] for i in range(4)], 0)
    assert GlobalCounts.of(ragged) == want
    # All-reduced counts arrive as 0-dim tensors; whole floats are taken, fractions refused.
    assert GlobalCounts(torch.tensor(12), torch.tensor(3.0)) == GlobalCounts(12, 3)  # type: ignore[arg-type]
    with pytest.raises(ValueError, match=r"GlobalCounts.tokens: expected a whole number"):
        GlobalCounts(2.5, 1)  # type: ignore[arg-type]
    with pytest.raises(ValueError, match=r"GlobalCounts.sequences"):
        GlobalCounts(3, True)


def test_the_reference_takes_the_contracts_options_only() -> None:
    # Ratios, estimators and importance corrections are posttrain.policy_loss.PolicyLoss's.
    for extra in ({"ratio": "sequence"}, {"kl_estimator": "k2"}, {"nemo_metrics": True}):
        with pytest.raises(TypeError, match=next(iter(extra))):
            PolicyGradientLoss(tiny_causal_lm(), **extra)
