"""The reference policy-gradient loss: PPO/GRPO-style clipped objective on the LLM layout."""

from __future__ import annotations

import math
import numbers
from typing import Any

import torch
from tensordict import TensorDict, TensorDictBase

from posttrain.contracts.layout import LLM_LAYOUT_V1, Layout
from posttrain.contracts.loss import AGGREGATIONS, GlobalCounts
from posttrain.contracts.validation import check


def _log_softmax(logits: torch.Tensor) -> torch.Tensor:
    """Over the vocabulary, from position 0 to T - 2 (each predicts the next token); bf16 and
    fp16 logits upcast to float32, float64 kept (a float64 run stays float64 throughout)."""
    x = logits[:, :-1]
    return torch.log_softmax(x.float() if x.dtype in (torch.bfloat16, torch.float16) else x, -1)


def _token_log_probs(logits: torch.Tensor, tokens: torch.Tensor) -> torch.Tensor:
    """:func:`posttrain.contracts.token_log_probs` in the logits' own precision (float32 at least)."""
    picked = _log_softmax(logits).gather(-1, tokens[:, 1:, None]).squeeze(-1)
    return torch.cat([torch.zeros_like(picked[:, :1]), picked], dim=1)


def _entropy(logits: torch.Tensor) -> torch.Tensor:
    lp = _log_softmax(logits)
    h = -(lp.exp() * lp).sum(-1)
    return torch.cat([torch.zeros_like(h[:, :1]), h], dim=1)


