"""Policy-gradient losses under capability ``global_counts``, written from ``specs/loss-v1.md``
(v1.3) alone, and one-bug variants taken from real systems' bug reports.

Two correct designs, unlike each other:

- ``PackedWeightsLoss`` gathers the assistant tokens into one packed list (``nonzero`` over the
  mask), takes their log-probs with a gather over a float64 ``log_softmax`` of the logits one
  position earlier, and builds the loss as an explicit weighted sum whose per-token weights
  come from ``counts`` (``1 / counts.tokens`` for token_mean, ``1 / (counts.sequences * L_i)``
  and friends for the sequence means). Masked positions never enter the graph.
- ``NemoStyleLoss`` follows NeMo-RL's ``ClippedPGLossFn``: a float ``token_mask`` and
  ``sample_mask``, ``global_valid_toks`` / ``global_valid_seqs`` arguments mapped from
  ``counts`` (``sample_mask`` = the row holds an assistant token, the spec's mapping), and a
  ``masked_mean`` with a global normalization factor, in the shifted next-token space.

Both clip PPO-style (ε = 0.2), return ``clip_fraction`` / ``kl_approx`` / ``entropy`` as sums
over the micro-batch's assistant tokens divided by ``counts.tokens``, and support every
aggregation of the spec.

Example:
    >>> from posttrain.contracts import GlobalCounts
    >>> from posttrain.testing import llm_batch, tiny_causal_lm
    >>> td = llm_batch(4, 9, vocab_size=64)
    >>> loss = PackedWeightsLoss(tiny_causal_lm(vocab_size=64))
    >>> parts = [loss(td[:1], counts=GlobalCounts.of(td)), loss(td[1:], counts=GlobalCounts.of(td))]
    >>> whole = loss(td)["loss_objective"]
    >>> bool(abs(sum(p["loss_objective"] for p in parts) - whole) < 1e-6)
    True
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
from tensordict import TensorDictBase
from torch import nn

from posttrain.contracts import GlobalCounts, Implementation

__all__ = ["BUGGY_COUNTS_LOSSES", "CORRECT_COUNTS_LOSSES", "NemoStyleLoss", "PackedWeightsLoss"]

TOKENS = ("tokens", "full")
ATTN = ("masks", "all_attention_mask")
ASST = ("masks", "all_assistant_mask")
OLD = ("log_probs", "full")
ADV = "advantage"
AGGREGATIONS = (
    "token_mean",
    "seq_mean_token_mean",
    "seq_mean_token_sum",
    "seq_mean_token_sum_norm",
)
CLIP_EPS = 0.2
T_NORM = 13.0  # not the width of any batch the kit builds, so a width-based norm shows


def _get(td: TensorDictBase, key: str | tuple[str, ...]) -> torch.Tensor:
    # tensordict's get returns None for a missing key in some versions and raises in others
    try:
        x = td.get(key)
    except KeyError:
        x = None
    if x is None:
        raise KeyError(f"loss: the batch has no field {key!r}")
    return x  # type: ignore[no-any-return]


def _exact(td: TensorDictBase, key: tuple[str, ...], dtype: torch.dtype) -> torch.Tensor:
    x = _get(td, key)
    if x.dtype != dtype:
        raise TypeError(f"loss: field {key!r} must be {dtype}, found {x.dtype}")
    return x


def _floating(td: TensorDictBase, key: str | tuple[str, ...]) -> torch.Tensor:
    x = _get(td, key)
    if not x.is_floating_point():
        raise TypeError(f"loss: field {key!r} must be a floating dtype, found {x.dtype}")
    return x


class _Inputs:
    """The batch's fields, validated; ``m`` is the trained-on mask with position 0 cleared."""

    def __init__(self, td: TensorDictBase) -> None:
        self.tokens = _exact(td, TOKENS, torch.int64)
        self.attn = _exact(td, ATTN, torch.bool)
        asst = _exact(td, ASST, torch.bool)
        self.old = _floating(td, OLD)
        self.adv = _floating(td, ADV)
        if self.tokens.dim() != 2:
            raise ValueError(
                f"loss: field {TOKENS!r} must be [B, T], found {tuple(self.tokens.shape)}"
            )
        b, t = self.tokens.shape
        for key, x in ((ATTN, self.attn), (ASST, asst), (OLD, self.old)):
            if tuple(x.shape) != (b, t):
                raise ValueError(
                    f"loss: field {key!r} must have shape {(b, t)}, found {tuple(x.shape)}"
                )
        if tuple(self.adv.shape) != (b,):
            raise ValueError(
                f"loss: field {ADV!r} must have shape {(b,)}, found {tuple(self.adv.shape)}"
            )
        m = asst & self.attn
        self.m_full = m
        self.m = torch.cat([torch.zeros_like(m[:, :1]), m[:, 1:]], dim=1)
        self.b, self.t = b, t

    def logits(self, policy: Any) -> torch.Tensor:
        ids = torch.where(self.attn, self.tokens, torch.zeros_like(self.tokens))
        return policy(input_ids=ids, attention_mask=self.attn.long()).logits  # type: ignore[no-any-return]


