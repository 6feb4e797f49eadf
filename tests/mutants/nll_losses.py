"""Deliberately broken NLL (SFT) losses: each must fail the suite with its requirement's id.

Each mutant is the reference ``NLLLoss`` with one realistic bug, switched on by name.
"""

from __future__ import annotations

from functools import partial
from typing import Any

import torch
from tensordict import TensorDict, TensorDictBase

from posttrain.contracts import LLM_LAYOUT_V1, GlobalCounts, Implementation
from posttrain.reference_impls._sequence_terms import batch_counts, mask_and_log_probs
from posttrain.reference_impls.nll_loss import NLLLoss

__all__ = ["EXTRA_MUTANTS", "MUTANTS"]

K = LLM_LAYOUT_V1.key
TOK, ATT, ASST = K("tokens"), K("attention_mask"), K("assistant_mask")


class BuggyNLL(NLLLoss):
    """The reference NLL with one bug (``bug``), everything else as the reference."""

    def __init__(
        self,
        policy: Any,
        *,
        bug: str,
        aggregation: str = "token_mean",
        label_smoothing: float = 0.0,
    ) -> None:
        super().__init__(policy, aggregation=aggregation, label_smoothing=label_smoothing)
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
        if bug == "missing_mask_is_attention" and ASST not in td.keys(True):
            td = td.clone().set(ASST, td.get(ATT).clone())
        if bug == "masks_as_weights":
            td = td.clone()
            for key in (ASST, ATT):
                if key in td.keys(True):
                    td.set(key, td.get(key) != 0, inplace=False)
        self.layout.validate_batch(td, context="NLLLoss")
        if bug == "shifted":  # the logits at t score token t
            tokens, attn = td.get(TOK), td.get(ATT)
            mask = td.get(ASST) & attn
            mask = torch.cat([torch.zeros_like(mask[:, :1]), mask[:, 1:]], dim=1)
            logits = self.policy(input_ids=tokens, attention_mask=attn.long()).logits
            lp = torch.log_softmax(logits.float(), -1).gather(-1, tokens[..., None]).squeeze(-1)
            logp = torch.where(mask, lp, 0.0)
        elif bug == "no_attention_mask":  # model(input_ids) alone: the real tokens see padding
            tokens, attn = td.get(TOK), td.get(ATT)
            mask = td.get(ASST) & attn
            mask = torch.cat([torch.zeros_like(mask[:, :1]), mask[:, 1:]], dim=1)
            lp = torch.log_softmax(self.policy(input_ids=tokens).logits[:, :-1].float(), -1)
            lp = lp.gather(-1, tokens[:, 1:, None]).squeeze(-1)
            logp = torch.where(mask, torch.cat([torch.zeros_like(lp[:, :1]), lp], 1), 0.0)
        elif bug == "log_of_softmax":  # log(softmax): -inf once a probability underflows
            tokens, attn = td.get(TOK), td.get(ATT)
            mask = td.get(ASST) & attn
            mask = torch.cat([torch.zeros_like(mask[:, :1]), mask[:, 1:]], dim=1)
            logits = self.policy(input_ids=tokens, attention_mask=attn.long()).logits
            lp = torch.log(torch.softmax(logits[:, :-1].float(), -1))
            lp = lp.gather(-1, tokens[:, 1:, None]).squeeze(-1)
            logp = torch.where(mask, torch.cat([torch.zeros_like(lp[:, :1]), lp], 1), 0.0)
        else:
            mask, logp = mask_and_log_probs(self.policy, td, self.layout, self.label_smoothing)
        if bug == "log_clamped":  # log p floored at -100 (a clamp against -inf, as BCE's)
            logp = logp.clamp_min(-100.0)
        if bug == "pad_id_ignored":  # cross_entropy(ignore_index=pad_token_id), the pad id 0
            mask = mask & (td.get(TOK) != 0)
        if bug == "trains_on_prompt":
            attn = td.get(ATT).clone()
            attn[:, 0] = False
            mask = attn
            _, full = mask_and_log_probs(self.policy, td.clone().set(ASST, attn), self.layout)
            logp = torch.where(mask, full, 0.0)
        if bug == "counts_position_0":
            mask = mask.clone()
            mask[:, 0] = (td.get(ASST) & td.get(ATT))[:, 0]
        if bug == "ignores_counts":
            counts = None
        c = batch_counts(mask, counts)
        if bug == "counts_every_row" and counts is None:
            c = GlobalCounts(c.tokens, mask.shape[0])
        m = mask.to(logp.dtype)
        nll = -logp
        if bug == "label_smoothing":  # HF Trainer's LabelSmoother, eps 0.1, on the same logits
            tokens, attn = td.get(TOK), td.get(ATT)
            logits = self.policy(input_ids=tokens, attention_mask=attn.long()).logits
            uniform = -torch.log_softmax(logits[:, :-1].float(), -1).mean(-1)
            uniform = torch.cat([torch.zeros_like(uniform[:, :1]), uniform], 1)
            nll = 0.9 * nll + 0.1 * uniform
        if bug in ("z_loss", "smoothing_sign"):
            tokens, attn = td.get(TOK), td.get(ATT)
            logits = self.policy(input_ids=tokens, attention_mask=attn.long()).logits[:, :-1]
            if bug == "z_loss":  # PaLM's z-loss, 1e-4 logsumexp², left on inside loss_nll
                extra = 1e-4 * torch.logsumexp(logits.float(), -1) ** 2
            else:  # the smoothing term's sign flipped: (1 - ε)·NLL - ε·mean_v(-log p_v)
                eps = self.label_smoothing
                nll = -(1 - eps) * mask_and_log_probs(self.policy, td, self.layout)[1]
                extra = eps * torch.log_softmax(logits.float(), -1).mean(-1)
            nll = nll + torch.cat([torch.zeros_like(extra[:, :1]), extra], 1)
        if self.aggregation == "token_mean":
            loss = (nll * m).sum() / max(c.tokens, 1)
        else:
            per_row = (nll * m).sum(-1)
            if self.aggregation == "seq_mean_token_mean":
                if bug == "padded_width":
                    per_row = per_row / m.shape[1]
                elif bug == "no_clamp":
                    per_row = per_row / m.sum(-1)
                else:
                    per_row = per_row / m.sum(-1).clamp_min(1)
            loss = per_row.sum() / max(c.sequences, 1)
        if bug == "shape_one":
            loss = loss.reshape(1)
        if bug == "detached":
            loss = loss.detach()
        return TensorDict({"loss_nll": loss, "num_unmasked_tokens": m.sum().detach()}, [])