class PolicyGradientLoss(torch.nn.Module):
    """Clipped policy-gradient loss with the four aggregations, k3 KL to reference and entropy.

    Everything is computed only where the assistant mask is True (position 0, which no logit
    predicts, is excluded too); values elsewhere, NaN included, are replaced before any
    arithmetic so they cannot leak into outputs or gradients. Options are keyword-only and
    validated: an unknown aggregation or a misspelt keyword raises. Float fields may come in
    any floating dtype and are cast to the policy's precision; integer and bool fields must
    have exactly their layout dtype (the layout's rule for a consumer that casts).

    Returns ``loss_objective`` (the policy-gradient term), ``loss_kl_to_ref`` (``kl_coef`` times k3 KL
    to the reference, if ``kl_coef > 0``), ``loss_entropy`` (``-entropy_coef`` times entropy, if
    ``entropy_coef > 0``) and the diagnostics ``clip_fraction``, ``kl_approx`` (k3 KL from the
    behaviour policy), ``entropy`` — all over assistant tokens, token-mean.

    Capability ``global_counts``: ``loss(micro_batch, counts=GlobalCounts.of(whole_batch))``
    normalizes by the whole batch's counts, so micro-batch losses (and their gradients and
    diagnostics) add up to the whole batch's; a row without assistant tokens is not a sequence.

    Example:
        >>> import torch
        >>> from posttrain.testing import tiny_causal_lm
        >>> from posttrain.testing import llm_batch
        >>> policy = tiny_causal_lm(vocab_size=64)
        >>> td = llm_batch(2, 8, vocab_size=64)
        >>> out = PolicyGradientLoss(policy, aggregation="seq_mean_token_mean")(td)
        >>> sorted(k for k in out.keys() if k.startswith("loss_"))
        ['loss_objective']
        >>> PolicyGradientLoss(policy, aggregation="token_meen")
        Traceback (most recent call last):
        ...
        ValueError: aggregation: expected one of ['token_mean', 'seq_mean_token_mean', 'seq_mean_token_sum', 'seq_mean_token_sum_norm'], found 'token_meen'
    """

    def __init__(
        self,
        policy: Any,
        *,
        aggregation: str = "token_mean",
        clip_epsilon: float | tuple[float, float] = 0.2,
        kl_coef: float = 0.0,
        entropy_coef: float = 0.0,
        t_norm: int | None = None,
        layout: Layout = LLM_LAYOUT_V1,
    ) -> None:
        super().__init__()
        if aggregation not in AGGREGATIONS:
            raise ValueError(
                f"aggregation: expected one of {list(AGGREGATIONS)}, found {aggregation!r}"
            )
        if aggregation == "seq_mean_token_sum_norm" and (not isinstance(t_norm, int) or t_norm < 1):
            raise ValueError(
                f"t_norm: seq_mean_token_sum_norm needs a positive int, found {t_norm!r}"
            )
        pair: Any = (clip_epsilon, clip_epsilon) if _real(clip_epsilon) else clip_epsilon
        if (
            not isinstance(pair, tuple | list)
            or len(pair) != 2
            or not all(_real(x) for x in pair)
            or not (0 <= pair[0] < 1 and pair[1] >= 0)
        ):
            raise ValueError(
                "clip_epsilon: expected a number or a (low, high) pair with 0 <= low < 1 and "
                f"high >= 0, found {clip_epsilon!r}"
            )
        low, high = pair
        if not _real(kl_coef) or not kl_coef >= 0:  # NaN fails too: it would drop the KL term
            raise ValueError(f"kl_coef: expected a number >= 0, found {kl_coef!r}")
        if not _real(entropy_coef) or not math.isfinite(entropy_coef):
            raise ValueError(f"entropy_coef: expected a finite number, found {entropy_coef!r}")
        self.policy = policy
        self.aggregation = aggregation
        self.clip = (float(low), float(high))
        self.kl_coef = float(kl_coef)
        self.entropy_coef = float(entropy_coef)
        self.t_norm = t_norm
        self.layout = layout
        need = ["sample_log_probs", "advantage"] + (["ref_log_probs"] if kl_coef > 0 else [])
        self._require = tuple(need)

    def _weights(self, mask: torch.Tensor, counts: GlobalCounts) -> torch.Tensor:
        """Each token's weight: the aggregation's, over the global batch ``counts`` describes
        (``mask`` is this micro-batch's: a sequence's own length L_i is always local)."""
        m = mask.double()  # cast to the loss's precision by the caller
        n, b = max(counts.tokens, 1), max(counts.sequences, 1)
        if self.aggregation == "token_mean":
            return m / n
        if self.aggregation == "seq_mean_token_mean":
            return m / (b * m.sum(-1, keepdim=True).clamp_min(1))
        if self.aggregation == "seq_mean_token_sum":
            return m / b
        assert self.t_norm is not None
        return m / (b * self.t_norm)

    def _surrogate(
        self, adv: torch.Tensor, ratio: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Per-token PPO loss max(-A r, -A clip(r)) and where the clipped term is the active one."""
        low, high = self.clip
        pg1, pg2 = -adv * ratio, -adv * ratio.clamp(1 - low, 1 + high)
        clipped = pg2 > pg1
        return torch.where(clipped, pg2, pg1), clipped

    def forward(self, td: TensorDictBase, *, counts: GlobalCounts | None = None) -> TensorDict:
        """Compute the loss terms and diagnostics for ``td`` (never mutated).

        ``counts``: the global batch's (every micro-batch, every rank) when ``td`` is one
        micro-batch of it; the terms and diagnostics of the micro-batches then add up to the
        whole batch's. Default: ``GlobalCounts.of(td)``.
        """
        if counts is not None and not isinstance(counts, GlobalCounts):
            raise TypeError(f"counts: expected a GlobalCounts, found {type(counts).__name__}")
        # Float fields in any floating dtype (bf16 log-probs from a bf16 model, float64
        # advantages) are cast to the policy's precision below; integer and bool fields must
        # be exact (a float mask is refused, not used as weights).
        check(td, self.layout, require=self._require, any_float=True, context=type(self).__name__)
        if td.batch_size.numel() == 0:
            raise ValueError(
                f"td: expected at least one item, found batch size {list(td.batch_size)}"
            )
        k = self.layout.key
        tokens = td.get(k("tokens"))
        attn = td.get(k("attention_mask"))
        mask = td.get(k("assistant_mask")) & attn
        mask = torch.cat([torch.zeros_like(mask[:, :1]), mask[:, 1:]], dim=1)
        logits = self.policy(input_ids=tokens, attention_mask=attn.long()).logits
        logp = torch.where(mask, _token_log_probs(logits, tokens), 0.0)
        old = torch.where(mask, td.get(k("sample_log_probs")).to(logp.dtype), 0.0)
        adv = td.get(k("advantage")).to(logp.dtype)
        adv = adv[:, None].expand_as(logp) if adv.ndim == 1 else adv
        adv = torch.where(mask, adv, 0.0)

        log_ratio = logp - old
        ratio = torch.where(mask, log_ratio.exp(), 1.0)
        per_token, active = self._surrogate(adv, ratio)
        own = GlobalCounts(int(mask.sum()), int(mask.any(-1).sum()))
        if counts is None:
            counts = own
        elif own.tokens > counts.tokens or own.sequences > counts.sequences:
            raise ValueError(
                f"counts: this batch alone holds {own.tokens} assistant tokens in "
                f"{own.sequences} sequences, more than the global {counts}"
            )
        w = self._weights(mask, counts).to(logp.dtype)
        out: dict[str, torch.Tensor] = {"loss_objective": (per_token * w).sum()}

        # Diagnostics: sums over the assistant tokens / the global token count, so that the
        # micro-batches' values add up to the whole batch's token mean.
        tm = mask.to(logp.dtype) / max(counts.tokens, 1)
        if self.kl_coef > 0:
            ref = torch.where(mask, td.get(k("ref_log_probs")).to(logp.dtype), 0.0)
            d = ref - logp
            k3 = torch.where(mask, d.exp() - d - 1, 0.0)
            out["loss_kl_to_ref"] = self.kl_coef * (k3 * w).sum()
            out["kl_to_ref"] = (k3 * tm).sum().detach()
        ent = _entropy(logits)
        if self.entropy_coef > 0:
            out["loss_entropy"] = -self.entropy_coef * (torch.where(mask, ent, 0.0) * w).sum()
        with torch.no_grad():
            out["clip_fraction"] = ((active & mask).to(tm.dtype) * tm).sum()
            d_old = old - logp
            out["kl_approx"] = (torch.where(mask, d_old.exp() - d_old - 1, 0.0) * tm).sum()
            out["entropy"] = (torch.where(mask, ent, 0.0) * tm).sum()
        return TensorDict(out, batch_size=[])


def _real(x: object) -> bool:
    return isinstance(x, numbers.Real) and not isinstance(x, bool)  # numpy floats too