def _check_options(aggregation: str, t_norm: float) -> None:
    if aggregation not in AGGREGATIONS:
        raise ValueError(f"unknown aggregation {aggregation!r}; expected one of {AGGREGATIONS}")
    if not t_norm > 0:
        raise ValueError(f"t_norm must be > 0, found {t_norm!r}")


def _out_dtype(logits: torch.Tensor) -> torch.dtype:
    return torch.float64 if logits.dtype == torch.float64 else torch.float32


# ---------------------------------------------------------------------------------------------
# Design (a): packed assistant tokens, float64 gather, explicit weights from counts.


class PackedWeightsLoss(nn.Module):
    """Clipped policy-gradient loss over a packed list of the batch's assistant tokens.

    Example:
        >>> from posttrain.testing import llm_batch, tiny_causal_lm
        >>> out = PackedWeightsLoss(tiny_causal_lm(vocab_size=64))(llm_batch(2, vocab_size=64))
        >>> sorted(out)
        ['clip_fraction', 'entropy', 'kl_approx', 'loss_objective']
    """

    def __init__(
        self, policy: Any, *, aggregation: str = "token_mean", t_norm: float = T_NORM
    ) -> None:
        super().__init__()
        _check_options(aggregation, t_norm)
        self.policy = policy
        self.aggregation = aggregation
        self.t_norm = float(t_norm)

    def _counts(self, x: _Inputs, counts: GlobalCounts | None, td: TensorDictBase) -> GlobalCounts:
        return counts if counts is not None else GlobalCounts.of(td)

    def _weights(self, rows: torch.Tensor, per_row: torch.Tensor, c: GlobalCounts) -> torch.Tensor:
        """One weight per packed token (rows: each token's row; per_row: L_i of every row)."""
        n = float(max(c.tokens, 1))
        s = float(max(c.sequences, 1))
        ones = torch.ones(rows.shape, dtype=torch.float64)
        if self.aggregation == "token_mean":
            return ones / n
        if self.aggregation == "seq_mean_token_mean":
            return ones / (s * per_row[rows].double())
        if self.aggregation == "seq_mean_token_sum":
            return ones / s
        return ones / (s * self.t_norm)

    def _diag_norm(self, c: GlobalCounts, rows: torch.Tensor) -> float:
        return float(max(c.tokens, 1))

    def forward(
        self, td: TensorDictBase, *, counts: GlobalCounts | None = None
    ) -> dict[str, torch.Tensor]:
        x = _Inputs(td)
        c = self._counts(x, counts, td)
        logits = x.logits(self.policy)
        out_dtype = _out_dtype(logits)
        rows, cols = x.m.nonzero(as_tuple=True)
        per_row = x.m.sum(-1)
        pred = logits[rows, cols - 1].double().log_softmax(-1)  # logits at t-1 predict token t
        logp = pred.gather(-1, x.tokens[rows, cols].unsqueeze(-1)).squeeze(-1)
        old = x.old[rows, cols].double()
        adv = x.adv[rows].double()
        ratio = torch.exp(logp - old)
        clipped = ratio.clamp(1 - CLIP_EPS, 1 + CLIP_EPS)
        per_token = torch.maximum(-adv * ratio, -adv * clipped)
        w = self._weights(rows, per_row, c)
        objective = (w * per_token).sum()
        with torch.no_grad():
            norm = self._diag_norm(c, rows)
            r = ratio.detach()
            clip_fraction = ((r - 1).abs() > CLIP_EPS).double().sum() / norm
            kl_approx = (r - 1 - torch.log(r)).sum() / norm
            entropy = -(pred.exp() * pred).sum(-1).sum() / norm
        return {
            "loss_objective": objective.to(out_dtype),
            "clip_fraction": clip_fraction.to(out_dtype),
            "kl_approx": kl_approx.to(out_dtype),
            "entropy": entropy.to(out_dtype),
        }


