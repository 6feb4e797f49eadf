"""Deliberately broken DPO losses: each must fail the suite with its requirement's id.

Each mutant is the reference ``DPOLoss`` with one realistic bug, switched on by name; the
pair-count one is a bug the reference itself had (pairs as half the rows holding a token:
an accuracy of 1.33 with an empty rejected row).
"""

from __future__ import annotations

from functools import partial
from typing import Any

import torch
from tensordict import TensorDict, TensorDictBase

from posttrain.contracts import LLM_LAYOUT_V1, GlobalCounts, Implementation
from posttrain.reference_impls._sequence_terms import batch_counts, mask_and_log_probs
from posttrain.reference_impls.dpo_loss import DPOLoss, _dpo_own
from tests.mutants.nll_losses import counted_mutant

__all__ = ["EXTRA_MUTANTS", "MUTANTS"]

K = LLM_LAYOUT_V1.key
RLP = K("ref_log_probs")
_BETA = 0.5


class BuggyDPO(DPOLoss):
    """The reference DPO (no SFT term) with one bug (``bug``), everything else as the reference."""

    def __init__(
        self, policy: Any, *, bug: str, token_reduction: str = "sum", label_smoothing: float = 0.0
    ) -> None:
        super().__init__(
            policy,
            beta=_BETA,
            preference_average=token_reduction == "mean",
            label_smoothing=label_smoothing,
        )
        self.bug = bug
        self._last: tuple[TensorDictBase, TensorDict] | None = None

    def forward(self, td: TensorDictBase, *, counts: GlobalCounts | None = None) -> TensorDict:
        if self.bug == "cached_by_batch":  # an evaluation call on the last batch serves its result
            if not torch.is_grad_enabled() and self._last is not None and self._last[0] is td:
                return self._last[1]
            out = self._forward(td, counts=counts)
            self._last = (td, out)
            return out
        return self._forward(td, counts=counts)

    def _forward(self, td: TensorDictBase, *, counts: GlobalCounts | None = None) -> TensorDict:
        bug = self.bug
        if bug == "reference_free" and RLP not in td.keys(True):
            td = td.clone().set(RLP, torch.zeros(td.get(K("tokens")).shape))
        if bug == "drops_odd_row" and td.batch_size[0] % 2:
            td = td[: td.batch_size[0] - 1]
        self.layout.validate_batch(
            td, require=("ref_log_probs",), any_float=True, context="DPOLoss"
        )
        if td.batch_size[0] % 2:
            raise ValueError(f"td: expected an even number of rows, found {list(td.batch_size)}")
        mask, logp = mask_and_log_probs(self.policy, td, self.layout)
        own = _dpo_own(mask)
        if bug == "half_the_rows":
            own = GlobalCounts(own.tokens, int(mask.any(-1).sum()))
        if bug == "either_row_counts":
            own = GlobalCounts(own.tokens, 2 * int((mask[0::2] | mask[1::2]).any(-1).sum()))
        if bug == "ignores_counts":
            counts = None
        c = batch_counts(mask, counts, own)
        m = mask.to(logp.dtype)
        ref = torch.where(mask, td.get(RLP).to(logp.dtype), 0.0)
        if bug == "reference_added":
            ref = -ref
        n_tok = m.sum(-1)
        if bug == "rejected_detached":
            logp = torch.cat([logp[0::2, None], logp[1::2, None].detach()], 1).flatten(0, 1)
        rewards = ((logp - ref) * m).sum(-1)
        if self.preference_average != (bug == "reduction_flipped"):
            rewards = rewards / n_tok.clamp_min(1)
        chosen, rejected = rewards[0::2], rewards[1::2]
        if bug == "swapped":
            chosen, rejected = rejected, chosen
        valid = (n_tok[0::2] > 0).to(logp.dtype)
        if bug == "either_row_counts":
            valid = ((n_tok[0::2] > 0) | (n_tok[1::2] > 0)).to(logp.dtype)
        pairs = max(c.sequences, 1) / 2
        beta = self.beta * self.beta if bug == "beta_twice" else self.beta
        ls, eps = torch.nn.functional.logsigmoid, self.label_smoothing
        margin = beta * (chosen - rejected)
        pair = -(1 - eps) * ls(margin) - eps * ls(-margin)
        if bug == "smoothing_sign":  # cDPO's ε term added with the wrong sign
            pair = -(1 - eps) * ls(margin) + eps * ls(-margin)
        if bug == "log_of_sigmoid":  # -log(sigmoid(x)): inf once sigmoid underflows
            pair = -torch.log(torch.sigmoid(margin))
        pref = (pair * valid).sum() / pairs
        if bug == "shape_one":
            pref = pref.reshape(1)
        if bug == "detached":
            pref = pref.detach()
        out: dict[str, torch.Tensor] = {"loss_preference": pref}
        with torch.no_grad():
            if bug == "metrics_per_micro_batch":
                pairs = max(own.sequences, 1) / 2
            wins = chosen >= rejected if bug == "ties_win" else chosen > rejected
            if bug == "win_from_sigmoid":  # σ(β·Δ) > 1/2: 1/2 exactly below β·Δ of about 6e-8
                wins = torch.sigmoid(margin.float()) > 0.5
            scale = self.beta if bug == "rewards_times_beta" else 1.0
            out["accuracy"] = (wins.to(logp.dtype) * valid).sum() / pairs
            out["rewards_chosen_mean"] = scale * (chosen * valid).sum() / pairs
            out["rewards_rejected_mean"] = scale * (rejected * valid).sum() / pairs
        return TensorDict(out, batch_size=[])


