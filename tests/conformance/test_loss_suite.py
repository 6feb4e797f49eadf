"""Correct loss designs the loss suite must pass, beside the reference and the adapters."""

from __future__ import annotations

from functools import partial
from typing import Any

import pytest
import torch

from posttrain.conformance import Status
from posttrain.conformance.runner import run
from posttrain.contracts.implementation import Implementation
from posttrain.reference_impls import PolicyGradientLoss
from tests.mutants.losses import DUAL_CLIP, PerRowForward


def _bad(impl: Implementation) -> dict[str, str]:
    rep = run(impl)
    return {r.id: r.message for r in rep.results if r.status in (Status.FAIL, Status.ERROR)}


def test_a_dual_clip_loss_conforms() -> None:
    assert _bad(DUAL_CLIP) == {}


def _no_keywords(policy: Any, **kwargs: Any) -> PolicyGradientLoss:
    if kwargs:
        raise TypeError(f"this loss takes no keyword arguments, found {sorted(kwargs)}")
    return PolicyGradientLoss(policy)


def _swallows(policy: Any, **kwargs: Any) -> PolicyGradientLoss:
    return PolicyGradientLoss(policy)


def test_a_factory_declaring_no_options_need_not_take_the_option_keyword() -> None:
    # It rejects aggregation= by name, as any keyword: LOSS-008 must not pass it one.
    impl = Implementation("loss", _no_keywords, name="no-options")
    assert _bad(impl) == {}


def test_a_factory_declaring_no_options_still_rejects_an_unknown_keyword() -> None:
    bad = _bad(Implementation("loss", _swallows, name="swallows-keywords"))
    assert list(bad) == ["LOSS-008"]
    assert "misspelt keyword 'aggregaton' was accepted" in bad["LOSS-008"]
    assert "token_meen" not in bad["LOSS-008"]  # no undeclared option's value was passed


@pytest.mark.parametrize(
    ("extras", "says"),
    [
        ({}, "Implementation.extras['clip_epsilon'] is None"),
        ({"clip_epsilon": (0.2,)}, "extras['clip_epsilon'] is (0.2,)"),
        ({"clip_epsilon": 0.2, "dual_clip": 1.1}, "extras['dual_clip'] is 1.1"),
    ],
)
def test_a_clip_declaration_without_usable_bounds_fails_by_name(
    extras: dict[str, Any], says: str
) -> None:
    impl = Implementation(
        "loss", PolicyGradientLoss, name="clip-undeclared", capabilities={"clip"}, extras=extras
    )
    bad = _bad(impl)
    # LOSS-014 and LOSS-021 (the default ratio, kept inside the bounds) both read the bounds.
    assert list(bad) == ["LOSS-014", "LOSS-021"]
    assert all(says in m for m in bad.values())


class _Logits:
    def __init__(self, logits: torch.Tensor) -> None:
        self.logits = logits


class _SlicedPolicy:
    """Calls ``policy`` on the batch cut another way and puts the logits back in place:
    ``halves`` (two calls of half the rows each) or ``left_pad`` (one call, rows left-padded)."""

    def __init__(self, policy: Any, how: str) -> None:
        self.policy, self.how = policy, how

    def __call__(self, *, input_ids: torch.Tensor, attention_mask: torch.Tensor) -> _Logits:
        if self.how == "halves":
            h = input_ids.shape[0] // 2
            # A single row is one call: a half of no rows is not a batch the policy takes.
            parts = [
                self.policy(input_ids=input_ids[s], attention_mask=attention_mask[s]).logits
                for s in (slice(0, h), slice(h, None))
                if len(input_ids[s])
            ]
            return _Logits(torch.cat(parts))
        t = input_ids.shape[1]
        lengths = attention_mask.sum(-1).tolist()
        ids, att = torch.zeros_like(input_ids), torch.zeros_like(attention_mask)
        for i, n in enumerate(lengths):
            ids[i, t - n :], att[i, t - n :] = input_ids[i, :n], 1
        logits = self.policy(input_ids=ids, attention_mask=att).logits
        back = [
            torch.cat([logits[i, t - n :], logits[i, : t - n] * 0]) for i, n in enumerate(lengths)
        ]
        return _Logits(torch.stack(back))


class _SlicedLoss(PolicyGradientLoss):
    def __init__(self, policy: Any, *, how: str, **kwargs: Any) -> None:
        super().__init__(_SlicedPolicy(policy, how), **kwargs)


