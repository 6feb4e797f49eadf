"""What the reference NLL and DPO losses share: the trained positions and their log-probs,
the label-smoothing argument, and the counts a batch is normalized by.

Both read the layout's tokens and masks (the assistant mask marks the tokens trained on,
position 0 excluded: no logit predicts it).
"""

from __future__ import annotations

import numbers
from typing import Any

import torch
from tensordict import TensorDictBase

from posttrain.contracts.layout import Layout
from posttrain.contracts.loss import GlobalCounts
from posttrain.reference_impls.pg_loss import _log_softmax, _token_log_probs

SMOOTHING = 0.1  # the label smoothing the reference rows declare (capability label_smoothing)


def is_real(x: object) -> bool:
    return isinstance(x, numbers.Real) and not isinstance(x, bool)


def mask_and_log_probs(
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


def checked_smoothing(value: object, upper: float) -> float:
    if not is_real(value) or not 0 <= float(value) < upper:  # type: ignore[arg-type]
        raise ValueError(f"label_smoothing: expected a number in [0, {upper:g}), found {value!r}")
    return float(value)  # type: ignore[arg-type]


def batch_counts(
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
