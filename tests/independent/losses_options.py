"""Policy-gradient losses with the loss v1.4 options, written from ``specs/loss-v1.md`` alone.

Two designs that share nothing but input validation:

- ``LoopLoss`` scores one sequence at a time (the row trimmed after its last attended token,
  one policy call per row) and computes every term in float64 with Python loops over rows,
  as a reference implementation would.
- ``MaskedMeanLoss`` is vectorised in NeMo-RL's style: one batched policy call, per-token
  terms masked with ``torch.where`` and reduced as masked sums over global counts, with
  diagnostics.

Both implement options ``aggregation``, ``kl_estimator`` (k1/k2/k3 of log r = log pi_ref -
log pi), ``kl_gradient`` (pathwise, or NeMo-RL's score form k * exp(log pi - sg(log pi))) and
``ratio`` (token, GSPO sequence, on_policy, none), and capabilities kl_to_ref, clip and
global_counts (``MaskedMeanLoss`` also diagnostics, per_token_advantage and dual clip).
``CORRECT_LOSSES`` declares rows that together cover every value of every option;
``BUGGY_LOSSES`` holds one-bug variants, each with the requirement id expected to catch it.

Example:
    >>> from posttrain.testing import llm_batch, tiny_causal_lm
    >>> policy = tiny_causal_lm(vocab_size=64)
    >>> loss = MaskedMeanLoss(policy, ratio="sequence", kl_estimator="k2")
    >>> out = loss(llm_batch(3, 10, vocab_size=64))
    >>> sorted(k for k in out if k.startswith("loss_"))
    ['loss_kl_to_ref', 'loss_objective']
"""

from __future__ import annotations

import functools
from collections.abc import Mapping
from typing import Any

import torch
from tensordict import TensorDictBase

from posttrain.contracts import LLM_LAYOUT_V1, GlobalCounts, Implementation

__all__ = ["BUGGY_LOSSES", "CORRECT_LOSSES", "LoopLoss", "MaskedMeanLoss"]

AGGREGATIONS = (
    "token_mean",
    "seq_mean_token_mean",
    "seq_mean_token_sum",
    "seq_mean_token_sum_norm",
)
ESTIMATORS = ("k1", "k2", "k3")
GRADIENTS = ("pathwise", "score")
RATIOS = ("token", "sequence", "on_policy", "none")
_INTS = ("tokens",)
_BOOLS = ("attention_mask", "assistant_mask")
_FLOATS = ("sample_log_probs", "ref_log_probs", "advantage")


def _pick(name: str, value: str, allowed: tuple[str, ...]) -> str:
    if value not in allowed:
        raise ValueError(f"option {name}: expected one of {allowed}, found {value!r}")
    return value


class _Batch:
    """The fields a loss reads, validated by name; float fields widened to ``dtype``."""

    def __init__(
        self, td: TensorDictBase, *, kl: bool, per_token_adv: bool, dtype: torch.dtype
    ) -> None:
        k = LLM_LAYOUT_V1.key
        keys = {
            (x,) if isinstance(x, str) else tuple(x)
            for x in td.keys(include_nested=True, leaves_only=True)
        }
        wanted = [*_INTS, *_BOOLS, "sample_log_probs", "advantage"] + (
            ["ref_log_probs"] if kl else []
        )
        got: dict[str, torch.Tensor] = {}
        for name in wanted:
            key = k(name)
            if key not in keys:
                raise KeyError(f"batch is missing field {name!r} at key {key}")
            v = td.get(key)
            if name in _INTS and v.dtype != torch.int64:
                raise TypeError(f"field {name!r} at {key}: expected int64, found {v.dtype}")
            if name in _BOOLS and v.dtype != torch.bool:
                raise TypeError(f"field {name!r} at {key}: expected bool, found {v.dtype}")
            if name in _FLOATS and not v.is_floating_point():
                raise TypeError(f"field {name!r} at {key}: expected a float dtype, found {v.dtype}")
            got[name] = v
        tok = got["tokens"]
        if tok.dim() != 2:
            raise ValueError(
                f"field 'tokens' at {k('tokens')}: expected [B, T], found {tuple(tok.shape)}"
            )
        for name in (*_BOOLS, "sample_log_probs", *(["ref_log_probs"] if kl else [])):
            if got[name].shape != tok.shape:
                raise ValueError(
                    f"field {name!r} at {k(name)}: expected shape {tuple(tok.shape)} like the "
                    f"tokens, found {tuple(got[name].shape)}"
                )
        adv = got["advantage"]
        ok_shapes = [tok.shape[:1]] + ([tok.shape] if per_token_adv else [])
        if adv.shape not in ok_shapes:
            raise ValueError(
                f"field 'advantage' at {k('advantage')}: expected shape "
                f"{' or '.join(str(tuple(s)) for s in ok_shapes)}, found {tuple(adv.shape)}"
            )
        self.att = got["attention_mask"]
        m = got["assistant_mask"] & self.att
        m[:, 0] = False  # no logit predicts position 0
        self.m = m
        self.tokens = torch.where(self.att, tok, torch.zeros_like(tok))
        zero = torch.zeros((), dtype=dtype)
        self.slp = torch.where(m, got["sample_log_probs"].to(dtype), zero)
        self.ref = torch.where(m, got["ref_log_probs"].to(dtype), zero) if kl else None
        a = adv.to(dtype)
        self.adv = torch.where(m, a, zero) if a.dim() == 2 else torch.where(m, a[:, None], zero)
        self.lengths = m.sum(1)


