"""Reference supervised (NLL) loss on the LLM layout: -log p of the assistant tokens.

It takes ``counts=GlobalCounts(...)`` for the global batch, as the policy-gradient loss does
(capability ``global_counts``).
"""

from __future__ import annotations

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
    mask_and_log_probs,
)

NLL_AGGREGATIONS = ("token_mean", "seq_mean_token_sum", "seq_mean_token_mean")
"""How :class:`NLLLoss` reduces -log p: over the global token count, or per sequence (sum or
mean over its tokens) over the global sequence count.

Example:
    >>> NLL_AGGREGATIONS[0]
    'token_mean'
"""


class NLLLoss(torch.nn.Module):
    """Supervised fine-tuning loss: -log p of the assistant tokens (NeMo-RL's ``NLLLossFn``,
    TorchRL's ``SFTLoss`` without its KL term).

    Returns ``loss_nll`` and ``num_unmasked_tokens`` (this batch's).

    Example:
        >>> from posttrain.testing import llm_batch, tiny_causal_lm
        >>> out = NLLLoss(tiny_causal_lm(vocab_size=64))(llm_batch(2, 8, vocab_size=64))
        >>> sorted(out.keys())
        ['loss_nll', 'num_unmasked_tokens']
        >>> NLLLoss(tiny_causal_lm(vocab_size=64), aggregation="sum")
        Traceback (most recent call last):
        ...
        ValueError: aggregation: expected one of ['token_mean', 'seq_mean_token_sum', 'seq_mean_token_mean'], found 'sum'

    ``label_smoothing=ε`` smooths the targets as ``torch.nn.functional.cross_entropy`` does:
    each token's term is (1 - ε)·(-log p(token)) + ε·mean_v(-log p(v)).

        >>> NLLLoss(tiny_causal_lm(vocab_size=64), label_smoothing=0.1).label_smoothing
        0.1
    """

    def __init__(
        self,
        policy: Any,
        *,
        aggregation: str = "token_mean",
        label_smoothing: float = 0.0,
        layout: Layout = LLM_LAYOUT_V1,
    ) -> None:
        super().__init__()
        if aggregation not in NLL_AGGREGATIONS:
            raise ValueError(
                f"aggregation: expected one of {list(NLL_AGGREGATIONS)}, found {aggregation!r}"
            )
        self.policy = policy
        self.aggregation = aggregation
        self.label_smoothing = checked_smoothing(label_smoothing, 1.0)
        self.layout = layout

    def forward(self, td: TensorDictBase, *, counts: GlobalCounts | None = None) -> TensorDict:
        """The NLL of ``td``'s assistant tokens, normalized by ``counts`` (default: td's own)."""
        self.layout.validate_batch(td, context=type(self).__name__)
        mask, logp = mask_and_log_probs(self.policy, td, self.layout, self.label_smoothing)
        c = batch_counts(mask, counts)
        m = mask.to(logp.dtype)
        if self.aggregation == "token_mean":
            loss = -(logp * m).sum() / max(c.tokens, 1)
        else:
            per_row = -(logp * m).sum(-1)
            if self.aggregation == "seq_mean_token_mean":
                per_row = per_row / m.sum(-1).clamp_min(1)
            loss = per_row.sum() / max(c.sequences, 1)
        return TensorDict(
            {"loss_nll": loss, "num_unmasked_tokens": m.sum().detach()}, batch_size=[]
        )


def _nll_impl(aggregation: str) -> Implementation:
    return Implementation(
        "nll_loss",
        NLLLoss,
        name=f"posttrain.NLLLoss[{aggregation}]",
        capabilities={"global_counts", "label_smoothing"},
        options={"aggregation": aggregation},
        extras={"label_smoothing": SMOOTHING},
        description="Reference supervised NLL loss over the assistant tokens (NeMo-RL's NLLLossFn).",
    )


NLL_LOSS_TOKEN_MEAN = _nll_impl("token_mean")
NLL_LOSS_SEQ_MEAN_TOKEN_MEAN = _nll_impl("seq_mean_token_mean")
NLL_LOSS_SEQ_MEAN_TOKEN_SUM = _nll_impl("seq_mean_token_sum")
NLL_LOSSES: tuple[Implementation, ...] = (
    NLL_LOSS_TOKEN_MEAN,
    NLL_LOSS_SEQ_MEAN_TOKEN_MEAN,
    NLL_LOSS_SEQ_MEAN_TOKEN_SUM,
)
"""The reference NLL loss in each aggregation (entry points ``reference-nll-loss-*``)."""