@pytest.mark.parametrize("aggregation", ["token_mean", "seq_mean_token_sum_norm"])
@pytest.mark.parametrize("design", ["per_row", "halves", "left_pad"])
def test_a_loss_calling_the_policy_on_parts_of_the_batch_conforms(
    design: str, aggregation: str
) -> None:
    # LOSS-003 reads the gradient through every policy call, whatever rows and positions it
    # holds: one call per sequence trimmed to its length, two half batches, left padding.
    cls: Any = PerRowForward if design == "per_row" else partial(_SlicedLoss, how=design)
    impl = Implementation(
        "loss",
        partial(cls, aggregation=aggregation, clip_epsilon=0.2, kl_coef=0.05, t_norm=16),
        name=f"sliced-{design}",
        capabilities={"kl_to_ref", "per_token_advantage", "diagnostics", "clip"},
        options={"aggregation": aggregation},
        extras={"t_norm": 16, "clip_epsilon": 0.2},
    )
    assert _bad(impl) == {}


@pytest.mark.parametrize(
    ("aggregation", "one_batch", "accumulated"),
    [
        ("token_mean", "0.06667 and one of the 8-token answer 0.06667", "0.25 and 0.03846"),
        ("seq_mean_token_sum", "0.3333 and one of the 8-token answer 0.3333", "0.5 and 0.25"),
    ],
)
def test_a_loss_without_global_counts_is_measured_not_failed(
    aggregation: str, one_batch: str, accumulated: str
) -> None:
    impl = Implementation(
        "loss",
        partial(PolicyGradientLoss, aggregation=aggregation),
        name="no-global-counts",
        options={"aggregation": aggregation},
    )
    rep = run(impl)
    row = {r.id: r for r in rep.results}["LOSS-017"]
    assert row.status is Status.NOT_APPLICABLE
    assert f"gradient weight {one_batch}" in row.message
    assert f"mean of the 2 micro-batch losses, {accumulated}: its gradient depends" in row.message
    assert rep.ok
    assert not _bad(impl)


def test_global_counts_smaller_than_the_batch_are_refused_by_the_reference() -> None:
    from posttrain.contracts import GlobalCounts
    from posttrain.testing import llm_batch, tiny_causal_lm

    td = llm_batch(3, 8, vocab_size=64)
    loss = PolicyGradientLoss(tiny_causal_lm())
    with pytest.raises(ValueError, match="counts: this batch alone holds"):
        loss(td, counts=GlobalCounts(1, 1))
    with pytest.raises(TypeError, match="counts: expected a GlobalCounts"):
        loss(td, counts=(10, 3))


@pytest.mark.parametrize("aggregation", ["seq_mean_token_mean", "seq_mean_token_sum"])
def test_declared_options_reach_an_unbound_factory_in_every_requirement(aggregation: str) -> None:
    # PolicyGradientLoss itself, not a partial: built as token_mean unless the suite passes the
    # declared aggregation, which LOSS-003 and LOSS-016 to LOSS-018 would then fail.
    impl = Implementation(
        "loss",
        PolicyGradientLoss,
        name="unbound",
        capabilities={"per_token_advantage", "diagnostics", "global_counts"},
        options={"aggregation": aggregation},
    )
    assert _bad(impl) == {}


class _FloatDiagnostics(PolicyGradientLoss):
    """Diagnostics as Python floats (``.item()``), loss terms as tensors, in a plain dict."""

    def forward(self, td: Any, *, counts: Any = None) -> Any:
        out = super().forward(td, counts=counts)
        return {k: (v if k.startswith("loss_") else float(v)) for k, v in out.items()}


def test_diagnostics_as_python_floats_are_accepted() -> None:
    impl = Implementation(
        "loss",
        partial(_FloatDiagnostics, aggregation="token_mean", kl_coef=0.05),
        name="float-diagnostics",
        capabilities={"kl_to_ref", "per_token_advantage", "diagnostics", "global_counts"},
        options={"aggregation": "token_mean"},
    )
    rep = run(impl)
    assert _bad(impl) == {}
    assert {r.id: r.status for r in rep.results}["LOSS-018"] is Status.PASS


class _EntropyInObjective(PolicyGradientLoss):
    """Folds the full-vocabulary entropy bonus into ``loss_objective``: the objective then
    reaches the logits other than through the tokens' log-probs."""

    def forward(self, td: Any, *, counts: Any = None) -> Any:
        out = super().forward(td, counts=counts)
        out.set("loss_objective", out.get("loss_objective") + out.pop("loss_entropy"))
        return out


def test_loss_003_says_plainly_when_d_logp_cannot_be_observed() -> None:
    impl = Implementation(
        "loss",
        partial(_EntropyInObjective, entropy_coef=1.0),
        name="entropy-in-objective",
        options={"aggregation": "token_mean"},
    )
    bad = _bad(impl)
    assert "LOSS-003" in bad
    assert "d loss_objective / d logp could not be observed" in bad["LOSS-003"]