def _counts_of(m: torch.Tensor) -> GlobalCounts:
    per_row = m.sum(1)
    return GlobalCounts(int(per_row.sum()), int((per_row > 0).sum()))


def _kl_value(estimator: str, x: torch.Tensor) -> torch.Tensor:
    """Schulman's estimators of KL(pi || pi_ref) from x = log pi_ref - log pi."""
    if estimator == "k1":
        return -x
    if estimator == "k2":
        return 0.5 * x * x
    return torch.exp(x) - 1 - x


class _Options:
    def __init__(
        self,
        policy: Any,
        *,
        aggregation: str = "token_mean",
        kl_estimator: str = "k3",
        kl_gradient: str = "pathwise",
        ratio: str = "token",
        kl_coef: float = 0.1,
        kl_to_ref: bool = True,
        clip_epsilon: float | tuple[float, float] | None = None,
        dual_clip: float | None = None,
        t_norm: int | None = None,
    ) -> None:
        self.policy = policy
        self.aggregation = _pick("aggregation", aggregation, AGGREGATIONS)
        self.kl_estimator = _pick("kl_estimator", kl_estimator, ESTIMATORS)
        self.kl_gradient = _pick("kl_gradient", kl_gradient, GRADIENTS)
        self.ratio = _pick("ratio", ratio, RATIOS)
        if aggregation == "seq_mean_token_sum_norm" and not t_norm:
            raise ValueError("option aggregation: seq_mean_token_sum_norm needs t_norm")
        self.kl_coef = float(kl_coef)
        self.kl = kl_to_ref
        if clip_epsilon is None:
            self.bounds: tuple[float, float] | None = None
        elif isinstance(clip_epsilon, (tuple, list)):
            self.bounds = (1 - float(clip_epsilon[0]), 1 + float(clip_epsilon[1]))
        else:
            self.bounds = (1 - float(clip_epsilon), 1 + float(clip_epsilon))
        self.dual_clip = dual_clip
        self.t_norm = t_norm


