"""Reference preference (DPO) loss on the LLM layout.

A DPO batch holds its pairs as consecutive rows: row 2i is pair i's chosen answer, row 2i + 1
its rejected one (NeMo-RL's interleaving); it also reads ``ref_log_probs``. It takes
``counts=GlobalCounts(...)`` for the global batch (capability ``global_counts``).
"""

from __future__ import annotations

import math
from typing import Any

import torch
from tensordict import TensorDict, TensorDictBase

from posttrain.contracts.implementation import Implementation
from posttrain.contracts.layout import LLM_LAYOUT_V1, Layout
from posttrain.contracts.loss import GlobalCounts
from posttrain.reference_impls._sequence_terms import (
    SMOOTHING,
    batch_counts,
    checked_smoothing,
    is_real,
    mask_and_log_probs,
)


def _dpo_own(mask: torch.Tensor) -> GlobalCounts:
    # Two rows per pair whose chosen row holds an assistant token (the pairs the loss
    # averages over), whatever the rejected row holds: NeMo-RL's global_valid_seqs counts
    # the rows of valid pairs, and an empty rejected row must not make a half pair.
    return GlobalCounts(int(mask.sum()), 2 * int(mask[0::2].any(-1).sum()))


class DPOLoss(torch.nn.Module):
    """Direct preference optimization (Rafailov et al.) with NeMo-RL's ``DPOLossFn`` options.

    Per pair, the reward of an answer is sum_t (log p - log p_ref) over its assistant tokens
    (their mean with ``preference_average``); the loss is -log sigmoid(beta (r_chosen -
    r_rejected)) averaged over pairs (conservative DPO's -(1 - ε) log sigmoid(beta Δ) - ε log
    sigmoid(-beta Δ) with ``label_smoothing`` ε, as TRL's sigmoid loss), times ``preference_weight``, plus ``sft_weight`` times
    the chosen answers' NLL (a per-answer sum, or mean with ``sft_average``, averaged over
    pairs). Rows 2i and 2i + 1 are pair i's chosen and rejected answers; a pair whose chosen
    row has no assistant token weighs nothing. The loss averages over the pairs whose chosen
    row holds an assistant token (a pair with an empty rejected row counts: it still has a
    preference term). ``counts.sequences`` is twice that number, NeMo-RL's
    ``global_valid_seqs`` (the rows of the valid pairs); :meth:`counts` gives it for one
    micro-batch, to sum over micro-batches or ranks (``GlobalCounts.of`` counts rows with a
    token instead, and differs when a rejected row is empty).

    Returns ``loss_preference`` (and ``loss_sft`` when ``sft_weight > 0``) and the metrics
    ``preference_loss``, ``sft_loss``, ``accuracy``, ``rewards_chosen_mean``,
    ``rewards_rejected_mean``.

    Example:
        >>> import torch
        >>> from posttrain.testing import llm_batch, tiny_causal_lm
        >>> policy = tiny_causal_lm(vocab_size=64)
        >>> td = llm_batch(4, 8, vocab_size=64)
        >>> td = td.set(("next", "ref_log_probs", "full"), torch.zeros(4, 8))
        >>> out = DPOLoss(policy, beta=0.1)(td)
        >>> sorted(k for k in out.keys() if k.startswith("loss_"))
        ['loss_preference']
    """

    def __init__(
        self,
        policy: Any,
        *,
        beta: float = 0.05,
        preference_weight: float = 1.0,
        sft_weight: float = 0.0,
        preference_average: bool = False,
        sft_average: bool = False,
        label_smoothing: float = 0.0,
        layout: Layout = LLM_LAYOUT_V1,
    ) -> None:
        super().__init__()
        for name, v in (
            ("beta", beta),
            ("preference_weight", preference_weight),
            ("sft_weight", sft_weight),
        ):
            if not is_real(v) or not math.isfinite(v) or v < 0:
                raise ValueError(f"{name}: expected a finite number >= 0, found {v!r}")
        self.policy = policy
        self.beta = float(beta)
        self.preference_weight = float(preference_weight)
        self.sft_weight = float(sft_weight)
        self.preference_average = bool(preference_average)
        self.sft_average = bool(sft_average)
        self.label_smoothing = checked_smoothing(label_smoothing, 0.5)
        self.layout = layout

    @staticmethod
    def counts(td: TensorDictBase, layout: Layout = LLM_LAYOUT_V1) -> GlobalCounts:
        """This batch's DPO counts: its assistant tokens, and two rows per pair whose chosen
        row holds an assistant token.

        Example:
            >>> from posttrain.testing import llm_batch
            >>> td = llm_batch(4, 8, vocab_size=64)
            >>> td["masks", "all_assistant_mask"][3] = False  # pair 1's rejected row is empty
            >>> DPOLoss.counts(td).sequences  # still 2 pairs
            4
        """
        k = layout.key
        mask = td.get(k("assistant_mask")) & td.get(k("attention_mask"))
        mask = torch.cat([torch.zeros_like(mask[:, :1]), mask[:, 1:]], dim=1)
        return _dpo_own(mask)

    def forward(self, td: TensorDictBase, *, counts: GlobalCounts | None = None) -> TensorDict:
        """The DPO loss of the pairs in ``td`` (rows 2i chosen, 2i + 1 rejected)."""
        self.layout.validate_batch(
            td, require=("ref_log_probs",), any_float=True, context="DPOLoss"
        )
        if td.batch_size.numel() == 0 or td.batch_size[0] % 2:
            raise ValueError(
                f"td: expected an even number of rows (chosen, rejected pairs), found "
                f"{list(td.batch_size)}"
            )
        mask, logp = mask_and_log_probs(self.policy, td, self.layout)
        c = batch_counts(mask, counts, _dpo_own(mask))
        m = mask.to(logp.dtype)
        ref = torch.where(mask, td.get(self.layout.key("ref_log_probs")).to(logp.dtype), 0.0)
        n_tok = m.sum(-1)
        rewards = ((logp - ref) * m).sum(-1)
        if self.preference_average:
            rewards = rewards / n_tok.clamp_min(1)
        chosen, rejected = rewards[0::2], rewards[1::2]
        valid = (n_tok[0::2] > 0).to(logp.dtype)
        pairs = max(c.sequences, 1) / 2
        margin = self.beta * (chosen - rejected)
        eps = self.label_smoothing  # conservative DPO: the preference is wrong with prob. ε
        ls = torch.nn.functional.logsigmoid
        pair = -(1 - eps) * ls(margin) - eps * ls(-margin) if eps > 0 else -ls(margin)
        pref = (pair * valid).sum() / pairs
        out: dict[str, torch.Tensor] = {"loss_preference": self.preference_weight * pref}
        sft = torch.zeros((), dtype=logp.dtype)
        if self.sft_weight > 0:
            per_row = -(logp * m).sum(-1)
            if self.sft_average:
                per_row = per_row / n_tok.clamp_min(1)
            sft = (per_row[0::2] * valid).sum() / pairs
            out["loss_sft"] = self.sft_weight * sft
        with torch.no_grad():
            out["preference_loss"] = pref.detach()
            out["sft_loss"] = sft.detach()
            out["accuracy"] = ((chosen > rejected).to(logp.dtype) * valid).sum() / pairs
            out["rewards_chosen_mean"] = (chosen * valid).sum() / pairs
            out["rewards_rejected_mean"] = (rejected * valid).sum() / pairs
        return TensorDict(out, batch_size=[])