def _impl(req: str, bug: str, reduction: str = "sum") -> Implementation:
    opts = {"token_reduction": reduction}
    return counted_mutant("dpo_loss", BuggyDPO, req, bug, opts, {"beta": _BETA})


MUTANTS: dict[str, Implementation] = {
    "DPO-001": _impl("DPO-001", "shape_one"),
    "DPO-002": _impl("DPO-002", "detached"),
    "DPO-003": _impl("DPO-003", "swapped"),
    "DPO-004": _impl("DPO-004", "rejected_detached"),
    "DPO-005": _impl("DPO-005", "ties_win"),
    "DPO-006": _impl("DPO-006", "half_the_rows"),
    "DPO-007": _impl("DPO-007", "ignores_counts"),
    "DPO-008": _impl("DPO-008", "metrics_per_micro_batch"),
    "DPO-009": _impl("DPO-009", "reference_free"),
    "DPO-010": Implementation(
        "dpo_loss",
        partial(BuggyDPO, bug="smoothing_sign"),
        name="mutant-DPO-010-smoothing_sign",
        capabilities={"global_counts", "label_smoothing"},
        options={"token_reduction": "sum"},
        extras={"beta": _BETA, "label_smoothing": 0.1},
    ),
}
"""Requirement id -> a DPO loss that breaks exactly that requirement."""

EXTRA_MUTANTS: list[tuple[str, Implementation]] = [
    ("DPO-003", _impl("DPO-003", "beta_twice")),
    ("DPO-003", _impl("DPO-003", "reference_added")),
    ("DPO-003", _impl("DPO-003", "reduction_flipped")),
    ("DPO-003", _impl("DPO-003", "reduction_flipped", reduction="mean")),
    ("DPO-005", _impl("DPO-005", "rewards_times_beta")),
    ("DPO-006", _impl("DPO-006", "either_row_counts")),
    ("DPO-009", _impl("DPO-009", "drops_odd_row")),
    ("DPO-001", _impl("DPO-001", "log_of_sigmoid")),
    ("DPO-005", _impl("DPO-005", "win_from_sigmoid")),
    ("DPO-003", _impl("DPO-003", "cached_by_batch")),
]
"""Further bugs a requirement must catch besides its main mutant: (requirement id, mutant)."""