class LoopLoss(_Options):
    """One policy call per row, every term in float64, summed row by row in Python.

    Example:
        >>> from posttrain.testing import llm_batch, tiny_causal_lm
        >>> loss = LoopLoss(tiny_causal_lm(vocab_size=64), aggregation="seq_mean_token_mean")
        >>> float(loss(llm_batch(2, 9, vocab_size=64))["loss_kl_to_ref"]) > 0
        True
    """

    def _row_log_probs(self, tokens: torch.Tensor, att: torch.Tensor) -> torch.Tensor:
        """log p(token_t | before t) for t >= 1 of one row (index 0 = position 1)."""
        (idx,) = att.nonzero(as_tuple=True)
        end = int(idx.max()) + 1 if idx.numel() else 1
        end = max(end, 2)
        out = self.policy(
            input_ids=tokens[None, :end], attention_mask=att[None, :end].long()
        ).logits[0]
        logp = torch.log_softmax(out[:-1].double(), -1)
        lp = logp.gather(-1, tokens[1:end, None])[:, 0]
        return torch.cat([lp, lp.new_zeros(tokens.shape[0] - end)])

    def _weight(self, length: int, counts: GlobalCounts) -> float:
        if length == 0:
            return 0.0
        n, s = max(counts.tokens, 1), max(counts.sequences, 1)
        if self.aggregation == "token_mean":
            return 1.0 / n
        if self.aggregation == "seq_mean_token_mean":
            return 1.0 / (s * length)
        if self.aggregation == "seq_mean_token_sum":
            return 1.0 / s
        assert self.t_norm is not None
        return 1.0 / (s * self.t_norm)

    def _surrogate(self, lp: torch.Tensor, slp: torch.Tensor, a: torch.Tensor) -> torch.Tensor:
        """Per-token surrogate losses of one row's assistant tokens."""
        if self.ratio == "none":
            return -a * lp
        if self.ratio == "token":
            rho = torch.exp(lp - slp)
        elif self.ratio == "sequence":
            rho = torch.exp((lp - slp).mean()).expand_as(lp)
        else:
            rho = torch.exp(lp - lp.detach())
        per = -a * rho
        if self.bounds is not None:
            per = torch.maximum(per, -a * rho.clamp(*self.bounds))
            if self.dual_clip is not None:
                per = torch.where(a < 0, torch.minimum(per, -a * self.dual_clip), per)
        return per

    def _kl(self, lp: torch.Tensor, ref: torch.Tensor) -> torch.Tensor:
        k = _kl_value(self.kl_estimator, ref - lp)
        if self.kl_gradient == "score":
            k = k * torch.exp(lp - lp.detach())
        return k

    def __call__(self, td: TensorDictBase, /, *, counts: GlobalCounts | None = None) -> Any:
        b = _Batch(td, kl=self.kl, per_token_adv=False, dtype=torch.float64)
        counts = counts if counts is not None else _counts_of(b.m)
        obj: torch.Tensor = torch.zeros((), dtype=torch.float64)
        kl: torch.Tensor = torch.zeros((), dtype=torch.float64)
        for i in range(b.m.shape[0]):
            length = int(b.lengths[i])
            if length == 0:
                continue
            lp_all = self._row_log_probs(b.tokens[i], b.att[i])
            sel = b.m[i, 1:]
            lp = lp_all[sel]
            w = self._weight(length, counts)
            obj = obj + w * self._surrogate(lp, b.slp[i, 1:][sel], b.adv[i, 1:][sel]).sum()
            if b.ref is not None:
                kl = kl + w * self._kl(lp, b.ref[i, 1:][sel]).sum()
        if not obj.requires_grad:  # no row trained: keep the gradient reaching the policy
            obj = obj + 0.0 * next(self.policy.parameters()).sum()
        out = {"loss_objective": obj.float()}
        if self.kl:
            out["loss_kl_to_ref"] = (self.kl_coef * kl).float()
        return out