def counted_mutant(
    contract: str,
    cls: Any,
    req: str,
    bug: str,
    options: dict[str, Any],
    extras: dict[str, Any] | None = None,
) -> Implementation:
    """A mutant of contract ``contract`` declaring global_counts: ``cls`` with ``bug`` on.

    >>> counted_mutant("nll_loss", BuggyNLL, "NLL-001", "shape_one", {}).name
    'mutant-NLL-001-shape_one'
    """
    return Implementation(
        contract,
        partial(cls, bug=bug),
        name=f"mutant-{req}-{bug}",
        capabilities={"global_counts"},
        options=options,
        extras={} if extras is None else extras,
    )


def _impl(req: str, bug: str, agg: str = "token_mean") -> Implementation:
    return counted_mutant("nll_loss", BuggyNLL, req, bug, {"aggregation": agg})


MUTANTS: dict[str, Implementation] = {
    "NLL-001": _impl("NLL-001", "shape_one"),
    "NLL-002": _impl("NLL-002", "detached"),
    "NLL-003": _impl("NLL-003", "trains_on_prompt"),
    "NLL-004": _impl("NLL-004", "label_smoothing"),
    "NLL-005": _impl("NLL-005", "padded_width", agg="seq_mean_token_mean"),
    "NLL-006": _impl("NLL-006", "missing_mask_is_attention"),
    "NLL-007": _impl("NLL-007", "ignores_counts"),
    "NLL-008": _impl("NLL-008", "counts_every_row", agg="seq_mean_token_sum"),
    "NLL-009": Implementation(
        "nll_loss",
        partial(BuggyNLL, bug="smoothing_sign"),
        name="mutant-NLL-009-smoothing_sign",
        capabilities={"global_counts", "label_smoothing"},
        options={"aggregation": "token_mean"},
        extras={"label_smoothing": 0.1},
    ),
}
"""Requirement id -> an NLL loss that breaks exactly that requirement."""

EXTRA_MUTANTS: list[tuple[str, Implementation]] = [
    ("NLL-003", _impl("NLL-003", "shifted")),
    ("NLL-003", _impl("NLL-003", "counts_position_0")),
    ("NLL-006", _impl("NLL-006", "masks_as_weights")),
    # A row without an assistant token makes its 0/0 NaN: every batch with one fails NLL-001.
    ("NLL-001", _impl("NLL-001", "no_clamp", agg="seq_mean_token_mean")),
    ("NLL-003", _impl("NLL-003", "pad_id_ignored")),
    ("NLL-004", _impl("NLL-004", "z_loss")),
    ("NLL-005", _impl("NLL-005", "no_attention_mask")),
    # Logits of a few hundred: log p far below -100 for most assistant tokens.
    ("NLL-003", _impl("NLL-003", "log_clamped")),
    ("NLL-001", _impl("NLL-001", "log_of_softmax")),
    # One loss object scoring the same batch after the policy's weights changed.
    ("NLL-003", _impl("NLL-003", "cached_by_batch")),
]
"""Further bugs a requirement must catch besides its main mutant: (requirement id, mutant)."""
