"""PPO/GRPO clipped-surrogate losses written from ``specs/loss-v1.md`` alone, and bugs.

``MaskedClipLoss`` is vectorised over [B, T] with ``torch.where`` masks (every aggregation,
KL to the reference, diagnostics, per-token advantages). ``SeqLoopLoss`` loops over the
sequences and indexes each one's assistant positions, so masked values never enter the graph;
it can also run the policy once per sequence, trimmed to its own length.

Alignment (the layout's): position t of a log-prob field is log p(token_t | tokens before t),
read from the logits at t-1; position 0 is never predicted and never trained on.

Example:
    >>> from posttrain.testing import llm_batch
    >>> from posttrain.testing import tiny_causal_lm
    >>> loss = MaskedClipLoss(tiny_causal_lm(vocab_size=64))
    >>> out = loss(llm_batch(2, vocab_size=64))
    >>> out["loss_objective"].shape
    torch.Size([])
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
from tensordict import TensorDict, TensorDictBase
from torch import nn

from posttrain.contracts import Implementation

__all__ = ["BUGGY_LOSSES", "CORRECT_LOSSES", "MaskedClipLoss", "SeqLoopLoss"]

TOKENS = ("tokens", "full")
ATTN = ("masks", "all_attention_mask")
ASST = ("masks", "all_assistant_mask")
OLD = ("log_probs", "full")
REF = ("next", "ref_log_probs", "full")
ADV = ("advantage",)
AGGREGATIONS = (
    "token_mean",
    "seq_mean_token_mean",
    "seq_mean_token_sum",
    "seq_mean_token_sum_norm",
)
T_NORM = 16.0


def _field(td: TensorDictBase, key: tuple[str, ...], dtype: torch.dtype) -> torch.Tensor:
    if key not in td.keys(include_nested=True, leaves_only=True):
        name = key[0] if len(key) == 1 else key
        raise KeyError(f"loss: the batch has no field at key {name!r}")
    v = td.get(key)
    if not isinstance(v, torch.Tensor) or v.dtype != dtype:
        got = getattr(v, "dtype", type(v).__name__)
        raise TypeError(f"loss: key {key!r} has dtype {got}, expected {dtype}")
    return v


class _Batch:
    """The fields a clipped-surrogate loss reads, checked (dtype, shape) and named on error."""

    def __init__(self, td: TensorDictBase, *, per_token_advantage: bool, kl: bool) -> None:
        self.tokens = _field(td, TOKENS, torch.int64)
        if self.tokens.dim() != 2:
            raise ValueError(
                f"loss: key {TOKENS!r} must be [B, T], found {list(self.tokens.shape)}"
            )
        b, t = self.tokens.shape
        self.attn = _field(td, ATTN, torch.bool)
        self.asst = _field(td, ASST, torch.bool)
        self.old = _field(td, OLD, torch.float32)
        self.adv = _field(td, ADV, torch.float32)
        self.ref = _field(td, REF, torch.float32) if kl else None
        for key, v in ((ATTN, self.attn), (ASST, self.asst), (OLD, self.old), (REF, self.ref)):
            if v is not None and tuple(v.shape) != (b, t):
                raise ValueError(f"loss: key {key!r} must be [{b}, {t}], found {list(v.shape)}")
        ok = [(b,), (b, t)] if per_token_advantage else [(b,)]
        if tuple(self.adv.shape) not in ok:
            raise ValueError(
                f"loss: key 'advantage' must be one of {ok}, found {list(self.adv.shape)}"
            )
        # Trained-on tokens: assistant (which implies attended) and predicted (t >= 1).
        mask = self.asst & self.attn
        mask[:, 0] = False
        self.mask = mask
        # Padding may hold any id; the embedding must not see an out-of-vocabulary one.
        self.input_ids = torch.where(self.attn, self.tokens, torch.zeros_like(self.tokens))

    def adv_tokens(self) -> torch.Tensor:
        """Advantage per token, 0 wherever the mask is False (NaN or garbage there is dropped)."""
        a = self.adv[:, None].expand_as(self.old) if self.adv.dim() == 1 else self.adv
        return torch.where(self.mask, a, torch.zeros_like(a))


def _check_options(aggregation: str, clip_eps: float, t_norm: float | None) -> None:
    if aggregation not in AGGREGATIONS:
        raise ValueError(f"unknown aggregation {aggregation!r}; expected one of {AGGREGATIONS}")
    if not 0.0 < float(clip_eps) < 1.0:
        raise ValueError(f"clip_eps: expected a value in (0, 1), found {clip_eps!r}")
    if aggregation == "seq_mean_token_sum_norm" and not t_norm:
        raise ValueError("aggregation 'seq_mean_token_sum_norm' needs t_norm")


def token_weights(mask: torch.Tensor, aggregation: str, t_norm: float | None) -> torch.Tensor:
    """Weight of each token in the scalar, per the contract's aggregation table.

    Example:
        >>> m = torch.tensor([[True, True, False], [True, False, False]])
        >>> token_weights(m, "seq_mean_token_mean", None).tolist()
        [[0.25, 0.25, 0.0], [0.5, 0.0, 0.0]]
    """
    m = mask.float()
    b = mask.shape[0]
    if aggregation == "token_mean":
        return m / m.sum().clamp(min=1.0)
    if aggregation == "seq_mean_token_mean":
        return m / (b * m.sum(dim=1, keepdim=True).clamp(min=1.0))
    if aggregation == "seq_mean_token_sum":
        return m / b
    assert t_norm is not None
    return m / (b * t_norm)


class MaskedClipLoss(nn.Module):
    """Vectorised clipped surrogate: ``-min(r A, clip(r, 1-eps, 1+eps) A)`` over masked [B, T].

    With ``kl_coef`` > 0 adds ``loss_kl_to_ref`` (k3 estimator, same token weights); with
    ``diagnostics`` returns ``clip_fraction``, ``kl_approx`` and ``entropy`` (means over the
    trained-on tokens).

    Example:
        >>> from posttrain.testing import llm_batch
        >>> from posttrain.testing import tiny_causal_lm
        >>> loss = MaskedClipLoss(tiny_causal_lm(), kl_coef=0.1, diagnostics=True)
        >>> sorted(loss(llm_batch(2, vocab_size=64)))
        ['clip_fraction', 'entropy', 'kl_approx', 'loss_kl_to_ref', 'loss_objective']
    """

    def __init__(
        self,
        policy: Any,
        *,
        aggregation: str = "token_mean",
        clip_eps: float = 0.2,
        kl_coef: float = 0.0,
        diagnostics: bool = False,
        per_token_advantage: bool = True,
        t_norm: float | None = None,
    ) -> None:
        super().__init__()
        _check_options(aggregation, clip_eps, t_norm)
        self.policy = policy
        self.aggregation = aggregation
        self.clip_eps = float(clip_eps)
        self.kl_coef = float(kl_coef)
        self.diagnostics = diagnostics
        self.per_token_advantage = per_token_advantage
        self.t_norm = t_norm

    def _token_log_probs(self, b: _Batch) -> tuple[torch.Tensor, torch.Tensor]:
        logits = self.policy(input_ids=b.input_ids, attention_mask=b.attn.long()).logits
        logp_v = torch.log_softmax(logits[:, :-1].float(), dim=-1)
        picked = logp_v.gather(-1, b.input_ids[:, 1:, None]).squeeze(-1)
        logp = torch.cat([torch.zeros_like(picked[:, :1]), picked], dim=1)
        return logp, logp_v

    def _ratio(self, b: _Batch, logp: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        # Replace what lies outside the mask *before* any arithmetic: a NaN there would give
        # NaN gradients through exp even where torch.where later drops its value.
        old = torch.where(b.mask, b.old, logp.detach())
        log_ratio = torch.where(b.mask, logp - old, torch.zeros_like(logp))
        return log_ratio, torch.exp(log_ratio)

    def _surrogate(self, ratio: torch.Tensor, adv: torch.Tensor) -> torch.Tensor:
        clipped = ratio.clamp(1.0 - self.clip_eps, 1.0 + self.clip_eps)
        return -torch.minimum(ratio * adv, clipped * adv)

    def _kl(self, b: _Batch, logp: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
        assert b.ref is not None
        ref = torch.where(b.mask, b.ref, logp.detach())
        d = torch.where(b.mask, ref - logp, torch.zeros_like(logp))
        k3 = torch.exp(d) - d - 1.0
        return self.kl_coef * (k3 * w).sum()

    def forward(self, td: TensorDictBase) -> dict[str, torch.Tensor]:
        """The loss terms (and diagnostics) of ``td``; ``td`` is only read."""
        b = _Batch(td, per_token_advantage=self.per_token_advantage, kl=self.kl_coef > 0)
        logp, logp_v = self._token_log_probs(b)
        log_ratio, ratio = self._ratio(b, logp)
        per_tok = torch.where(
            b.mask, self._surrogate(ratio, b.adv_tokens()), torch.zeros_like(logp)
        )
        w = self._weights(b)
        out = {"loss_objective": (per_tok * w).sum()}
        if self.kl_coef > 0:
            out["loss_kl_to_ref"] = self._kl(b, logp, w)
        if self.diagnostics:
            out.update(self._diagnostics(b, ratio, log_ratio, logp_v))
        return out

    def _weights(self, b: _Batch) -> torch.Tensor:
        return token_weights(b.mask, self.aggregation, self.t_norm)

    def _diagnostics(
        self, b: _Batch, ratio: torch.Tensor, log_ratio: torch.Tensor, logp_v: torch.Tensor
    ) -> dict[str, torch.Tensor]:
        with torch.no_grad():
            n = b.mask.sum().clamp(min=1).float()
            eps = self.clip_eps
            clipped = ((ratio < 1.0 - eps) | (ratio > 1.0 + eps)) & b.mask
            kl = torch.where(b.mask, (ratio - 1.0) - log_ratio, torch.zeros_like(ratio))
            ent_v = -(logp_v.exp() * logp_v).sum(-1)  # [B, T-1]: entropy of the dist. at t-1
            ent = torch.cat([torch.zeros_like(ent_v[:, :1]), ent_v], dim=1)
            ent = torch.where(b.mask, ent, torch.zeros_like(ent))
            return {
                "clip_fraction": clipped.sum().float() / n,
                "kl_approx": kl.sum() / n,
                "entropy": ent.sum() / n,
            }


class SeqLoopLoss(nn.Module):
    """Per-sequence loop: each row's assistant positions are gathered, never masked.

    ``per_sequence_forward=True`` calls the policy once per row on its tokens up to the last
    attended one (no padding at all reaches the model).

    Example:
        >>> from posttrain.testing import llm_batch
        >>> from posttrain.testing import tiny_causal_lm
        >>> loss = SeqLoopLoss(tiny_causal_lm())
        >>> list(loss(llm_batch(2, vocab_size=64)))
        ['loss_objective']
    """

    def __init__(
        self,
        policy: Any,
        *,
        aggregation: str = "seq_mean_token_mean",
        clip_eps: float = 0.2,
        per_sequence_forward: bool = False,
        t_norm: float | None = None,
    ) -> None:
        super().__init__()
        _check_options(aggregation, clip_eps, t_norm)
        self.policy = policy
        self.aggregation = aggregation
        self.clip_eps = float(clip_eps)
        self.per_sequence_forward = per_sequence_forward
        self.t_norm = t_norm

    def _row_logits(self, b: _Batch, i: int, batched: torch.Tensor | None) -> torch.Tensor:
        if batched is not None:
            return batched[i]
        last = int(b.attn[i].nonzero().max()) + 1
        out = self.policy(
            input_ids=b.input_ids[i : i + 1, :last], attention_mask=b.attn[i : i + 1, :last].long()
        )
        row: torch.Tensor = out.logits[0]
        return row

    def _row_log_probs(
        self, logits: torch.Tensor, tokens: torch.Tensor, pos: torch.Tensor
    ) -> torch.Tensor:
        rows = torch.log_softmax(logits[pos - 1].float(), dim=-1)
        return rows.gather(-1, tokens[pos, None]).squeeze(-1)

    def forward(self, td: TensorDictBase) -> dict[str, torch.Tensor]:
        """``loss_objective`` of ``td``; ``td`` is only read."""
        b = _Batch(td, per_token_advantage=True, kl=False)
        n_rows = b.tokens.shape[0]
        batched = None
        if not self.per_sequence_forward:
            batched = self.policy(input_ids=b.input_ids, attention_mask=b.attn.long()).logits
        n_tokens = max(int(b.mask.sum()), 1)
        terms: list[torch.Tensor] = []
        for i in range(n_rows):
            pos = b.mask[i].nonzero().squeeze(1)
            if pos.numel() == 0:
                continue
            logits = self._row_logits(b, i, batched)
            lp = self._row_log_probs(logits, b.input_ids[i], pos)
            adv = b.adv[i] if b.adv.dim() == 1 else b.adv[i, pos]
            ratio = torch.exp(lp - b.old[i, pos])
            clipped = ratio.clamp(1.0 - self.clip_eps, 1.0 + self.clip_eps)
            tok = -torch.minimum(ratio * adv, clipped * adv)
            if self.aggregation == "token_mean":
                terms.append(tok.sum() / n_tokens)
            elif self.aggregation == "seq_mean_token_mean":
                terms.append(tok.mean() / n_rows)
            elif self.aggregation == "seq_mean_token_sum":
                terms.append(tok.sum() / n_rows)
            else:
                assert self.t_norm is not None
                terms.append(tok.sum() / (n_rows * self.t_norm))
        total = torch.stack(terms).sum() if terms else torch.zeros(())
        return {"loss_objective": total}


# ---------------------------------------------------------------------------------------------
# One-bug variants.


class PaddingMeanLoss(MaskedClipLoss):
    """BUG: "token mean" is ``per_token.mean()`` over every position of [B, T], masked ones
    zeroed but counted, so prompt and padding dilute the loss and appending padding columns
    shrinks it (TorchRL's ``.mean()`` reductions; verl/TRL's loss_agg_mode discussions).

    Breaks LOSS-005 ("Appending padding columns ... MUST NOT change any output"), and the
    token_mean weights of LOSS-003.
    """

    def _weights(self, b: _Batch) -> torch.Tensor:
        return torch.full_like(b.old, 1.0 / b.old.numel())


class PromptKLLoss(MaskedClipLoss):
    """BUG: the KL penalty runs over every attended position after the first (prompt tokens
    included), reference log-probs that are NaN there counting as "equal", and is averaged
    over that count: it is positive when the reference differs on prompt tokens alone and is
    diluted by the prompt length.

    Breaks LOSS-010 ("... stay zero when they differ elsewhere only ... reduced over
    assistant tokens, not positions").
    """

    def _kl(self, b: _Batch, logp: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
        assert b.ref is not None
        seen = b.attn.clone()
        seen[:, 0] = False
        ref = torch.where(seen & torch.isfinite(b.ref), b.ref, logp.detach())
        d = torch.where(seen, ref - logp, torch.zeros_like(logp))
        k3 = torch.exp(d) - d - 1.0
        return self.kl_coef * k3.sum() / seen.sum().clamp(min=1)


class WhereNaNGradLoss(MaskedClipLoss):
    """BUG: the ratio is ``where(mask, exp(logp - old), 1)``: the forward value is right, but
    where ``old`` is NaN outside the mask (TorchRL's convention) the backward of ``exp`` gives
    0 * NaN = NaN, so the gradient with respect to masked tokens' log-probs (and the policy's
    parameters) is NaN. The failure class of pytorch/pytorch#68425 ("torch.where produces nan
    in backward pass") fixed in NVIDIA-NeMo/RL#4120 ("mask excluded values before logprob
    exponentiation") and NovaSky-AI/SkyRL#1635.

    Breaks LOSS-003 (the gradient with respect to each token's log-prob MUST be minus the
    advantage times its weight, 0 for a masked token; NaN is found).
    """

    def _ratio(self, b: _Batch, logp: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        raw = logp - b.old
        log_ratio = torch.where(b.mask, raw, torch.zeros_like(raw))
        ratio = torch.where(b.mask, torch.exp(raw), torch.ones_like(raw))
        return log_ratio, ratio


class InPlaceSanitizeLoss(MaskedClipLoss):
    """BUG: replaces the NaNs of the behaviour log-probs *in place* (``nan_to_num_``) before
    using them, so the caller's batch comes back changed (TorchRL losses write into the
    TensorDict they are given).

    Breaks LOSS-007 ("loss(td) MUST NOT add, remove or change any entry of td").
    """

    def forward(self, td: TensorDictBase) -> dict[str, torch.Tensor]:
        """Sanitise the behaviour log-probs in place, then compute the loss."""
        old = td.get(OLD)
        if isinstance(old, torch.Tensor) and old.is_floating_point():
            old.nan_to_num_(0.0)
        return super().forward(td)


class MisalignedLoopLoss(SeqLoopLoss):
    """BUG: reads token t's log-prob from the logits at t instead of t-1 (the shift between
    "logits at t predict t+1" and the layout's "position t holds log p(token_t)" is lost), so
    every ratio is computed for the wrong prediction and is not 1 when the behaviour
    log-probs are the policy's own.

    Breaks LOSS-003 (gradient of loss_objective w.r.t. each token's log-prob at ratio 1).
    """

    def _row_log_probs(
        self, logits: torch.Tensor, tokens: torch.Tensor, pos: torch.Tensor
    ) -> torch.Tensor:
        rows = torch.log_softmax(logits[pos].float(), dim=-1)
        return rows.gather(-1, tokens[pos, None]).squeeze(-1)


class WrongSideClipLoss(MaskedClipLoss):
    """BUG: ``max`` instead of ``min`` of the two surrogates (the pessimistic bound turned
    optimistic: large ratios are never clipped for positive advantages). At ratio 1 both
    surrogates and their gradients agree, so only a check away from ratio 1 can see it.

    Broke no requirement of loss 1.0 (no sentence spoke of the objective away from ratio 1:
    a spec gap); breaks LOSS-014 (capability ``clip``, loss 1.1), which it declares.
    """

    def _surrogate(self, ratio: torch.Tensor, adv: torch.Tensor) -> torch.Tensor:
        clipped = ratio.clamp(1.0 - self.clip_eps, 1.0 + self.clip_eps)
        return -torch.maximum(ratio * adv, clipped * adv)


class CopyPastedKeyNameLoss(MaskedClipLoss):
    """BUG: every dtype error names ``('tokens', 'full')`` (its text copied from the token
    check), whichever field has the wrong dtype.

    Breaks LOSS-009 ("... with a wrong dtype MUST raise an error naming the key").
    """

    def forward(self, td: TensorDictBase) -> dict[str, torch.Tensor]:
        """Compute the loss; a dtype error is reported against the tokens."""
        try:
            return super().forward(td)
        except TypeError as e:
            raise TypeError("loss: key ('tokens', 'full') has the wrong dtype") from e


class ShiftedEntropyLoss(MaskedClipLoss):
    """BUG: the entropy diagnostic of token t is read from the distribution at t (the one
    predicting token t+1) instead of t-1, the shift the log-probs do get right.

    Breaks LOSS-012 ("entropy is the token mean of the full-vocabulary entropy" over the
    assistant tokens: of the distributions those tokens were drawn from).
    """

    def _diagnostics(
        self, b: _Batch, ratio: torch.Tensor, log_ratio: torch.Tensor, logp_v: torch.Tensor
    ) -> dict[str, torch.Tensor]:
        out = super()._diagnostics(b, ratio, log_ratio, logp_v)
        with torch.no_grad():
            ent_v = -(logp_v.exp() * logp_v).sum(-1)  # [B, T-1], index t-1 -> token t
            ent = torch.cat([ent_v, torch.zeros_like(ent_v[:, :1])], dim=1)  # BUG: no shift
            ent = torch.where(b.mask, ent, torch.zeros_like(ent))
            out["entropy"] = ent.sum() / b.mask.sum().clamp(min=1)
        return out


class ShiftedTokenAdvantageLoss(MaskedClipLoss):
    """BUG: a per-token advantage [B, T] is read one position late (token t gets the
    advantage stored at t-1), as when token-level advantages are laid out like logits (t
    predicts t+1) while log-probs follow the layout. An advantage constant along T hides it.

    Breaks LOSS-003 (the gradient w.r.t. each token's log-prob MUST be minus *its* advantage
    times the weight) for [B, T] advantages, which capability per_token_advantage accepts.
    """

    def forward(self, td: TensorDictBase) -> dict[str, torch.Tensor]:
        """Compute the loss with [B, T] advantages shifted by one position."""
        adv = td.get("advantage")
        if isinstance(adv, torch.Tensor) and adv.dim() == 2:
            td = td.clone(recurse=False)
            td.set("advantage", torch.roll(adv, shifts=1, dims=1))
        return super().forward(td)


class CastingLoss(MaskedClipLoss):
    """Written as a BUG under loss 1.0 (float fields of any floating dtype cast to float32
    instead of refused, ``.float()`` on the way in), it is CORRECT under loss 1.1: LOSS-009 now
    says "a float field in another floating dtype ... is not a wrong dtype: the loss either
    refuses it naming the key or computes in its own precision".
    """

    def forward(self, td: TensorDictBase) -> dict[str, torch.Tensor]:
        """Cast floating fields to float32, then compute the loss."""
        td = td.clone(recurse=False)
        for key in (OLD, REF, ADV):
            if key in td.keys(include_nested=True, leaves_only=True):
                v = td.get(key)
                if isinstance(v, torch.Tensor) and v.is_floating_point():
                    td.set(key, v.float())
        return super().forward(td)


# Correct designs that read the spec's latitude differently from the obvious one.


class TensorDictOutLoopLoss(SeqLoopLoss):
    """CORRECT: returns a TensorDict (batch size []) rather than a dict, as TorchRL's losses
    do; LOSS-001 allows "a TensorDict or mapping".
    """

    def forward(self, td: TensorDictBase) -> Any:
        """The loss terms of ``td`` in a TensorDict."""
        return TensorDict(super().forward(td), batch_size=[])


class TrlClipFractionLoss(MaskedClipLoss):
    """CORRECT (TRL's reading): a token counts as clipped when the clip is *binding*, i.e. the
    min() picked the clipped surrogate: ratio > 1+eps with a positive advantage, or ratio <
    1-eps with a negative one. LOSS-012 says "when every assistant token is clipped
    clip_fraction is 1" without defining "clipped"; under this reading it holds.
    """

    def _diagnostics(
        self, b: _Batch, ratio: torch.Tensor, log_ratio: torch.Tensor, logp_v: torch.Tensor
    ) -> dict[str, torch.Tensor]:
        out = super()._diagnostics(b, ratio, log_ratio, logp_v)
        with torch.no_grad():
            adv = b.adv_tokens()
            eps = self.clip_eps
            binding = ((ratio > 1.0 + eps) & (adv > 0)) | ((ratio < 1.0 - eps) & (adv < 0))
            out["clip_fraction"] = (binding & b.mask).sum().float() / b.mask.sum().clamp(min=1)
        return out


_OPTIONS = {"aggregation", "clip_eps", "kl_coef"}


def _factory(
    cls: type[nn.Module], fixed: dict[str, Any], defaults: dict[str, Any]
) -> Callable[..., Any]:
    allowed = {k for k in _OPTIONS if k in defaults}

    def make(policy: Any, **overrides: Any) -> Any:
        unknown = sorted(set(overrides) - allowed)
        if unknown:
            raise TypeError(f"unknown keyword argument {unknown[0]!r}; accepted: {sorted(allowed)}")
        return cls(policy, **{**defaults, **overrides}, **fixed)

    make.__name__ = f"make_{cls.__name__}"
    return make


def _masked(
    aggregation: str = "token_mean",
    cls: type[MaskedClipLoss] = MaskedClipLoss,
    t_norm: float = T_NORM,
) -> Callable[..., Any]:
    return _factory(
        cls,
        {"diagnostics": True, "per_token_advantage": True, "t_norm": t_norm},
        {"aggregation": aggregation, "clip_eps": 0.2, "kl_coef": 0.05},
    )


def _loop(
    aggregation: str = "seq_mean_token_mean",
    cls: type[SeqLoopLoss] = SeqLoopLoss,
    per_sequence_forward: bool = False,
) -> Callable[..., Any]:
    return _factory(
        cls,
        {"per_sequence_forward": per_sequence_forward, "t_norm": T_NORM},
        {"aggregation": aggregation, "clip_eps": 0.2},
    )


_MASKED_CAPS = {"kl_to_ref", "diagnostics", "per_token_advantage", "clip"}


def _masked_impl(
    name: str,
    cls: type[MaskedClipLoss] = MaskedClipLoss,
    agg: str = "token_mean",
    t_norm: float = T_NORM,
) -> Implementation:
    return Implementation(
        "loss",
        _masked(agg, cls, t_norm),
        name=f"independent.{name}",
        capabilities=_MASKED_CAPS,
        options={"aggregation": agg},
        extras={"t_norm": t_norm, "clip_epsilon": 0.2},
    )


def _loop_impl(
    name: str,
    cls: type[SeqLoopLoss] = SeqLoopLoss,
    agg: str = "seq_mean_token_mean",
    per_sequence_forward: bool = False,
) -> Implementation:
    return Implementation(
        "loss",
        _loop(agg, cls, per_sequence_forward),
        name=f"independent.{name}",
        capabilities={"per_token_advantage", "clip"},
        options={"aggregation": agg},
        extras={"t_norm": T_NORM, "clip_epsilon": 0.2},
    )


CORRECT_LOSSES = {
    "masked_token_mean": _masked_impl("MaskedClipLoss"),
    # T_norm as a float (the spec: "a declared constant") and as an int.
    "masked_seq_sum_norm": _masked_impl("MaskedClipLoss[norm]", agg="seq_mean_token_sum_norm"),
    "masked_seq_sum_norm_int": _masked_impl(
        "MaskedClipLoss[norm,int]", agg="seq_mean_token_sum_norm", t_norm=16
    ),
    "loop_seq_mean": _loop_impl("SeqLoopLoss"),
    "loop_token_sum": _loop_impl("SeqLoopLoss[sum]", agg="seq_mean_token_sum"),
    "loop_per_sequence_forward": _loop_impl("SeqLoopLoss[per-seq]", per_sequence_forward=True),
    "loop_tensordict_output": _loop_impl("TensorDictOutLoopLoss", TensorDictOutLoopLoss),
    "masked_trl_clip_fraction": _masked_impl("TrlClipFractionLoss", TrlClipFractionLoss),
    "masked_casting_floats": _masked_impl("CastingLoss", CastingLoss),
}

BUGGY_LOSSES: dict[str, tuple[Implementation, str]] = {
    "padding_mean": (_masked_impl("PaddingMeanLoss", PaddingMeanLoss), "LOSS-005"),
    "prompt_kl": (_masked_impl("PromptKLLoss", PromptKLLoss), "LOSS-010"),
    "where_nan_grad": (_masked_impl("WhereNaNGradLoss", WhereNaNGradLoss), "LOSS-003"),
    "in_place_sanitize": (_masked_impl("InPlaceSanitizeLoss", InPlaceSanitizeLoss), "LOSS-007"),
    "copy_pasted_key_name": (
        _masked_impl("CopyPastedKeyNameLoss", CopyPastedKeyNameLoss),
        "LOSS-009",
    ),
    "shifted_entropy": (_masked_impl("ShiftedEntropyLoss", ShiftedEntropyLoss), "LOSS-012"),
    "shifted_token_advantage": (
        _masked_impl("ShiftedTokenAdvantageLoss", ShiftedTokenAdvantageLoss),
        "LOSS-003",
    ),
    "misaligned_loop": (_loop_impl("MisalignedLoopLoss", MisalignedLoopLoss), "LOSS-003"),
    "wrong_side_clip": (_masked_impl("WrongSideClipLoss", WrongSideClipLoss), "LOSS-014"),
}