_DPO_BETA = 0.5  # large enough that σ(-β·Δ) differs visibly from 1/2 on the suite's pairs


def make_dpo_loss(
    policy: Any,
    *,
    token_reduction: str = "sum",
    beta: float = _DPO_BETA,
    label_smoothing: float = 0.0,
) -> DPOLoss:
    """The ``dpo_loss`` factory: :class:`DPOLoss` with option ``token_reduction`` and
    ``label_smoothing`` (capability ``label_smoothing``) by name.

    Example:
        >>> from posttrain.testing import tiny_causal_lm
        >>> make_dpo_loss(tiny_causal_lm(vocab_size=64), token_reduction="mean").preference_average
        True
        >>> make_dpo_loss(tiny_causal_lm(vocab_size=64), token_reduction="avg")
        Traceback (most recent call last):
        ...
        ValueError: token_reduction: expected 'sum' or 'mean', found 'avg'
    """
    if token_reduction not in ("sum", "mean"):
        raise ValueError(f"token_reduction: expected 'sum' or 'mean', found {token_reduction!r}")
    return DPOLoss(
        policy,
        beta=beta,
        preference_average=token_reduction == "mean",
        label_smoothing=label_smoothing,
    )


def _dpo_impl(token_reduction: str) -> Implementation:
    return Implementation(
        "dpo_loss",
        make_dpo_loss,
        name=f"posttrain.DPOLoss[{token_reduction}]",
        capabilities={"global_counts", "label_smoothing"},
        options={"token_reduction": token_reduction},
        extras={"beta": _DPO_BETA, "label_smoothing": SMOOTHING},
        description="Reference sigmoid DPO loss over interleaved pairs (NeMo-RL's DPOLossFn).",
    )


DPO_LOSS_SUM = _dpo_impl("sum")
DPO_LOSS_MEAN = _dpo_impl("mean")
DPO_LOSSES: tuple[Implementation, ...] = (DPO_LOSS_SUM, DPO_LOSS_MEAN)
"""The reference DPO loss in each token reduction (entry points ``reference-dpo-loss-*``)."""