# ---------------------------------------------------------------------------------------------
# Design (b): NeMo-RL style, masks as float factors and a global normalization factor.


def masked_mean(
    values: torch.Tensor, mask: torch.Tensor, global_normalization_factor: torch.Tensor | float
) -> torch.Tensor:
    """Sum of ``values`` where ``mask`` is 1, divided by a factor counted over the global batch.

    Example:
        >>> masked_mean(torch.tensor([1.0, 2.0, 3.0]), torch.tensor([1.0, 0.0, 1.0]), 4.0)
        tensor(1.)
    """
    return (values * mask).sum() / global_normalization_factor


class NemoStyleLoss(nn.Module):
    """A ``ClippedPGLossFn``-like loss: token/sample masks, ``global_valid_toks``/``_seqs``.

    Example:
        >>> from posttrain.testing import llm_batch, tiny_causal_lm
        >>> loss = NemoStyleLoss(tiny_causal_lm(vocab_size=64), aggregation="seq_mean_token_sum")
        >>> 0.0 <= float(loss(llm_batch(2, vocab_size=64))["clip_fraction"]) <= 1.0
        True
    """

    def __init__(
        self, policy: Any, *, aggregation: str = "token_mean", t_norm: float = T_NORM
    ) -> None:
        super().__init__()
        _check_options(aggregation, t_norm)
        self.policy = policy
        self.aggregation = aggregation
        self.t_norm = float(t_norm)

    def _valid_counts(
        self, x: _Inputs, mask: torch.Tensor, sample_mask: torch.Tensor, counts: GlobalCounts | None
    ) -> tuple[float, float]:
        """(global_valid_toks, global_valid_seqs); without counts, this batch's."""
        if counts is None:
            return float(mask.sum()), float(sample_mask.sum())
        return float(counts.tokens), float(counts.sequences)

    def _diag_toks(self, global_valid_toks: float, mask: torch.Tensor) -> float:
        return global_valid_toks

    def _seq_count(self, global_valid_seqs: float, sample_mask: torch.Tensor) -> float:
        return global_valid_seqs

    def _token_norm(self, global_valid_toks: float, global_valid_seqs: float) -> float:
        return global_valid_toks

    def _seq_norm(self, mask: torch.Tensor) -> float:
        return self.t_norm

    def _token_mean(
        self, clip_loss: torch.Tensor, mask: torch.Tensor, toks: float, seqs: float
    ) -> torch.Tensor:
        return masked_mean(clip_loss, mask, self._token_norm(toks, seqs))

    def forward(
        self, td: TensorDictBase, *, counts: GlobalCounts | None = None
    ) -> dict[str, torch.Tensor]:
        x = _Inputs(td)
        logits = x.logits(self.policy)
        dtype = _out_dtype(logits)
        # next-token space: column j scores token j + 1 with the logits at j
        token_mask = x.m[:, 1:].to(dtype)
        sample_mask = (token_mask.sum(-1) > 0).to(dtype)
        mask = token_mask * sample_mask.unsqueeze(-1)
        valid = mask > 0
        toks, seqs = self._valid_counts(x, mask, sample_mask, counts)
        toks, seqs = max(toks, 1.0), max(seqs, 1.0)
        seq_count = max(self._seq_count(seqs, sample_mask), 1.0)
        next_token_logits = logits[:, :-1].to(dtype)
        logprobs_all = next_token_logits.log_softmax(-1)
        targets = torch.where(valid, x.tokens[:, 1:], torch.zeros_like(x.tokens[:, 1:]))
        curr_logprobs = logprobs_all.gather(-1, targets.unsqueeze(-1)).squeeze(-1)
        # NeMo-RL writes 0 outside the mask; the layout allows NaN there: zero it before use
        prev_logprobs = torch.where(valid, x.old[:, 1:].to(dtype), torch.zeros_like(curr_logprobs))
        advantages = torch.where(
            sample_mask > 0, x.adv.to(dtype), torch.zeros_like(sample_mask)
        ).unsqueeze(-1)
        ratios = torch.exp(
            torch.where(valid, curr_logprobs - prev_logprobs, torch.zeros_like(curr_logprobs))
        )
        ratios_clamped = ratios.clamp(1 - CLIP_EPS, 1 + CLIP_EPS)
        loss1 = -advantages * ratios
        loss2 = -advantages * ratios_clamped
        clip_loss = torch.max(loss1, loss2)
        if self.aggregation == "token_mean":
            actor_loss = self._token_mean(clip_loss, mask, toks, seqs)
        else:
            seq_sum = (clip_loss * mask).sum(-1)
            if self.aggregation == "seq_mean_token_mean":
                per_seq = seq_sum / mask.sum(-1).clamp(min=1.0)
            elif self.aggregation == "seq_mean_token_sum":
                per_seq = seq_sum
            else:
                per_seq = seq_sum / self._seq_norm(mask)
            actor_loss = masked_mean(per_seq, sample_mask, seq_count)
        with torch.no_grad():
            diag = self._diag_toks(toks, mask)
            r = ratios.detach()
            clip_fraction = masked_mean(((r - 1).abs() > CLIP_EPS).to(dtype), mask, diag)
            kl = r - 1 - torch.log(r)
            probs = logprobs_all.exp()
            ent = -(probs * logprobs_all).sum(-1)
        return {
            "loss_objective": actor_loss,
            "clip_fraction": clip_fraction,
            "kl_approx": masked_mean(kl, mask, diag),
            "entropy": masked_mean(ent, mask, diag),
        }


