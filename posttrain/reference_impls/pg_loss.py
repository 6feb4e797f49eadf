"""The reference policy-gradient loss: PPO/GRPO's clipped objective on the LLM layout."""

from __future__ import annotations

import math
import numbers
from typing import Any

import torch
from tensordict import TensorDict, TensorDictBase

from posttrain._kl import kl_estimate
from posttrain.contracts.layout import LLM_LAYOUT_V1, Layout
from posttrain.contracts.loss import AGGREGATIONS, GlobalCounts


def _log_softmax(logits: torch.Tensor) -> torch.Tensor:
    """Over the vocabulary, from position 0 to T - 2 (each predicts the next token); bf16 and
    fp16 logits upcast to float32, float64 kept (a float64 run stays float64 throughout)."""
    x = logits[:, :-1]
    return torch.log_softmax(x.float() if x.dtype in (torch.bfloat16, torch.float16) else x, -1)


def _token_log_probs(logits: torch.Tensor, tokens: torch.Tensor) -> torch.Tensor:
    """:func:`posttrain.contracts.alignment.token_log_probs` in the logits' own precision (float32 at least)."""
    picked = _log_softmax(logits).gather(-1, tokens[:, 1:, None]).squeeze(-1)
    return torch.cat([torch.zeros_like(picked[:, :1]), picked], dim=1)


def _entropy(logits: torch.Tensor) -> torch.Tensor:
    lp = _log_softmax(logits)
    h = -(lp.exp() * lp).sum(-1)
    return torch.cat([torch.zeros_like(h[:, :1]), h], dim=1)


def _real(x: object) -> bool:
    return isinstance(x, numbers.Real) and not isinstance(x, bool)  # numpy floats too


