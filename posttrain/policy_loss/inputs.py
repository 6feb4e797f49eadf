"""What the loss reads from a batch: the policy's log-probs and the masked layout fields."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
from tensordict import TensorDictBase

from posttrain.contracts.layout import Layout
from posttrain.contracts.loss import GlobalCounts


@dataclass(frozen=True)
class LossInputs:
    """One batch's per-token tensors, [B, T], each zero off ``mask`` (NaN there replaced
    before any arithmetic), in the policy's precision (float32 at least).

    ``mask``: assistant and attention mask, position 0 excluded; ``logits`` the policy's;
    ``logp`` its log-probs of the tokens; ``old`` ``sample_log_probs``; ``gen`` the sampler's
    log-probs (``old`` unless a ``generation_key`` is set); ``adv`` the advantage per token;
    ``counts`` the global batch's.

    Example:
        >>> LossInputs.__dataclass_fields__.keys() >= {"mask", "logp", "counts"}
        True
    """

    mask: torch.Tensor
    logits: torch.Tensor
    logp: torch.Tensor
    old: torch.Tensor
    gen: torch.Tensor
    adv: torch.Tensor
    counts: GlobalCounts

    @property
    def fm(self) -> torch.Tensor:
        """The mask as floats of the log-probs' dtype."""
        return self.mask.to(self.logp.dtype)

    def masked(self, td: TensorDictBase, key: Any) -> torch.Tensor:
        """Float field ``key`` of ``td`` in the loss's precision, zero off the mask."""
        return torch.where(self.mask, td.get(key).to(self.logp.dtype), 0.0)


def log_softmax(logits: torch.Tensor) -> torch.Tensor:
    """Over the vocabulary, positions 0 to T - 2 (each predicts the next token); bf16 and
    fp16 logits upcast to float32, float64 kept (a float64 run stays float64 throughout).

    Example:
        >>> log_softmax(torch.zeros(1, 3, 2)).exp().tolist()
        [[[0.5, 0.5], [0.5, 0.5]]]
    """
    x = logits[:, :-1]
    return torch.log_softmax(x.float() if x.dtype in (torch.bfloat16, torch.float16) else x, -1)


def token_log_probs(logits: torch.Tensor, tokens: torch.Tensor) -> torch.Tensor:
    """:func:`posttrain.contracts.alignment.token_log_probs` in the logits' own precision (float32 at
    least): position 0 is 0.

    Example:
        >>> token_log_probs(torch.zeros(1, 3, 4), torch.tensor([[1, 2, 3]])).exp().tolist()
        [[1.0, 0.25, 0.25]]
    """
    picked = log_softmax(logits).gather(-1, tokens[:, 1:, None]).squeeze(-1)
    return torch.cat([torch.zeros_like(picked[:, :1]), picked], dim=1)


def entropy(logits: torch.Tensor) -> torch.Tensor:
    """The policy's entropy at each token's distribution (aligned like the log-probs).

    Example:
        >>> [round(v, 4) for v in entropy(torch.zeros(1, 2, 4))[0].tolist()]
        [0.0, 1.3863]
    """
    lp = log_softmax(logits)
    h = -(lp.exp() * lp).sum(-1)
    return torch.cat([torch.zeros_like(h[:, :1]), h], dim=1)


def read_inputs(
    policy: Any,
    td: TensorDictBase,
    layout: Layout,
    *,
    require: tuple[str, ...],
    generation_key: Any = None,
    counts: GlobalCounts | None = None,
    context: str = "PolicyLoss",
) -> LossInputs:
    """Validate ``td`` (``require``: the layout fields it must hold), run ``policy`` on it and
    read the masked fields; ``counts`` defaults to this batch's and may not be smaller.

    Float fields may come in any floating dtype and are cast to the policy's precision;
    integer and bool fields must have exactly their layout dtype.

    Example:
        >>> from posttrain.contracts import LLM_LAYOUT_V1
        >>> from posttrain.testing import llm_batch, tiny_causal_lm
        >>> x = read_inputs(tiny_causal_lm(), llm_batch(2, 6, vocab_size=64), LLM_LAYOUT_V1,
        ...                 require=("sample_log_probs", "advantage"))
        >>> x.logp.shape, x.counts.sequences
        (torch.Size([2, 6]), 2)
    """
    if counts is not None and not isinstance(counts, GlobalCounts):
        raise TypeError(f"counts: expected a GlobalCounts, found {type(counts).__name__}")
    layout.validate_batch(td, require=require, any_float=True, context=context)
    if td.batch_size.numel() == 0:
        raise ValueError(f"td: expected at least one item, found batch size {list(td.batch_size)}")
    k = layout.key
    tokens, attn = td.get(k("tokens")), td.get(k("attention_mask"))
    mask = td.get(k("assistant_mask")) & attn
    mask = torch.cat([torch.zeros_like(mask[:, :1]), mask[:, 1:]], dim=1)
    logits = policy(input_ids=tokens, attention_mask=attn.long()).logits
    logp = torch.where(mask, token_log_probs(logits, tokens), 0.0)
    old = torch.where(mask, td.get(k("sample_log_probs")).to(logp.dtype), 0.0)
    adv = td.get(k("advantage")).to(logp.dtype)
    adv = torch.where(mask, adv[:, None].expand_as(logp) if adv.ndim == 1 else adv, 0.0)
    gen = old if generation_key is None else _generation(td, generation_key, mask, logp)
    own = GlobalCounts(int(mask.sum()), int(mask.any(-1).sum()))
    if counts is not None and (own.tokens > counts.tokens or own.sequences > counts.sequences):
        raise ValueError(
            f"counts: this batch alone holds {own.tokens} assistant tokens in "
            f"{own.sequences} sequences, more than the global {counts}"
        )
    return LossInputs(mask, logits, logp, old, gen, adv, own if counts is None else counts)


def _generation(
    td: TensorDictBase, key: Any, mask: torch.Tensor, logp: torch.Tensor
) -> torch.Tensor:
    if key not in td.keys(include_nested=True):
        raise KeyError(f"{key!r}: generation_key is set but the batch has no such entry")
    raw = td.get(key)
    if raw.shape != logp.shape or not raw.is_floating_point():
        raise ValueError(
            f"{key!r}: expected float log-probs of shape {list(logp.shape)}, found "
            f"{raw.dtype} {list(raw.shape)}"
        )
    return torch.where(mask, raw.to(logp.dtype), 0.0)