class MaskedMeanLoss(_Options):
    """One batched call; masked per-token terms reduced by global counts (NeMo-RL's style).

    Example:
        >>> from posttrain.testing import llm_batch, tiny_causal_lm
        >>> loss = MaskedMeanLoss(tiny_causal_lm(vocab_size=64), clip_epsilon=0.2)
        >>> out = loss(llm_batch(2, 9, vocab_size=64))
        >>> float(out["clip_fraction"]) >= 0
        True
    """

    per_token_advantage = True

    def log_ratio_for_sequence(self, lr: torch.Tensor, b: _Batch) -> torch.Tensor:
        """GSPO: the mean of log r over each row's assistant tokens, at every token."""
        s = lr.sum(1) / b.lengths.clamp(min=1)
        return s[:, None].expand_as(lr)

    def rho(self, lp: torch.Tensor, b: _Batch) -> torch.Tensor:
        lr = torch.where(b.m, lp - b.slp, torch.zeros_like(lp))
        if self.ratio == "token":
            return torch.exp(lr)
        if self.ratio == "sequence":
            return torch.exp(self.log_ratio_for_sequence(lr, b))
        if self.ratio == "on_policy":
            return torch.exp(lp - lp.detach())
        return lp  # none: REINFORCE's -A log pi

    def kl_value(self, x: torch.Tensor) -> torch.Tensor:
        return _kl_value(self.kl_estimator, x)

    def kl_term(self, k: torch.Tensor, lp: torch.Tensor) -> torch.Tensor:
        if self.kl_gradient == "score":
            return k * torch.exp(lp - lp.detach())
        return k

    def clipped_surrogate(self, a: torch.Tensor, rho: torch.Tensor) -> torch.Tensor:
        """PPO's max(-A rho, -A clip(rho)), and under dual clip c its min with -A c for A < 0."""
        per = -a * rho
        if self.bounds is None:
            return per
        per = torch.maximum(per, -a * rho.clamp(*self.bounds))
        if self.dual_clip is not None:
            per = torch.where(a < 0, torch.minimum(per, -a * self.dual_clip), per)
        return per

    def weights(self, b: _Batch, counts: GlobalCounts) -> torch.Tensor:
        m = b.m.to(torch.float32)
        n, s = max(counts.tokens, 1), max(counts.sequences, 1)
        if self.aggregation == "token_mean":
            return m / n
        if self.aggregation == "seq_mean_token_mean":
            return m / (s * b.lengths.clamp(min=1)[:, None])
        if self.aggregation == "seq_mean_token_sum":
            return m / s
        assert self.t_norm is not None
        return m / (s * self.t_norm)

    def __call__(self, td: TensorDictBase, /, *, counts: GlobalCounts | None = None) -> Any:
        b = _Batch(td, kl=self.kl, per_token_adv=True, dtype=torch.float32)
        counts = counts if counts is not None else _counts_of(b.m)
        logits = self.policy(input_ids=b.tokens, attention_mask=b.att.long()).logits.float()
        logp = torch.log_softmax(logits[:, :-1], -1)
        lp = torch.cat(
            [logp.new_zeros(b.m.shape[0], 1), logp.gather(-1, b.tokens[:, 1:, None])[..., 0]], 1
        )
        lp = torch.where(b.m, lp, torch.zeros_like(lp))
        w = self.weights(b, counts)
        a = b.adv
        rho = self.rho(lp, b)
        clipped = torch.zeros_like(b.m)
        per = -a * rho if self.ratio == "none" else self.clipped_surrogate(a, rho)
        if self.bounds is not None and self.ratio in ("token", "sequence"):
            lo, hi = self.bounds
            r = rho.detach()
            clipped = b.m & ((r < lo) | (r > hi))
        zero = torch.zeros((), dtype=per.dtype)
        out: dict[str, torch.Tensor] = {"loss_objective": torch.where(b.m, w * per, zero).sum()}
        if self.kl:
            assert b.ref is not None
            x = torch.where(b.m, b.ref - lp, torch.zeros_like(lp))
            kt = self.kl_term(self.kl_value(x), lp)
            out["loss_kl_to_ref"] = self.kl_coef * torch.where(b.m, w * kt, zero).sum()
        with torch.no_grad():
            n = max(counts.tokens, 1)
            lr = torch.where(b.m, b.slp - lp, torch.zeros_like(lp))
            p = torch.softmax(logits[:, :-1], -1)
            ent = -(p * logp).sum(-1)
            ent = torch.cat([ent.new_zeros(ent.shape[0], 1), ent], 1)
            out["clip_fraction"] = clipped.sum().float() / n
            out["kl_approx"] = torch.where(b.m, torch.exp(lr) - 1 - lr, zero).sum() / n
            out["entropy"] = torch.where(b.m, ent, zero).sum() / n
        return out


# --- one-bug variants (each docstring names the requirement expected to catch it) ---


class K3WrongDirection(MaskedMeanLoss):
    """k3 with log r taken as log pi - log pi_ref (the ratio inverted): r - 1 - log r of
    pi/pi_ref is the estimator of KL(pi_ref || pi), the other direction. LOSS-019."""

    def kl_value(self, x: torch.Tensor) -> torch.Tensor:
        return super().kl_value(-x) if self.kl_estimator == "k3" else super().kl_value(x)


class K1SignFlipped(MaskedMeanLoss):
    """k1 written as log r = log pi_ref - log pi instead of -log r (log pi - log pi_ref):
    a penalty that rewards moving away from the reference. LOSS-019."""

    def kl_value(self, x: torch.Tensor) -> torch.Tensor:
        return x if self.kl_estimator == "k1" else super().kl_value(x)


