"""posttrain.policy_loss: its options refused by name, the reference's figures under the
defaults, and the suite's verdicts with the declared options (1.4, 1.5)."""

from __future__ import annotations

import re
from dataclasses import replace
from functools import partial
from typing import Any

import pytest
import torch

from posttrain.conformance import Status
from posttrain.conformance.runner import run
from posttrain.contracts import GlobalCounts
from posttrain.contracts.implementation import Implementation
from posttrain.policy_loss import PolicyLoss, PolicyLossOptions
from posttrain.reference_impls import PolicyGradientLoss
from posttrain.testing import llm_batch, tiny_causal_lm
from tests.outcomes import run_for
from tests.paths import ROOT


@pytest.mark.parametrize(
    ("option", "says"),
    [
        ({"aggregation": "token_meen"}, "aggregation: expected one of ['token_mean'"),
        ({"aggregation": "seq_mean_token_sum_norm"}, "t_norm: seq_mean_token_sum_norm needs"),
        (
            {"clip_epsilon": (1.5, 0.2)},
            "with 0 <= low <= 1 (1: no lower bound) and high >= 0, found (1.5, 0.2)",
        ),
        ({"dual_clip": 1.0}, "dual_clip: expected None or a number > 1, found 1.0"),
        ({"ratio": "cispo", "dual_clip": 3.0}, "dual_clip: ratio 'cispo' takes no dual clip"),
        ({"ratio": "tokens"}, "ratio: expected one of ['token', 'sequence'"),
        ({"kl_coef": float("nan")}, "kl_coef: expected a number >= 0, found nan"),
        ({"kl_estimator": "k4"}, "kl_estimator: expected one of ['k1', 'k2', 'k3'], found 'k4'"),
        ({"kl_input_clamp": -1.0}, "kl_input_clamp: expected None or a number >= 0"),
        ({"kl_output_clamp": "10"}, "kl_output_clamp: expected None or a number >= 0"),
        ({"kl_gradient": "reinforce"}, "kl_gradient: expected one of ['pathwise'"),
        ({"importance_correction": "is"}, "importance_correction: expected one of [None"),
        ({"importance_bounds": (0.5, 2.0)}, "importance_bounds: only with a truncating"),
        (
            {"importance_correction": "icepop", "importance_bounds": (None, 2.0)},
            "importance_bounds: icepop needs (low, high) with 0 <= low <= high",
        ),
        ({"entropy_coef": float("inf")}, "entropy_coef: expected a finite number, found inf"),
        ({"positive_nll_coef": -0.1}, "positive_nll_coef: expected a number >= 0, found -0.1"),
    ],
)
def test_options_are_refused_by_name(option: dict[str, Any], says: str) -> None:
    with pytest.raises(ValueError, match=re.escape(says)):
        PolicyLossOptions(**option)
    with pytest.raises(ValueError, match=re.escape(says)):
        PolicyLoss(tiny_causal_lm(), **option)


def test_options_are_frozen_and_normalised() -> None:
    o = PolicyLossOptions(importance_correction="tis", importance_bounds=(None, 2))
    assert o.importance_bounds == (0.0, 2.0)
    assert PolicyLossOptions(clip_epsilon=0.1).clip == (0.1, 0.1)
    with pytest.raises(AttributeError):
        o.ratio = "sequence"  # type: ignore[misc]


def test_an_unknown_keyword_is_named_with_the_fields() -> None:
    with pytest.raises(TypeError, match=r"^aggregaton: not a PolicyLossOptions field; expected"):
        PolicyLoss(tiny_causal_lm(), aggregaton="token_mean")
    with pytest.raises(TypeError, match=r"options: given together with the fields \['kl_coef'\]"):
        PolicyLoss(tiny_causal_lm(), PolicyLossOptions(), kl_coef=0.1)


@pytest.mark.parametrize("aggregation", ["token_mean", "seq_mean_token_mean", "seq_mean_token_sum"])
def test_the_contracts_options_give_the_reference_figures(aggregation: str) -> None:
    # Two independent implementations of the contract's required behaviour: the same terms,
    # diagnostics and gradients, micro-batched with global counts too.
    policy = tiny_causal_lm(vocab_size=64, seed=1)
    td = llm_batch(4, 10, vocab_size=64, seed=2)
    td.set("advantage", torch.randn(4, 10, generator=torch.Generator().manual_seed(0)))
    kw: dict[str, Any] = {
        "aggregation": aggregation,
        "clip_epsilon": (0.2, 0.28),
        "kl_coef": 0.05,
        "entropy_coef": 0.01,
    }
    for part, counts in ((td, None), (td[:2], GlobalCounts.of(td))):
        a, b = (
            PolicyGradientLoss(policy, **kw)(part, counts=counts),
            PolicyLoss(policy, **kw)(part, counts=counts),
        )
        assert set(a.keys()) == set(b.keys())
        for k in a.keys():  # noqa: SIM118 - a TensorDict iterates over its batch, not keys
            torch.testing.assert_close(a.get(k), b.get(k), rtol=1e-6, atol=1e-7)
        ga = torch.autograd.grad(
            sum(v for k, v in a.items() if k.startswith("loss_")), policy.parameters()
        )
        gb = torch.autograd.grad(
            sum(v for k, v in b.items() if k.startswith("loss_")), policy.parameters()
        )
        for x, y in zip(ga, gb, strict=True):
            torch.testing.assert_close(x, y, rtol=1e-5, atol=1e-7)


