"""Deliberately broken losses: each must fail the suite with its requirement's id.

Each mutant is the reference ``PolicyGradientLoss`` with one realistic bug, several of them
TorchRL 0.14 ``GRPOLoss``'s own (shape [1] terms, swallowed keyword arguments, silent
fallback for unknown aggregations, diagnostics diluted by prompt and padding positions).
"""

from __future__ import annotations

from functools import partial
from typing import Any

import torch
from tensordict import TensorDict, TensorDictBase

from posttrain.contracts import AGGREGATIONS, LLM_LAYOUT_V1, Implementation
from posttrain.reference_impls import PolicyGradientLoss

__all__ = ["EXTRA_MUTANTS", "MUTANTS"]

K = LLM_LAYOUT_V1.key
ASST, ATT, SLP, RLP, ADV = (
    K("assistant_mask"),
    K("attention_mask"),
    K("sample_log_probs"),
    K("ref_log_probs"),
    K("advantage"),
)


class _Edit(PolicyGradientLoss):
    """The reference with a hook before (on the batch) and after (on the outputs)."""

    def pre(self, td: TensorDictBase) -> TensorDictBase:
        return td

    def post(self, out: TensorDict, td: TensorDictBase) -> TensorDict:
        return out

    def forward(self, td: TensorDictBase) -> TensorDict:
        return self.post(super().forward(self.pre(td)), td)


class ShapeOneObjective(_Edit):  # GRPOLoss's prompt_mean bug
    def post(self, out: TensorDict, td: TensorDictBase) -> TensorDict:
        return TensorDict(
            {k: (v.reshape(1) if k == "loss_objective" else v) for k, v in out.items()}
        )


class Detached(_Edit):
    def post(self, out: TensorDict, td: TensorDictBase) -> TensorDict:
        return out.detach()


class TokenMeanWhateverDeclared(PolicyGradientLoss):
    def _weights(self, mask: torch.Tensor) -> torch.Tensor:
        m = mask.float()
        return m / m.sum()


class TrainsOnPrompt(_Edit):
    """Zero-fills NaN log-probs and trains on every attended token, prompt included."""

    def pre(self, td: TensorDictBase) -> TensorDictBase:
        td = td.clone()
        td.set(SLP, td.get(SLP).nan_to_num(0.0))
        td.set(RLP, td.get(RLP).nan_to_num(0.0))
        td.set(ASST, td.get(ATT).clone())
        return td


class DividesByAllPositions(PolicyGradientLoss):
    def _weights(self, mask: torch.Tensor) -> torch.Tensor:
        return mask.float() / mask.numel()


class NormalisesConsecutivePairs(_Edit):
    """Treats consecutive rows as a group (implicit grouping): order now matters."""

    def pre(self, td: TensorDictBase) -> TensorDictBase:
        td = td.clone()
        adv = td.get(ADV)
        pairs = adv.reshape(-1, 2, *adv.shape[1:]) if adv.shape[0] % 2 == 0 else adv[None]
        td.set(ADV, (pairs - pairs.mean(1, keepdim=True) + 0.3 * pairs[:, :1]).reshape(adv.shape))
        return td


class MutatesInput(_Edit):
    def pre(self, td: TensorDictBase) -> TensorDictBase:
        td.set_(SLP, td.get(SLP).nan_to_num(0.0))
        return td


class SwallowsOptions(PolicyGradientLoss):  # GRPOLoss: **kwargs and a silent fallback
    def __init__(self, policy: Any, *, aggregation: str = "token_mean", **kwargs: Any) -> None:
        super().__init__(
            policy,
            aggregation=aggregation if aggregation in AGGREGATIONS else "token_mean",
            kl_coef=0.05,
            entropy_coef=0.01,
        )


class FillsMissingFields(_Edit):
    def pre(self, td: TensorDictBase) -> TensorDictBase:
        td = td.clone()
        if ADV not in td.keys(True, True):
            td.set(ADV, torch.zeros(td.batch_size))
        td.set(SLP, td.get(SLP).float())
        return td


class KlOverAttention(_Edit):
    def post(self, out: TensorDict, td: TensorDictBase) -> TensorDict:
        att = td.get(ATT).float()
        ref = td.get(RLP).nan_to_num(0.0)
        own = td.get(SLP).nan_to_num(0.0)
        d = (ref - own) * att
        out.set(
            "loss_kl_to_ref",
            out.get("loss_kl_to_ref") + self.kl_coef * (d.exp() - d - 1).sum() / att.sum(),
        )
        return out


class KlOverPositions(
    _Edit
):  # TorchRL GRPOLoss._kl_to_ref: masked k3, then .mean() over all positions
    def post(self, out: TensorDict, td: TensorDictBase) -> TensorDict:
        mask = td.get(ASST)
        d = torch.where(mask, td.get(RLP) - td.get(SLP), 0.0)
        out.set("loss_kl_to_ref", self.kl_coef * (d.expm1() - d).mean())
        return out


class SumsTokenAdvantages(_Edit):
    def pre(self, td: TensorDictBase) -> TensorDictBase:
        adv = td.get(ADV)
        if adv.ndim == 2:
            td = td.clone()
            td.set(ADV, adv.nan_to_num(0.0).sum(-1), inplace=False)
        return td


class DilutedDiagnostics(_Edit):  # TorchRL: averaged over every attended position
    def post(self, out: TensorDict, td: TensorDictBase) -> TensorDict:
        share = td.get(ASST).float().sum() / td.get(ATT).float().sum()
        for k in ("clip_fraction", "kl_approx", "entropy"):
            out.set(k, out.get(k) * share)
        return out


def _impl(req: str, cls: type, agg: str = "seq_mean_token_mean", **kw: Any) -> Implementation:
    kw.setdefault("capabilities", {"kl_to_ref", "per_token_advantage", "diagnostics"})
    factory = (
        partial(cls, aggregation=agg, kl_coef=0.05, entropy_coef=0.01)
        if cls is not SwallowsOptions
        else cls
    )
    return Implementation(
        "loss", factory, name=f"mutant-{req}-{cls.__name__}", options={"aggregation": agg}, **kw
    )


MUTANTS: dict[str, Implementation] = {
    "LOSS-001": _impl("LOSS-001", ShapeOneObjective),
    "LOSS-002": _impl("LOSS-002", Detached),
    "LOSS-003": _impl("LOSS-003", TokenMeanWhateverDeclared),
    "LOSS-004": _impl("LOSS-004", TrainsOnPrompt),
    "LOSS-005": _impl("LOSS-005", DividesByAllPositions, agg="token_mean"),
    "LOSS-006": _impl("LOSS-006", NormalisesConsecutivePairs),
    "LOSS-007": _impl("LOSS-007", MutatesInput),
    "LOSS-008": _impl("LOSS-008", SwallowsOptions, agg="token_mean"),
    "LOSS-009": _impl("LOSS-009", FillsMissingFields),
    "LOSS-010": _impl("LOSS-010", KlOverAttention),
    "LOSS-011": _impl("LOSS-011", SumsTokenAdvantages),
    "LOSS-012": _impl("LOSS-012", DilutedDiagnostics),
    "LOSS-013": _impl("LOSS-013", PolicyGradientLoss, capabilities={"ragged"}),
}
"""Requirement id -> a loss that breaks exactly that requirement."""

EXTRA_MUTANTS: list[tuple[str, Implementation]] = [
    ("LOSS-010", _impl("LOSS-010", KlOverPositions)),
]
"""Further bugs a requirement must catch besides its main mutant: (requirement id, mutant)."""