# ---------------------------------------------------------------------------------------------
# One-bug variants.


class LocalTokenMeanLoss(PackedWeightsLoss):
    """TRL ``bnpo``: token_mean over the micro-batch's own token count; ``counts`` ignored."""

    def _counts(self, x: _Inputs, counts: GlobalCounts | None, td: TensorDictBase) -> GlobalCounts:
        return GlobalCounts.of(td)


class PaddedWidthNormLoss(NemoStyleLoss):
    """verl ``seq-mean-token-sum-norm`` with ``loss_scale_factor=None``: divides each sequence's
    sum by the padded tensor's width instead of the declared constant."""

    def _seq_norm(self, mask: torch.Tensor) -> float:
        return float(mask.shape[-1])


class EveryRowSequenceLoss(PackedWeightsLoss):
    """TRL ``grpo``: a row with no assistant token counts as a sequence (``.mean()`` over rows)."""

    def _counts(self, x: _Inputs, counts: GlobalCounts | None, td: TensorDictBase) -> GlobalCounts:
        if counts is not None:
            return counts
        return GlobalCounts(GlobalCounts.of(td).tokens, x.b)


class MeanOfMeansDiagnosticsLoss(NemoStyleLoss):
    """The loss over the global counts, the diagnostics averaged over the micro-batch alone."""

    def _diag_toks(self, global_valid_toks: float, mask: torch.Tensor) -> float:
        return max(float(mask.sum()), 1.0)