def test_importance_correction_reads_the_generation_key() -> None:
    policy = tiny_causal_lm(vocab_size=64, seed=1)
    td = llm_batch(2, 8, vocab_size=64, seed=3)
    opts = PolicyLossOptions(importance_correction="plain", generation_key=("log_probs", "gen"))
    with pytest.raises(KeyError, match="generation_key is set but the batch has no such entry"):
        PolicyLoss(policy, opts)(td)
    td.set(("log_probs", "gen"), td.get(("log_probs", "full")).clone())
    same = PolicyLoss(policy, opts)(td)["loss_objective"]
    assert float(same) == pytest.approx(float(PolicyLoss(policy)(td)["loss_objective"]))
    td.set(("log_probs", "gen"), td.get(("log_probs", "full")) - 0.5)  # every weight e^0.5
    moved = PolicyLoss(policy, opts)(td)["loss_objective"]
    assert float(moved) == pytest.approx(float(same) * torch.e**0.5, rel=1e-5)
    off = PolicyLoss(policy, replace(opts, importance_correction=None))(td)["loss_objective"]
    assert float(off) == pytest.approx(float(same))


_CLIP_PAIR = (0.2, 0.28)


@pytest.mark.parametrize(
    "declared",
    [
        {
            "aggregation": "token_mean",
            "kl_estimator": "k1",
            "kl_gradient": "score",
            "ratio": "sequence",
        },
        {"aggregation": "seq_mean_token_mean", "kl_estimator": "k2", "ratio": "none"},
        {"aggregation": "seq_mean_token_sum", "kl_gradient": "score", "ratio": "on_policy"},
        {"aggregation": "seq_mean_token_mean", "ratio": "gspo_token"},
        {"aggregation": "token_mean", "kl_estimator": "k2", "ratio": "cispo"},
    ],
    ids=["k1-score-sequence", "k2-none", "k3-score-on_policy", "gspo_token", "k2-cispo"],
)
def test_the_policy_loss_conforms_with_the_1_4_options_declared(declared: dict[str, str]) -> None:
    impl = Implementation(
        "loss",
        partial(PolicyLoss, clip_epsilon=_CLIP_PAIR, kl_coef=0.05, entropy_coef=0.01),
        name=f"PolicyLoss{declared}",
        capabilities={"kl_to_ref", "per_token_advantage", "diagnostics", "clip", "global_counts"},
        options=declared,
        extras={"clip_epsilon": _CLIP_PAIR},
    )
    rows = {r.id: r for r in run(impl).results}
    bad = {k: r.message for k, r in rows.items() if r.status in (Status.FAIL, Status.ERROR)}
    assert bad == {}
    for rid in ("LOSS-019", "LOSS-020", "LOSS-021"):
        # Declared or not, each option is checked: undeclared, at its default (loss 1.8).
        assert rows[rid].status == Status.PASS, rid


def _unbounded_below(ratio: str, *, built: tuple[float, float]) -> Implementation:
    return Implementation(
        "loss",
        partial(PolicyLoss, clip_epsilon=built),
        name=f"PolicyLoss(ratio={ratio!r}, clip_epsilon={built})",
        capabilities={"clip"},
        options={"aggregation": "token_mean", "ratio": ratio},
        extras={"clip_epsilon": (1.0, 0.28)},  # ε_low = 1: a lower bound of 0, no lower clip
    )


@pytest.mark.parametrize(
    ("ratio", "rid"), [("token", "LOSS-014"), ("sequence", "LOSS-022"), ("cispo", "LOSS-023")]
)
def test_a_clip_without_lower_bound_is_declared_and_checked(ratio: str, rid: str) -> None:
    # CISPO's weight (TRL, MiniMax-M1) is clipped from above only: ε_low = 1 declares that.
    ok = run_for(_unbounded_below(ratio, built=(1.0, 0.28)), rid)
    assert {r.id: r.status for r in ok.results}[rid] == Status.PASS, ok.results
    # The same declaration on a loss that clips below at 0.5 fails the requirement.
    bad = run_for(_unbounded_below(ratio, built=(0.5, 0.28)), rid)
    assert {r.id: r.status for r in bad.results}[rid] == Status.FAIL


def test_doc_declared_ratios_example_runs() -> None:

    doc = (ROOT / "docs" / "loss.md").read_text()
    start = doc.index("## Declared ratios: GSPO's token form and CISPO")
    found = re.search(r"```python\n(.*?)```", doc[start:], flags=re.S)
    assert found is not None
    exec(compile(found.group(1), "docs/loss.md", "exec"), {})
