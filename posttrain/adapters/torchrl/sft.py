"""TorchRL 0.14.1's ``SFTLoss`` (``torchrl.objectives.llm``) as ``nll_loss`` rows.

The loss is TorchRL's own code, scoring tokens through a token-mode ``TransformersWrapper``
around the suite's policy. ``SFTLoss.forward`` passes its actor only
``tensordict.select(history_key)``; the token-mode wrapper then builds its attention mask from
``tokens != pad_token_id`` when it finds none, so a token equal to the pad id *inside* a
sequence is dropped, and the log-probs after it are scored with a shifted context.

- Raw row: ``SFTLoss(reduction="mean", normalize_by_seq_length=True)`` (TorchRL's defaults: the
  mean over rows of each row's token mean, ``seq_mean_token_mean``) with its history key set to
  the layout's tokens; ``loss_sft`` renamed ``loss_nll``, nothing else changed.
- Adapted rows: the batch validated; the loss's history key is a sub-TensorDict holding the
  layout's tokens *and* attention mask (no data copied), the actor reading both from it, so
  the policy sees the layout's mask. Position 0 is cleared from the assistant mask (no logit
  predicts it). ``SFTLoss(reduction="sum")`` gives the sum over rows of -log p (per-row sums,
  or per-row means with ``normalize_by_seq_length``), divided here by the global count (N
  tokens or S rows): capability ``global_counts``, exact since TorchRL's sum is over this
  micro-batch's rows alone.
"""

from __future__ import annotations

from functools import partial
from typing import Any

import torch
from tensordict import TensorDict, TensorDictBase

from posttrain._deps import optional_deps
from posttrain.adapters._hf import word_level_tokenizer
from posttrain.adapters._layout import global_counts
from posttrain.contracts.implementation import Implementation
from posttrain.contracts.layout import LLM_LAYOUT_V1
from posttrain.contracts.loss import GlobalCounts

K = LLM_LAYOUT_V1.key
_IN = "_sft_input"
"""The adapted loss's history key: a sub-TensorDict with the tokens and the attention mask."""

SFT_AGGREGATIONS = {
    "token_mean": False,
    "seq_mean_token_mean": True,
    "seq_mean_token_sum": False,
}
"""Contract aggregation -> ``SFTLoss``'s ``normalize_by_seq_length`` in the adapted rows."""


def _actor(policy: Any, *, input_key: Any, attention_mask_key: Any = "attention_mask") -> Any:
    with optional_deps():
        from torchrl.modules.llm import TransformersWrapper

    return TransformersWrapper(
        policy,
        tokenizer=word_level_tokenizer(policy.config),
        input_mode="tokens",
        input_key=input_key,
        attention_mask_key=attention_mask_key,
        generate=False,
        return_log_probs=True,
        pad_output=True,
    )


class TorchRLSFTLoss(torch.nn.Module):
    """TorchRL 0.14.1 ``SFTLoss`` as an ``nll_loss`` ``LossModuleV1`` (see the module docstring).

    Example:
        >>> from posttrain.testing import llm_batch, tiny_causal_lm  # doctest: +SKIP
        >>> loss = TorchRLSFTLoss(tiny_causal_lm(vocab_size=64))  # doctest: +SKIP
        >>> loss(llm_batch(2, 8, vocab_size=64))["loss_nll"].shape  # doctest: +SKIP
        torch.Size([])
    """

    def __init__(
        self, policy: Any, aggregation: str = "token_mean", *, adapted: bool = True
    ) -> None:
        super().__init__()
        with optional_deps():
            from torchrl.objectives.llm import SFTLoss

        self.adapted = adapted
        self.aggregation = aggregation
        if not adapted:
            if aggregation != "seq_mean_token_mean":
                raise ValueError(
                    f"aggregation: SFTLoss's defaults (reduction 'mean', normalize_by_seq_length)"
                    f" are 'seq_mean_token_mean', found {aggregation!r}"
                )
            actor = _actor(policy, input_key=K("tokens"))
            self.loss = SFTLoss(actor_network=actor, reduction="mean", normalize_by_seq_length=True)
            self.loss.set_keys(history=K("tokens"))
            return
        if aggregation not in SFT_AGGREGATIONS:
            raise ValueError(
                f"aggregation: expected one of {sorted(SFT_AGGREGATIONS)}, found {aggregation!r}"
            )
        actor = _actor(
            policy,
            input_key=(_IN, *K("tokens")),
            attention_mask_key=(_IN, *K("attention_mask")),
        )
        self.loss = SFTLoss(
            actor_network=actor,
            reduction="sum",
            normalize_by_seq_length=SFT_AGGREGATIONS[aggregation],
        )
        self.loss.set_keys(history=_IN)

    def forward(self, td: TensorDictBase, *, counts: GlobalCounts | None = None) -> TensorDict:
        """``SFTLoss``'s loss of ``td`` (never mutated) as ``loss_nll``."""
        if not self.adapted:
            if counts is not None:
                raise TypeError("counts: the raw TorchRL row takes no global counts")
            return TensorDict({"loss_nll": self.loss(td).get("loss_sft")}, batch_size=[])
        LLM_LAYOUT_V1.validate_batch(td, context="TorchRL SFTLoss")
        own, c = global_counts(td, counts)
        if own.tokens == 0:  # this part weighs nothing (SFTLoss refuses a batch without one)
            return TensorDict({"loss_nll": torch.zeros(())}, batch_size=[])
        tokens, att = td.get(K("tokens")), td.get(K("attention_mask"))
        asst = td.get(K("assistant_mask")) & att
        asst = torch.cat([torch.zeros_like(asst[:, :1]), asst[:, 1:]], dim=1)
        inner = TensorDict(
            {K("tokens"): tokens, K("attention_mask"): att}, batch_size=td.batch_size
        )
        batch = TensorDict(
            {_IN: inner, K("assistant_mask"): asst, K("attention_mask"): att},
            batch_size=td.batch_size,
        )
        total = self.loss(batch).get("loss_sft")
        n = c.tokens if self.aggregation == "token_mean" else c.sequences
        return TensorDict({"loss_nll": total / max(n, 1)}, batch_size=[])