class PolicyGradientLoss(torch.nn.Module):
    """PPO/GRPO's clipped policy-gradient loss: four aggregations, k3 KL to reference, entropy.

    Per assistant token t (position 0, which no logit predicts, excluded), with
    r = exp(log pi - sample_log_probs) and A the advantage ([B] or [B, T]):
    ``loss_objective`` = Σ w·max(-A·r, -A·clip(r, 1 - ε_low, 1 + ε_high)), w the
    aggregation's weight (:data:`posttrain.contracts.loss.AGGREGATIONS`); ``loss_kl_to_ref`` =
    ``kl_coef``·Σ w·k3(log pi_ref - log pi) if ``kl_coef`` > 0; ``loss_entropy`` =
    -``entropy_coef``·Σ w·H if ``entropy_coef`` > 0. Diagnostics, token means:
    ``clip_fraction``, ``kl_approx`` (k3 of sample_log_probs - log pi), ``entropy`` and, with a
    KL term, ``kl_to_ref``.

    Values off the mask, NaN included, are replaced before any arithmetic. Float fields may
    come in any floating dtype and are computed in the policy's precision; integer and bool
    fields must have their layout dtype. ``loss(micro_batch, counts=GlobalCounts.of(batch))``
    normalizes by the whole batch's counts (capability ``global_counts``). For ratios beyond
    the token ratio, other KL estimators and importance corrections, see
    :class:`posttrain.policy_loss.PolicyLoss`.

    Example:
        >>> from posttrain.testing import llm_batch, tiny_causal_lm
        >>> policy = tiny_causal_lm(vocab_size=64)
        >>> out = PolicyGradientLoss(policy, kl_coef=0.1)(llm_batch(2, 8, vocab_size=64))
        >>> sorted(k for k in out.keys() if k.startswith("loss_"))
        ['loss_kl_to_ref', 'loss_objective']
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
            or not (0 <= pair[0] <= 1 and pair[1] >= 0)
        ):
            raise ValueError(
                "clip_epsilon: expected a number or a (low, high) pair with 0 <= low <= 1 (1: no "
                f"lower bound) and high >= 0, found {clip_epsilon!r}"
            )
        if not _real(kl_coef) or not kl_coef >= 0:  # NaN fails too: it would drop the KL term
            raise ValueError(f"kl_coef: expected a number >= 0, found {kl_coef!r}")
        if not _real(entropy_coef) or not math.isfinite(entropy_coef):
            raise ValueError(f"entropy_coef: expected a finite number, found {entropy_coef!r}")
        self.policy = policy
        self.aggregation = aggregation
        self.clip = (float(pair[0]), float(pair[1]))
        self.kl_coef = float(kl_coef)
        self.entropy_coef = float(entropy_coef)
        self.t_norm = t_norm
        self.layout = layout

    def _weights(self, mask: torch.Tensor, counts: GlobalCounts) -> torch.Tensor:
        """Each token's weight under the aggregation: N and B are the global ``counts``; a
        sequence's own length L_i is this micro-batch's ``mask`` row sum."""
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
        """Per-token loss max(-A·r, -A·clip(r)) and where the clipped term is the active one."""
        low, high = self.clip
        pg1, pg2 = -adv * ratio, -adv * ratio.clamp(1 - low, 1 + high)
        return torch.where(pg2 > pg1, pg2, pg1), pg2 > pg1

    def _counts(self, mask: torch.Tensor, counts: GlobalCounts | None) -> GlobalCounts:
        own = GlobalCounts(int(mask.sum()), int(mask.any(-1).sum()))
        if counts is None:
            return own
        if not isinstance(counts, GlobalCounts):
            raise TypeError(f"counts: expected a GlobalCounts, found {type(counts).__name__}")
        if own.tokens > counts.tokens or own.sequences > counts.sequences:
            raise ValueError(
                f"counts: this batch alone holds {own.tokens} assistant tokens in "
                f"{own.sequences} sequences, more than the global {counts}"
            )
        return counts

    def forward(self, td: TensorDictBase, *, counts: GlobalCounts | None = None) -> TensorDict:
        """Compute the loss terms and diagnostics for ``td`` (never mutated).

        ``counts``: the global batch's (every micro-batch, every rank) when ``td`` is one
        micro-batch of it; the micro-batches' terms and diagnostics then add up to the whole
        batch's. Default: ``GlobalCounts.of(td)``.
        """
        need = ("sample_log_probs", "advantage") + (("ref_log_probs",) if self.kl_coef else ())
        self.layout.validate_batch(td, require=need, any_float=True, context=type(self).__name__)
        if td.batch_size.numel() == 0:
            raise ValueError(
                f"td: expected at least one item, found batch size {list(td.batch_size)}"
            )
        k = self.layout.key
        tokens, attn = td.get(k("tokens")), td.get(k("attention_mask"))
        mask = td.get(k("assistant_mask")) & attn
        mask[:, 0] = False  # `&` made a new tensor: the batch's mask is untouched
        counts = self._counts(mask, counts)
        logits = self.policy(input_ids=tokens, attention_mask=attn.long()).logits
        logp = torch.where(mask, _token_log_probs(logits, tokens), 0.0)
        old = torch.where(mask, td.get(k("sample_log_probs")).to(logp.dtype), 0.0)
        adv = td.get(k("advantage")).to(logp.dtype)
        adv = torch.where(mask, adv[:, None].expand_as(logp) if adv.ndim == 1 else adv, 0.0)

        w = self._weights(mask, counts).to(logp.dtype)
        tm = mask.to(logp.dtype) / max(counts.tokens, 1)  # diagnostics: global token means
        per_token, clipped = self._surrogate(adv, torch.where(mask, (logp - old).exp(), 1.0))
        out = {"loss_objective": (per_token * w).sum()}
        if self.kl_coef > 0:
            ref = torch.where(mask, td.get(k("ref_log_probs")).to(logp.dtype), 0.0)
            kl = kl_estimate(ref - logp)  # k3; zero off the mask, where ref = logp = 0
            out["loss_kl_to_ref"] = self.kl_coef * (kl * w).sum()
            out["kl_to_ref"] = (kl * tm).sum().detach()
        ent = torch.where(mask, _entropy(logits), 0.0)
        if self.entropy_coef > 0:
            out["loss_entropy"] = -self.entropy_coef * (ent * w).sum()
        with torch.no_grad():
            out["clip_fraction"] = ((clipped & mask).to(tm.dtype) * tm).sum()
            out["kl_approx"] = (kl_estimate(old - logp) * tm).sum()
            out["entropy"] = (ent * tm).sum()
        return TensorDict(out, batch_size=[])