class ScoreFormIgnored(MaskedMeanLoss):
    """Declares kl_gradient='score' but differentiates the estimate as written: the
    score-function term k per token is missing. LOSS-020."""

    def kl_term(self, k: torch.Tensor, lp: torch.Tensor) -> torch.Tensor:
        return k


class ScoreTermOnly(MaskedMeanLoss):
    """Score form with the estimate detached, sg(k) * exp(log pi - sg(log pi)): only the
    score-function term k is left, the pathwise -k' is lost (KL-in-reward done in the loss).
    LOSS-020."""

    def kl_term(self, k: torch.Tensor, lp: torch.Tensor) -> torch.Tensor:
        return k.detach() * torch.exp(lp - lp.detach())


class GspoArithmeticMean(MaskedMeanLoss):
    """GSPO's sequence ratio as the arithmetic mean of the token ratios, mean_t exp(log r_t),
    instead of their geometric mean exp(mean_t log r_t). LOSS-021."""

    def rho(self, lp: torch.Tensor, b: _Batch) -> torch.Tensor:
        if self.ratio != "sequence":
            return super().rho(lp, b)
        lr = torch.where(b.m, lp - b.slp, torch.zeros_like(lp))
        r = torch.where(b.m, torch.exp(lr), torch.zeros_like(lr))
        return (r.sum(1) / b.lengths.clamp(min=1))[:, None].expand_as(lr)


class GspoMeanOverAttended(MaskedMeanLoss):
    """GSPO's mean log-ratio divided by the row's attended length (prompt included) instead
    of its assistant-token count: the sequence ratio is pulled towards 1. LOSS-021."""

    def log_ratio_for_sequence(self, lr: torch.Tensor, b: _Batch) -> torch.Tensor:
        s = lr.sum(1) / b.att.sum(1).clamp(min=1)
        return s[:, None].expand_as(lr)


class OnPolicyConstantOne(MaskedMeanLoss):
    """ratio='on_policy' as a constant 1 (``torch.ones_like``): the value is right but the
    surrogate has no gradient of log pi. LOSS-002 (with reference log-probs the policy's own,
    nothing else carries a gradient; LOSS-003's -A w would catch it next)."""

    def rho(self, lp: torch.Tensor, b: _Batch) -> torch.Tensor:
        if self.ratio == "on_policy":
            return torch.ones_like(lp)
        return super().rho(lp, b)


class OnPolicyUsesBehaviour(MaskedMeanLoss):
    """ratio='on_policy' accepted but the behaviour ratio exp(log pi - sample_log_probs) used
    (NeMo-RL's force_on_policy_ratio flag dropped on the way): off policy the value moves.
    LOSS-021."""

    def rho(self, lp: torch.Tensor, b: _Batch) -> torch.Tensor:
        if self.ratio == "on_policy":
            return torch.exp(torch.where(b.m, lp - b.slp, torch.zeros_like(lp)))
        return super().rho(lp, b)


class NoneStillExponentiates(MaskedMeanLoss):
    """ratio='none' (REINFORCE, -A log pi) that still exponentiates the log-ratio: the token
    PPO surrogate -A r without its clip. LOSS-021."""

    def rho(self, lp: torch.Tensor, b: _Batch) -> torch.Tensor:
        if self.ratio == "none":
            return torch.exp(torch.where(b.m, lp - b.slp, torch.zeros_like(lp)))
        return super().rho(lp, b)


class LoopK2WithoutGradient(LoopLoss):
    """The loop design's k2 computed from a detached log pi (the reference term as a
    constant penalty): value right, gradient of loss_kl_to_ref zero. LOSS-020."""

    def _kl(self, lp: torch.Tensor, ref: torch.Tensor) -> torch.Tensor:
        if self.kl_estimator == "k2":
            return super()._kl(lp.detach(), ref)
        return super()._kl(lp, ref)


class GspoNeverClips(MaskedMeanLoss):
    """ratio='sequence' with capability clip declared, but the sequence ratio is never
    clipped in the surrogate (the clip branch written for token ratios only; clip_fraction is
    still reported right): with GSPO's tiny bounds every off-policy row trains unclipped. LOSS-014 by the clip capability's sentence; LOSS-021
    scopes LOSS-014 out for 'sequence', so no requirement looks."""

    def clipped_surrogate(self, a: torch.Tensor, rho: torch.Tensor) -> torch.Tensor:
        if self.ratio == "sequence":
            return -a * rho
        return super().clipped_surrogate(a, rho)