def _make(policy: Any, aggregation: str = "token_mean", *, adapted: bool) -> TorchRLSFTLoss:
    return TorchRLSFTLoss(policy, aggregation, adapted=adapted)


def _row(aggregation: str, *, adapted: bool, known: frozenset[str] = frozenset()) -> Implementation:
    return Implementation(
        "nll_loss",
        partial(_make, adapted=adapted),
        name=f"{'TorchRLSFTLoss(' if adapted else ''}torchrl SFTLoss("
        + (
            f"reduction='sum', normalize_by_seq_length={SFT_AGGREGATIONS[aggregation]}))"
            if adapted
            else "reduction='mean', normalize_by_seq_length=True)"
        ),
        capabilities={"global_counts"} if adapted else set(),
        options={"aggregation": aggregation},
        description="TorchRL 0.14.1's SFTLoss scoring through a token-mode TransformersWrapper; "
        + (
            "adapted: the actor reads the layout's attention mask, TorchRL's sum divided by "
            "the global count."
            if adapted
            else "raw: history key = the layout's tokens, TorchRL's defaults."
        ),
        known_failures=known,
    )


RAW_KNOWN = frozenset({"NLL-002", "NLL-003", "NLL-005", "NLL-006"})
"""What the raw row fails, measured with TorchRL 0.14.1 (repros in tests/adapters/torchrl/test_sft_rows.py):
NLL-003 (a pad-id token inside a sequence dropped shifts the log-probs; on one row of 2
columns with 1 assistant token the loss is 2.1412 where the formula gives 4.2823), NLL-002
(one of nll_loss 1.1's drawn batches leaves every parameter without a gradient, which blocks
NLL-004), NLL-005 (left-padded tokens change the loss: the raw actor sees no attention mask)
and NLL-006 (a float mask taken as a mask; a missing key not named)."""

RAW_SFT_SEQ_MEAN_TOKEN_MEAN = _row("seq_mean_token_mean", adapted=False, known=RAW_KNOWN)
ADAPTED_SFT_TOKEN_MEAN = _row("token_mean", adapted=True)
ADAPTED_SFT_SEQ_MEAN_TOKEN_MEAN = _row("seq_mean_token_mean", adapted=True)
ADAPTED_SFT_SEQ_MEAN_TOKEN_SUM = _row("seq_mean_token_sum", adapted=True)
ROWS: dict[str, Implementation] = {
    "torchrl-raw-sftloss-seq-mean-token-mean": RAW_SFT_SEQ_MEAN_TOKEN_MEAN,
    "torchrl-adapted-sftloss-token-mean": ADAPTED_SFT_TOKEN_MEAN,
    "torchrl-adapted-sftloss-seq-mean-token-mean": ADAPTED_SFT_SEQ_MEAN_TOKEN_MEAN,
    "torchrl-adapted-sftloss-seq-mean-token-sum": ADAPTED_SFT_SEQ_MEAN_TOKEN_SUM,
}
"""The TorchRL SFTLoss rows by name (the adapted ones are also entry points)."""
