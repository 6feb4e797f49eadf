"""Reference supervised (NLL) and preference (DPO) losses on the LLM layout.

Both read the layout's tokens and masks (the assistant mask marks the tokens trained on,
position 0 excluded: no logit predicts it); DPO also reads ``ref_log_probs``. A DPO batch
holds its pairs as consecutive rows: row 2i is pair i's chosen answer, row 2i + 1 its
rejected one (NeMo-RL's interleaving). Both take ``counts=GlobalCounts(...)`` for the global
batch, as the policy-gradient loss does (capability ``global_counts``).
"""

from __future__ import annotations

import math
import numbers
from typing import Any

import torch
from tensordict import TensorDict, TensorDictBase

from posttrain.contracts.implementation import Implementation
from posttrain.contracts.layout import LLM_LAYOUT_V1, Layout
from posttrain.contracts.loss import GlobalCounts
from posttrain.reference_impls.pg_loss import _log_softmax, _token_log_probs

NLL_AGGREGATIONS = ("token_mean", "seq_mean_token_sum", "seq_mean_token_mean")
"""How :class:`NLLLoss` reduces -log p: over the global token count, or per sequence (sum or
mean over its tokens) over the global sequence count.

Example:
    >>> NLL_AGGREGATIONS[0]
    'token_mean'
"""


def _real(x: object) -> bool:
    return isinstance(x, numbers.Real) and not isinstance(x, bool)


def _mask_and_log_probs(
    policy: Any, td: TensorDictBase, layout: Layout, smoothing: float = 0.0
) -> tuple[torch.Tensor, torch.Tensor]:
    """The trained positions and each one's log p(token); with ``smoothing`` ε > 0, instead
    of log p(token) the negated smoothed cross-entropy term, (1 - ε)·log p(token) +
    ε·mean_v log p(v) (cross_entropy's label smoothing), both from the logits at t - 1."""
    k = layout.key
    tokens, attn = td.get(k("tokens")), td.get(k("attention_mask"))
    mask = td.get(k("assistant_mask")) & attn
    mask = torch.cat([torch.zeros_like(mask[:, :1]), mask[:, 1:]], dim=1)
    logits = policy(input_ids=tokens, attention_mask=attn.long()).logits
    logp = _token_log_probs(logits, tokens)
    if smoothing > 0:
        uniform = _log_softmax(logits).mean(-1)
        uniform = torch.cat([torch.zeros_like(uniform[:, :1]), uniform], dim=1)
        logp = (1 - smoothing) * logp + smoothing * uniform
    return mask, torch.where(mask, logp, 0.0)


def _smoothing(value: object, upper: float) -> float:
    if not _real(value) or not 0 <= float(value) < upper:  # type: ignore[arg-type]
        raise ValueError(f"label_smoothing: expected a number in [0, {upper:g}), found {value!r}")
    return float(value)  # type: ignore[arg-type]


def _dpo_own(mask: torch.Tensor) -> GlobalCounts:
    # Two rows per pair whose chosen row holds an assistant token (the pairs the loss
    # averages over), whatever the rejected row holds: NeMo-RL's global_valid_seqs counts
    # the rows of valid pairs, and an empty rejected row must not make a half pair.
    return GlobalCounts(int(mask.sum()), 2 * int(mask[0::2].any(-1).sum()))


def _counts(
    mask: torch.Tensor, counts: GlobalCounts | None, own: GlobalCounts | None = None
) -> GlobalCounts:
    if counts is not None and not isinstance(counts, GlobalCounts):
        raise TypeError(f"counts: expected a GlobalCounts, found {type(counts).__name__}")
    if own is None:
        own = GlobalCounts(int(mask.sum()), int(mask.any(-1).sum()))
    if counts is None:
        return own
    if own.tokens > counts.tokens or own.sequences > counts.sequences:
        raise ValueError(
            f"counts: this batch alone holds {own.tokens} assistant tokens in {own.sequences} "
            f"sequences, more than the global {counts}"
        )
    return counts


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
        self.label_smoothing = _smoothing(label_smoothing, 1.0)
        self.layout = layout

    def forward(self, td: TensorDictBase, *, counts: GlobalCounts | None = None) -> TensorDict:
        """The NLL of ``td``'s assistant tokens, normalized by ``counts`` (default: td's own)."""
        self.layout.validate_batch(td, context=type(self).__name__)
        mask, logp = _mask_and_log_probs(self.policy, td, self.layout, self.label_smoothing)
        c = _counts(mask, counts)
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
            if not _real(v) or not math.isfinite(v) or v < 0:
                raise ValueError(f"{name}: expected a finite number >= 0, found {v!r}")
        self.policy = policy
        self.beta = float(beta)
        self.preference_weight = float(preference_weight)
        self.sft_weight = float(sft_weight)
        self.preference_average = bool(preference_average)
        self.sft_average = bool(sft_average)
        self.label_smoothing = _smoothing(label_smoothing, 0.5)
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
        mask, logp = _mask_and_log_probs(self.policy, td, self.layout)
        c = _counts(mask, counts, _dpo_own(mask))
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


_SMOOTHING = 0.1  # the label smoothing the reference rows declare (capability label_smoothing)


def _nll_impl(aggregation: str) -> Implementation:
    return Implementation(
        "nll_loss",
        NLLLoss,
        name=f"posttrain.NLLLoss[{aggregation}]",
        capabilities={"global_counts", "label_smoothing"},
        options={"aggregation": aggregation},
        extras={"label_smoothing": _SMOOTHING},
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


def _dpo_impl(token_reduction: str) -> Implementation:
    return Implementation(
        "dpo_loss",
        make_dpo_loss,
        name=f"posttrain.DPOLoss[{token_reduction}]",
        capabilities={"global_counts", "label_smoothing"},
        options={"token_reduction": token_reduction},
        extras={"beta": _DPO_BETA, "label_smoothing": _SMOOTHING},
        description="Reference sigmoid DPO loss over interleaved pairs (NeMo-RL's DPOLossFn).",
    )


DPO_LOSS_SUM = _dpo_impl("sum")
DPO_LOSS_MEAN = _dpo_impl("mean")
DPO_LOSSES: tuple[Implementation, ...] = (DPO_LOSS_SUM, DPO_LOSS_MEAN)
"""The reference DPO loss in each token reduction (entry points ``reference-dpo-loss-*``)."""