class KlImportanceWeighted(MaskedMeanLoss):
    """Score form weighted by the behaviour ratio, k * exp(log pi - sample_log_probs) (NeMo-RL's
    importance-sampling correction folded into the KL term) instead of exp(log pi - sg(log
    pi)): at ratio 1 identical, off policy the value and gradient are k * r. LOSS-020."""

    def kl_term(self, k: torch.Tensor, lp: torch.Tensor) -> torch.Tensor:
        assert self._slp is not None
        return k * torch.exp(lp - self._slp)

    _slp: torch.Tensor | None = None

    def rho(self, lp: torch.Tensor, b: _Batch) -> torch.Tensor:
        self._slp = torch.where(b.m, b.slp, lp.detach())
        return super().rho(lp, b)


class GspoTokenForm(MaskedMeanLoss):
    """GSPO-token's ratio sg(rho_seq) * exp(log pi_t - sg(log pi_t)) under ratio='sequence':
    the same value, but each token's gradient is its own -A_t * rho instead of the
    derivative of sum w (-A rho) through the row's mean log-ratio; only a [B, T] advantage
    shows it. LOSS-021."""

    def log_ratio_for_sequence(self, lr: torch.Tensor, b: _Batch) -> torch.Tensor:
        s = super().log_ratio_for_sequence(lr, b).detach()
        return torch.where(b.m, s + lr - lr.detach(), s)


class KlOfMeanLogRatio(MaskedMeanLoss):
    """The KL estimate taken of each row's mean log-ratio and put at every token, k(mean_t
    log r_t), instead of the mean of the per-token estimates (a sequence-level KL broadcast
    back to tokens); for k2 and k3 the two differ unless log r is constant along the row.
    LOSS-019."""

    def kl_value(self, x: torch.Tensor) -> torch.Tensor:
        m = x != 0
        mean = x.sum(1) / m.sum(1).clamp(min=1)
        return super().kl_value(torch.where(m, mean[:, None].expand_as(x), torch.zeros_like(x)))


# --- declarations ---

_CLIP_A: dict[str, Any] = {"clip_epsilon": 0.2}
_CLIP_B: dict[str, Any] = {"clip_epsilon": (0.2, 0.28), "dual_clip": 3.0}


def _impl(
    cls: type[_Options],
    name: str,
    *,
    aggregation: str,
    kl_estimator: str,
    kl_gradient: str,
    ratio: str,
    extras: Mapping[str, Any],
) -> Implementation:
    caps = {"kl_to_ref", "clip", "global_counts"}
    if issubclass(cls, MaskedMeanLoss):
        caps |= {"diagnostics", "per_token_advantage"}
    options: dict[str, Any] = {
        "aggregation": aggregation,
        "kl_estimator": kl_estimator,
        "kl_gradient": kl_gradient,
        "ratio": ratio,
    }
    factory = functools.partial(cls, **options, **extras)
    declared = {k: str(v) for k, v in options.items()}
    return Implementation(
        "loss",
        factory,
        name=name,
        capabilities=caps,
        options=declared,
        extras=dict(extras),
        description=(cls.__doc__ or "").split("\n\n")[0],
    )


def _loop(name: str, **o: str) -> Implementation:
    extras = dict(_CLIP_A)
    if o["aggregation"] == "seq_mean_token_sum_norm":
        extras["t_norm"] = 16
    return _impl(LoopLoss, f"loop/{name}", extras=extras, **o)


def _vec(name: str, cls: type[MaskedMeanLoss] = MaskedMeanLoss, **o: str) -> Implementation:
    extras = dict(_CLIP_B)
    if o["aggregation"] == "seq_mean_token_sum_norm":
        extras["t_norm"] = 16
    return _impl(cls, f"vec/{name}", extras=extras, **o)