class SwappedCountsLoss(NemoStyleLoss):
    """token_mean divides by ``global_valid_seqs`` where ``global_valid_toks`` belongs."""

    def _token_norm(self, global_valid_toks: float, global_valid_seqs: float) -> float:
        return global_valid_seqs


class UnslicedTokenMaskLoss(NemoStyleLoss):
    """Without counts, ``global_valid_toks`` is ``token_mask.sum()`` and ``sample_mask`` is taken
    over the whole row: position 0 counted (NeMo-RL sums ``token_mask[:, 1:]``; the slice is
    lost). Visible only on a batch with an assistant token at position 0."""

    def _valid_counts(
        self, x: _Inputs, mask: torch.Tensor, sample_mask: torch.Tensor, counts: GlobalCounts | None
    ) -> tuple[float, float]:
        if counts is None:
            return float(x.m_full.sum()), float(x.m_full.any(-1).sum())
        return float(counts.tokens), float(counts.sequences)


class RescaledLocalMeanLoss(NemoStyleLoss):
    """token_mean as the micro-batch's own mean rescaled by its share of the global tokens,
    ``masked_mean(loss, mask, mask.sum()) * mask.sum() / global_valid_toks``: the same value
    and gradient, except on a micro-batch without assistant tokens, where 0/0 makes the loss
    value NaN (its gradient stays 0 here; TRL clamps ``mask.sum()`` to 1 for this reason)."""

    def _token_mean(
        self, clip_loss: torch.Tensor, mask: torch.Tensor, toks: float, seqs: float
    ) -> torch.Tensor:
        local = mask.sum()
        return masked_mean(clip_loss, mask, local) * (local / toks)


# ---------------------------------------------------------------------------------------------
# Declarations.

_CAPS = {"global_counts", "diagnostics", "clip"}


def _factory(cls: type[nn.Module], aggregation: str) -> Callable[..., Any]:
    def make(policy: Any, *, aggregation: str = aggregation) -> Any:
        return cls(policy, aggregation=aggregation, t_norm=T_NORM)

    make.__name__ = f"make_{cls.__name__}"
    return make


def _impl(cls: type[nn.Module], aggregation: str) -> Implementation:
    return Implementation(
        "loss",
        _factory(cls, aggregation),
        name=f"independent.{cls.__name__}[{aggregation}]",
        capabilities=_CAPS,
        options={"aggregation": aggregation},
        extras={"t_norm": T_NORM, "clip_epsilon": CLIP_EPS},
    )


CORRECT_COUNTS_LOSSES: dict[str, Implementation] = {
    **{f"packed_{agg}": _impl(PackedWeightsLoss, agg) for agg in AGGREGATIONS},
    **{f"nemo_{agg}": _impl(NemoStyleLoss, agg) for agg in AGGREGATIONS},
}

BUGGY_COUNTS_LOSSES: dict[str, tuple[Implementation, str]] = {
    "trl_bnpo_local_token_mean": (_impl(LocalTokenMeanLoss, "token_mean"), "LOSS-016"),
    "verl_padded_width_norm": (
        _impl(PaddedWidthNormLoss, "seq_mean_token_sum_norm"),
        "LOSS-003",
    ),
    "trl_grpo_every_row": (_impl(EveryRowSequenceLoss, "seq_mean_token_mean"), "LOSS-016"),
    "diagnostics_mean_of_means": (
        _impl(MeanOfMeansDiagnosticsLoss, "token_mean"),
        "LOSS-018",
    ),
    "swapped_counts_fields": (_impl(SwappedCountsLoss, "token_mean"), "LOSS-003"),
    "nemo_unsliced_token_mask": (_impl(UnslicedTokenMaskLoss, "token_mean"), "LOSS-016"),
    "rescaled_local_mean_nan": (_impl(RescaledLocalMeanLoss, "token_mean"), "LOSS-017"),
}