CORRECT_LOSSES: dict[str, Implementation] = {
    "loop_k1_pathwise_token": _loop(
        "k1_pathwise_token", aggregation="seq_mean_token_mean", kl_estimator="k1",
        kl_gradient="pathwise", ratio="token",
    ),
    "loop_k2_score_sequence": _loop(
        "k2_score_sequence", aggregation="token_mean", kl_estimator="k2",
        kl_gradient="score", ratio="sequence",
    ),
    "loop_k3_pathwise_none": _loop(
        "k3_pathwise_none", aggregation="seq_mean_token_sum_norm", kl_estimator="k3",
        kl_gradient="pathwise", ratio="none",
    ),
    "vec_k3_score_on_policy": _vec(
        "k3_score_on_policy", aggregation="token_mean", kl_estimator="k3",
        kl_gradient="score", ratio="on_policy",
    ),
    "vec_k1_score_token": _vec(
        "k1_score_token", aggregation="seq_mean_token_sum", kl_estimator="k1",
        kl_gradient="score", ratio="token",
    ),
    "vec_k2_pathwise_sequence": _vec(
        "k2_pathwise_sequence", aggregation="seq_mean_token_mean", kl_estimator="k2",
        kl_gradient="pathwise", ratio="sequence",
    ),
    "vec_k3_pathwise_none": _vec(
        "k3_pathwise_none", aggregation="token_mean", kl_estimator="k3",
        kl_gradient="pathwise", ratio="none",
    ),
}  # fmt: skip

_O = {"aggregation": "token_mean", "kl_gradient": "pathwise", "ratio": "token"}

BUGGY_LOSSES: dict[str, tuple[Implementation, str]] = {
    "k3_wrong_direction": (_vec("k3_wrong_direction", K3WrongDirection, **{**_O, "kl_estimator": "k3"}), "LOSS-019"),
    "k1_sign_flipped": (_vec("k1_sign_flipped", K1SignFlipped, **{**_O, "kl_estimator": "k1"}), "LOSS-019"),
    "score_form_ignored": (
        _vec("score_form_ignored", ScoreFormIgnored, **{**_O, "kl_estimator": "k3", "kl_gradient": "score"}),
        "LOSS-020",
    ),
    "score_term_only": (
        _vec("score_term_only", ScoreTermOnly, **{**_O, "kl_estimator": "k2", "kl_gradient": "score"}),
        "LOSS-020",
    ),
    "gspo_arithmetic_mean": (
        _vec("gspo_arithmetic_mean", GspoArithmeticMean, **{**_O, "kl_estimator": "k3", "ratio": "sequence"}),
        "LOSS-021",
    ),
    "gspo_mean_over_attended": (
        _vec("gspo_mean_over_attended", GspoMeanOverAttended, **{**_O, "kl_estimator": "k3", "ratio": "sequence"}),
        "LOSS-021",
    ),
    "on_policy_constant_one": (
        _vec("on_policy_constant_one", OnPolicyConstantOne, **{**_O, "kl_estimator": "k3", "ratio": "on_policy"}),
        "LOSS-002",
    ),
    "on_policy_uses_behaviour": (
        _vec("on_policy_uses_behaviour", OnPolicyUsesBehaviour, **{**_O, "kl_estimator": "k3", "ratio": "on_policy"}),
        "LOSS-021",
    ),
    "none_still_exponentiates": (
        _vec("none_still_exponentiates", NoneStillExponentiates, **{**_O, "kl_estimator": "k3", "ratio": "none"}),
        "LOSS-021",
    ),
    "loop_k2_without_gradient": (
        _impl(LoopK2WithoutGradient, "loop/k2_without_gradient", extras=_CLIP_A,
              **{**_O, "kl_estimator": "k2"}),
        "LOSS-020",
    ),
    "gspo_never_clips": (
        _vec("gspo_never_clips", GspoNeverClips, **{**_O, "kl_estimator": "k3", "ratio": "sequence"}),
        "LOSS-022",
    ),
    "kl_importance_weighted": (
        _vec("kl_importance_weighted", KlImportanceWeighted, **{**_O, "kl_estimator": "k3", "kl_gradient": "score"}),
        "LOSS-020",
    ),
    "gspo_token_form": (
        _vec("gspo_token_form", GspoTokenForm, **{**_O, "kl_estimator": "k3", "ratio": "sequence"}),
        "LOSS-021",
    ),
    "kl_of_mean_log_ratio": (
        _vec("kl_of_mean_log_ratio", KlOfMeanLogRatio, **{**_O, "kl_estimator": "k3"}),
        "LOSS-019",
    ),
}  # fmt: skip
