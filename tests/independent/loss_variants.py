"""One-bug variants of a policy-gradient loss (contract ``loss`` v1), written from
``specs/loss-v1.md`` alone, to measure the conformance kit's reach.

The base, :class:`HookedLoss`, is ``losses_options.MaskedMeanLoss`` (one batched call, masked
per-token terms, global counts, every option) with its ``__call__`` opened up into hooks:
the compute dtype, a last look at the validated batch, and the KL weights. It conforms. Each
variant overrides one hook or method with one bug of a kind real systems have shipped, and
names the requirement whose sentence it breaks; ``demo_<name>()`` shows the bug without the
kit (True: the spec's sentence fails on the variant and holds on the base).

Example:
    >>> from posttrain.testing import llm_batch, tiny_causal_lm
    >>> out = HookedLoss(tiny_causal_lm(vocab_size=64), clip_epsilon=0.2)(llm_batch(2, 9, vocab_size=64))
    >>> sorted(k for k in out if k.startswith("loss_"))
    ['loss_kl_to_ref', 'loss_objective']
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any

import torch
from tensordict import TensorDictBase

from posttrain.contracts import LLM_LAYOUT_V1, GlobalCounts, Implementation
from tests.independent import losses_options as lo
from tests.independent import losses_sft_dpo as sd

__all__ = ["BASES", "DEMOS", "VARIANTS", "HookedLoss"]

_K = LLM_LAYOUT_V1.key


class HookedLoss(lo.MaskedMeanLoss):
    """``MaskedMeanLoss`` with hooks; the same terms, dtype float32 whatever the inputs.

    Example:
        >>> from posttrain.testing import llm_batch, tiny_causal_lm
        >>> loss = HookedLoss(tiny_causal_lm(vocab_size=64), ratio="sequence")
        >>> loss(llm_batch(3, 10, vocab_size=64))["loss_objective"].dtype
        torch.float32
    """

    def compute_dtype(self, td: TensorDictBase) -> torch.dtype:
        """The dtype every term is computed and returned in (the layout's float32)."""
        return torch.float32

    def adjust(self, b: lo._Batch, td: TensorDictBase) -> None:
        """A last look at the validated batch (the base leaves it alone)."""

    def kl_weights(self, b: lo._Batch, w: torch.Tensor, counts: GlobalCounts) -> torch.Tensor:
        """The KL term's token weights: the declared aggregation's, like the objective's."""
        return w

    def __call__(self, td: TensorDictBase, /, *, counts: GlobalCounts | None = None) -> Any:
        dtype = self.compute_dtype(td)
        b = lo._Batch(td, kl=self.kl, per_token_adv=True, dtype=dtype)
        self.adjust(b, td)
        counts = counts if counts is not None else lo._counts_of(b.m)
        logits = self.policy(input_ids=b.tokens, attention_mask=b.att.long()).logits.to(dtype)
        logp = torch.log_softmax(logits[:, :-1], -1)
        lp = torch.cat(
            [logp.new_zeros(b.m.shape[0], 1), logp.gather(-1, b.tokens[:, 1:, None])[..., 0]], 1
        )
        lp = torch.where(b.m, lp, torch.zeros_like(lp))
        w = self.weights(b, counts).to(dtype)
        a = b.adv
        rho = self.rho(lp, b)
        clipped = torch.zeros_like(b.m)
        per = -a * rho if self.ratio == "none" else self.clipped_surrogate(a, rho)
        if self.bounds is not None and self.ratio in ("token", "sequence"):
            lo_b, hi_b = self.bounds
            r = rho.detach()
            clipped = b.m & ((r < lo_b) | (r > hi_b))
        zero = torch.zeros((), dtype=per.dtype)
        out: dict[str, torch.Tensor] = {"loss_objective": torch.where(b.m, w * per, zero).sum()}
        if self.kl:
            assert b.ref is not None
            x = torch.where(b.m, b.ref - lp, torch.zeros_like(lp))
            kt = self.kl_term(self.kl_value(x), lp)
            wk = self.kl_weights(b, w, counts)
            out["loss_kl_to_ref"] = self.kl_coef * torch.where(b.m, wk * kt, zero).sum()
        with torch.no_grad():
            n = max(counts.tokens, 1)
            lr = torch.where(b.m, b.slp - lp, torch.zeros_like(lp))
            p = torch.softmax(logits[:, :-1], -1)
            ent = -(p * logp).sum(-1)
            ent = torch.cat([ent.new_zeros(ent.shape[0], 1), ent], 1)
            out["clip_fraction"] = clipped.sum().to(dtype) / n
            out["kl_approx"] = torch.where(b.m, torch.exp(lr) - 1 - lr, zero).sum() / n
            out["entropy"] = torch.where(b.m, ent, zero).sum() / n
        return out


# ------------------------------------------------------------------------------------------
# one-bug variants
# ------------------------------------------------------------------------------------------


class WhitenedAdvantages(HookedLoss):
    """BUG: whitens the advantages inside the loss, (A - mean) / std over the batch's trained
    rows (or tokens), as PPO code does per minibatch (Stable-Baselines3's
    ``normalize_advantage``, OpenRLHF's ``advantages_norm``, TRL's ``whiten`` in its PPO
    trainer) although the advantages it is given are already final: every token's gradient is
    -A'·w with A' the whitened value, and it changes with the micro-batch. Breaks LOSS-003
    ("the gradient ... MUST equal minus the token's advantage ... times the declared
    aggregation's weight")."""

    def adjust(self, b: lo._Batch, td: TensorDictBase) -> None:
        vals = b.adv[b.m]
        if vals.numel() > 1:
            mean, std = vals.mean(), vals.std()
            b.adv = torch.where(b.m, (b.adv - mean) / (std + 1e-8), torch.zeros_like(b.adv))


class K3ExpDetached(HookedLoss):
    """BUG: k3 = exp(x) - 1 - x (x = log pi_ref - log pi) with the exponential taken of a
    detached x (``ratio = torch.exp(kl).detach()`` written to keep a large ratio from blowing
    up the backward, next to verl-style ``low_var_kl``): the value is right, but the gradient
    with respect to log pi is 1 instead of 1 - exp(x): only the -x part is differentiated.
    Plausible; no shipped instance known. Breaks LOSS-020
    (gradient w_t·β·(-k'(δ_t)) under ``pathwise``)."""

    def kl_value(self, x: torch.Tensor) -> torch.Tensor:
        if self.kl_estimator != "k3":
            return super().kl_value(x)
        return torch.exp(x.detach()) - 1 - x


class MaskFromFiniteLogProbs(HookedLoss):
    """BUG: takes the trained-on tokens from where ``sample_log_probs`` is finite (TorchRL
    writes NaN outside the mask, so ``~isnan(log_probs)`` looks like the mask) instead of the
    assistant mask: a batch whose producer writes 0 outside the mask (NeMo-RL's convention)
    trains on its prompt. Plausible (TorchRL's NaN convention invites it). Breaks LOSS-004
    ("Changing ... log-probs ... outside the assistant mask (NaN included) MUST NOT change
    any output")."""

    def adjust(self, b: lo._Batch, td: TensorDictBase) -> None:
        slp = td.get(_K("sample_log_probs")).to(b.slp.dtype)
        m = b.att & torch.isfinite(slp)
        m[:, 0] = False
        adv = td.get(_K("advantage")).to(b.slp.dtype)
        a = adv if adv.dim() == 2 else adv[:, None].expand_as(slp)
        zero = torch.zeros((), dtype=b.slp.dtype)
        b.m = m
        b.slp = torch.where(m, slp, zero)
        b.adv = torch.where(m, a, zero)
        if b.ref is not None:
            b.ref = torch.where(m, td.get(_K("ref_log_probs")).to(b.slp.dtype), zero)
        b.lengths = m.sum(1)


class ResponseWindowFromEnd(HookedLoss):
    """BUG: the response is taken as the last R columns of the batch, R the longest response
    (verl's ``response_mask = attention_mask[:, -response_length:]``, right for its
    left-padded-prompt / right-padded-response tensors), applied to a layout batch that is
    right-padded as a whole: appending padding columns slides the window off the responses.
    Breaks LOSS-005 ("Appending padding columns ... MUST NOT change any output")."""

    def adjust(self, b: lo._Batch, td: TensorDictBase) -> None:
        t = b.m.shape[1]
        r = int(b.m.sum(1).max())
        window = torch.arange(t) >= t - r
        m = b.m & window
        zero = torch.zeros((), dtype=b.slp.dtype)
        b.m = m
        b.slp = torch.where(m, b.slp, zero)
        b.adv = torch.where(m, b.adv, zero)
        if b.ref is not None:
            b.ref = torch.where(m, b.ref, zero)
        b.lengths = m.sum(1)


class KlClamped(HookedLoss):
    """BUG: the per-token KL estimate clamped to [-10, 10], verl's ``kl_penalty``
    ``low_var_kl`` (``torch.clamp(kld, min=-10, max=10)``): where the policy moved far from
    the reference (k3 > 10 at δ > 2.53) the penalty stops growing and its gradient is zero.
    Breaks LOSS-019 (the ratio loss_kl_to_ref(δ) / loss_kl_to_ref(-δ) MUST equal
    Σ w·k(δ_t) / Σ w·k(-δ_t))."""

    def kl_value(self, x: torch.Tensor) -> torch.Tensor:
        return super().kl_value(x).clamp(-10.0, 10.0)


class KlTokenMeanAlways(HookedLoss):
    """BUG: the KL term is always a token mean over the batch's tokens, whatever the declared
    aggregation (verl's ``kl_loss`` was ``masked_mean`` before it followed
    ``loss_agg_mode``): under ``seq_mean_token_mean`` a long answer's tokens weigh more in the
    KL than in the objective. Breaks LOSS-020 (gradient w_t·β·(-k'(δ_t)), w the
    aggregation's weight)."""

    def kl_weights(self, b: lo._Batch, w: torch.Tensor, counts: GlobalCounts) -> torch.Tensor:
        return b.m.to(w.dtype) / max(counts.tokens, 1)


class DualClipBothSigns(HookedLoss):
    """BUG: the dual clip min(·, -A·c) applied to every token instead of only where A < 0:
    for A > 0 it is always the smaller term, so those tokens get a constant loss -A·c and no
    gradient. Plausible (verl and OpenRLHF guard it with ``torch.where(advantages < 0, ...)``;
    dropping the guard is the bug). Breaks LOSS-014 (the objective MUST equal Σ w times the
    declared clipped surrogate, at advantages of both signs), and before it LOSS-003 (at ratio 1
    each token's gradient MUST be -A·w): the suite's batch holds advantages of both signs, and
    the tokens of its A > 0 rows get 0. The kit reports LOSS-003 (LOSS-014 blocked by it), the
    id this variant is filed under. (On a batch whose advantages all shared the sign A > 0,
    nothing carried a gradient, and LOSS-002 caught it first.)"""

    def clipped_surrogate(self, a: torch.Tensor, rho: torch.Tensor) -> torch.Tensor:
        per = -a * rho
        if self.bounds is None:
            return per
        per = torch.maximum(per, -a * rho.clamp(*self.bounds))
        if self.dual_clip is not None:
            per = torch.minimum(per, -a * self.dual_clip)
        return per


class PromotesToFloat64(HookedLoss):
    """BUG: computes in the widest dtype of its float inputs (PyTorch type promotion: a float64
    advantage from numpy makes every term float64) and returns float64 terms, so a float32
    optimizer step gets float64 losses (TRL and verl users have hit "expected scalar type Float
    but found Double" from numpy advantages). Breaks LOSS-009 ("computes in its own precision
    and gives the outputs of the same values in the layout dtype")."""

    def compute_dtype(self, td: TensorDictBase) -> torch.dtype:
        dt = torch.float32
        for name in ("sample_log_probs", "advantage", "ref_log_probs"):
            key = _K(name)
            if key in td.keys(include_nested=True, leaves_only=True):
                v = td.get(key)
                if v.is_floating_point():
                    dt = torch.promote_types(dt, v.dtype)
        return dt


class GspoSumNotMean(HookedLoss):
    """BUG: GSPO's sequence ratio as exp of the *sum* of the row's token log-ratios instead of
    their mean (the length normalization 1/|y| the GSPO paper insists on, forgotten): long
    answers' ratios explode and clip. Plausible. Breaks LOSS-021 (ρ = exp(mean of log r over
    the row's assistant tokens) under ``sequence``)."""

    def log_ratio_for_sequence(self, lr: torch.Tensor, b: lo._Batch) -> torch.Tensor:
        return lr.sum(1)[:, None].expand_as(lr)


# ------------------------------------------------------------------------------------------
# declarations
# ------------------------------------------------------------------------------------------

_EXTRAS: dict[str, Any] = {"clip_epsilon": (0.2, 0.28), "dual_clip": 3.0}


def _decl(
    cls: type[HookedLoss],
    name: str,
    *,
    aggregation: str = "token_mean",
    kl_estimator: str = "k3",
    kl_gradient: str = "pathwise",
    ratio: str = "token",
) -> Implementation:
    options: dict[str, Any] = {
        "aggregation": aggregation,
        "kl_estimator": kl_estimator,
        "kl_gradient": kl_gradient,
        "ratio": ratio,
    }
    return Implementation(
        "loss",
        functools.partial(cls, **options, **_EXTRAS),
        name=f"loss-variants/{name}",
        capabilities={"kl_to_ref", "clip", "global_counts", "diagnostics", "per_token_advantage"},
        options=options,
        extras=dict(_EXTRAS),
        description=(cls.__doc__ or "").split("\n\n")[0],
    )


BASES: dict[str, Implementation] = {
    "hooked_token_mean": _decl(HookedLoss, "hooked-token-mean"),
    "hooked_seq_mean_token_mean": _decl(
        HookedLoss, "hooked-seq-mean-token-mean", aggregation="seq_mean_token_mean"
    ),
    "hooked_sequence_ratio": _decl(HookedLoss, "hooked-sequence-ratio", ratio="sequence"),
}

VARIANTS: dict[str, tuple[str, Implementation]] = {
    "whitened_advantages": ("LOSS-003", _decl(WhitenedAdvantages, "whitened-advantages")),
    "k3_exp_detached": ("LOSS-020", _decl(K3ExpDetached, "k3-exp-detached")),
    "mask_from_finite_log_probs": (
        "LOSS-004", _decl(MaskFromFiniteLogProbs, "mask-from-finite-log-probs")
    ),
    "response_window_from_end": (
        "LOSS-005", _decl(ResponseWindowFromEnd, "response-window-from-end")
    ),
    "kl_clamped": ("LOSS-019", _decl(KlClamped, "kl-clamped")),
    "kl_token_mean_always": (
        "LOSS-020",
        _decl(KlTokenMeanAlways, "kl-token-mean-always", aggregation="seq_mean_token_mean"),
    ),
    "dual_clip_both_signs": ("LOSS-003", _decl(DualClipBothSigns, "dual-clip-both-signs")),
    "promotes_to_float64": ("LOSS-009", _decl(PromotesToFloat64, "promotes-to-float64")),
    "gspo_sum_not_mean": (
        "LOSS-021", _decl(GspoSumNotMean, "gspo-sum-not-mean", ratio="sequence")
    ),
}  # fmt: skip


# ------------------------------------------------------------------------------------------
# demos: the spec's sentence checked by hand, on the base (holds) and the variant (fails)
# ------------------------------------------------------------------------------------------


def _on_policy(policy: Any, n: int = 4, t: int = 12, seed: int = 0) -> TensorDictBase:
    """A batch whose behaviour and reference log-probs are the policy's own (ratio 1)."""
    td = sd._batch(n, t, seed)
    with torch.no_grad():
        own = sd._log_probs64(policy, td).float()
    m = td.get(_K("assistant_mask"))
    td.set(_K("sample_log_probs"), torch.where(m, own, float("nan")))
    td.set(_K("ref_log_probs"), torch.where(m, own, float("nan")))
    return td


def _make(cls: type[HookedLoss], policy: Any, **kw: Any) -> HookedLoss:
    return cls(policy, **{**_EXTRAS, **kw})


def _trained(td: TensorDictBase) -> torch.Tensor:
    m: torch.Tensor = (td.get(_K("assistant_mask")) & td.get(_K("attention_mask"))).clone()
    m[:, 0] = False
    return m


def _lp_with_grad(policy: Any, td: TensorDictBase) -> torch.Tensor:
    """[B, T] log p(token_t) from the logits at t - 1, differentiable; 0 at position 0."""
    tok, att = td.get(_K("tokens")), td.get(_K("attention_mask"))
    logits: torch.Tensor = policy(input_ids=tok, attention_mask=att.long()).logits.double()
    lp = torch.log_softmax(logits[:, :-1], -1).gather(-1, tok[:, 1:, None])[..., 0]
    return torch.cat([lp.new_zeros(lp.shape[0], 1), lp], 1)


def _f(x: torch.Tensor) -> float:
    return float(x.detach())


def _close_grads(a: torch.Tensor, b: torch.Tensor, rel: float = 1e-4) -> bool:
    return float((a - b).abs().max()) <= rel * max(float(b.abs().max()), 1e-12)


def _grad_check(
    cls: type[HookedLoss],
    policy: Any,
    td: TensorDictBase,
    key: str,
    expected: torch.Tensor,
    **kw: Any,
) -> bool:
    """Whether the policy-parameter gradient of ``key`` equals that of ``expected``."""
    got = _make(cls, policy, **kw)(td)[key]
    return _close_grads(sd._param_grads(got, policy), sd._param_grads(expected, policy))


def demo_whitened_advantages() -> bool:
    policy = sd._policy()
    td = _on_policy(policy)
    td.set(_K("advantage"), torch.tensor([0.5, 1.0, 2.0, 4.0]))
    m = _trained(td)
    w = m.double() / m.sum()
    a = td.get(_K("advantage")).double()[:, None]

    # LOSS-003 at ratio 1: d loss / d log p_t = -A·w, i.e. the gradient of Σ w·(-A)·log p
    def expected() -> torch.Tensor:
        e: torch.Tensor = (w * -a * _lp_with_grad(policy, td)).sum()
        return e

    good = _grad_check(HookedLoss, policy, td, "loss_objective", expected())
    bad = _grad_check(WhitenedAdvantages, policy, td, "loss_objective", expected())
    return good and not bad


def _kl_batch(policy: Any, deltas: Callable[[torch.Tensor], torch.Tensor]) -> TensorDictBase:
    td = _on_policy(policy, n=4, t=12, seed=1)
    m = td.get(_K("assistant_mask"))
    own = td.get(_K("sample_log_probs"))
    pos = torch.arange(m.shape[1], dtype=torch.float32).expand_as(own)
    td.set(_K("ref_log_probs"), torch.where(m, own + deltas(pos), float("nan")))
    return td


def _k3(x: torch.Tensor) -> torch.Tensor:
    return torch.exp(x) - 1 - x


def demo_k3_exp_detached() -> bool:
    policy = sd._policy()
    td = _kl_batch(policy, lambda pos: 0.1 + 0.05 * pos)
    m = _trained(td)
    w = m.double() / m.sum()
    ref = torch.where(m, td.get(_K("ref_log_probs")), 0.0).double()

    def expected() -> torch.Tensor:  # pathwise: the estimate differentiated as written
        lp = _lp_with_grad(policy, td)
        return 0.1 * torch.where(m, w * _k3(ref - lp), 0.0).sum()

    good = _grad_check(HookedLoss, policy, td, "loss_kl_to_ref", expected())
    bad = _grad_check(K3ExpDetached, policy, td, "loss_kl_to_ref", expected())
    return good and not bad


def demo_mask_from_finite_log_probs() -> bool:
    policy = sd._policy()
    td = _on_policy(policy)
    td.set(_K("advantage"), torch.tensor([1.0, -1.0, 0.5, 2.0]))
    zeroed = td.clone()
    for name in ("sample_log_probs", "ref_log_probs"):
        v = zeroed.get(_K(name))
        zeroed.set(_K(name), torch.nan_to_num(v, nan=0.0))  # NeMo-RL writes 0 outside

    def changed(cls: type[HookedLoss]) -> bool:
        loss = _make(cls, policy)
        a, b = loss(td), loss(zeroed)
        return any(sd._differs(_f(a[k]), _f(b[k])) for k in a)

    return not changed(HookedLoss) and changed(MaskFromFiniteLogProbs)


def _append_padding(td: TensorDictBase, k: int) -> TensorDictBase:
    out = td.clone()
    b = td.batch_size[0]
    for name, fill in (
        ("tokens", 0),
        ("attention_mask", False),
        ("assistant_mask", False),
        ("sample_log_probs", float("nan")),
        ("ref_log_probs", float("nan")),
    ):
        v = td.get(_K(name))
        pad = torch.full((b, k), fill, dtype=v.dtype)
        out.set(_K(name), torch.cat([v, pad], 1))
    return out.clone()


def demo_response_window_from_end() -> bool:
    policy = sd._policy()
    td = _on_policy(policy, n=4, t=12, seed=2)
    padded = _append_padding(td, 3)

    def changed(cls: type[HookedLoss]) -> bool:
        loss = _make(cls, policy)
        a, b = loss(td), loss(padded)
        return any(sd._differs(_f(a[k]), _f(b[k]), 1e-4) for k in a)

    return not changed(HookedLoss) and changed(ResponseWindowFromEnd)


def demo_kl_clamped() -> bool:
    policy = sd._policy()
    up = _kl_batch(policy, lambda pos: 2.5 + 0.1 * pos)
    down = _kl_batch(policy, lambda pos: -(2.5 + 0.1 * pos))
    m = _trained(up)
    d = torch.where(m, up.get(_K("ref_log_probs")) - down.get(_K("sample_log_probs")), 0.0)
    d = d.double()
    want = float(torch.where(m, _k3(d), 0.0).sum() / torch.where(m, _k3(-d), 0.0).sum())

    def ratio_ok(cls: type[HookedLoss]) -> bool:
        loss = _make(cls, policy)
        got = _f(loss(up)["loss_kl_to_ref"]) / _f(loss(down)["loss_kl_to_ref"])
        return not sd._differs(got, want, 1e-3)

    return ratio_ok(HookedLoss) and not ratio_ok(KlClamped)


def demo_kl_token_mean_always() -> bool:
    policy = sd._policy()
    td = _kl_batch(policy, lambda pos: 0.1 + 0.05 * pos)
    m = _trained(td)
    lengths = m.sum(1, keepdim=True).double()
    s = int((lengths > 0).sum())
    w = m.double() / (s * lengths.clamp(min=1))
    with torch.no_grad():
        lp = _lp_with_grad(policy, td)
    ref = torch.where(m, td.get(_K("ref_log_probs")), 0.0).double()
    want = 0.1 * float(torch.where(m, w * _k3(ref - lp), 0.0).sum())

    def value_ok(cls: type[HookedLoss]) -> bool:
        got = _f(_make(cls, policy, aggregation="seq_mean_token_mean")(td)["loss_kl_to_ref"])
        return not sd._differs(got, want, 1e-4)

    return value_ok(HookedLoss) and not value_ok(KlTokenMeanAlways)


def demo_dual_clip_both_signs() -> bool:
    policy = sd._policy()
    td = _on_policy(policy)
    m = td.get(_K("assistant_mask"))
    own = td.get(_K("sample_log_probs"))
    td.set(_K("sample_log_probs"), torch.where(m, own - 0.5, float("nan")))  # r = e^0.5 > 1.28
    td.set(_K("advantage"), torch.tensor([1.0, 2.0, 0.5, 1.5]))
    tm = _trained(td)
    w = tm.double() / tm.sum()
    a = td.get(_K("advantage")).double()[:, None]
    want = float((w * -a * 1.28).sum())  # A > 0, r > 1 + ε_high: the clipped term

    def value_ok(cls: type[HookedLoss]) -> bool:
        return not sd._differs(_f(_make(cls, policy)(td)["loss_objective"]), want, 1e-4)

    def reaches_policy(cls: type[HookedLoss]) -> bool:  # LOSS-002, at ratio 1, every A > 0
        pos = _on_policy(policy)
        pos.set(_K("advantage"), pos.get(_K("advantage")).abs() + 0.1)
        out = _make(cls, policy)(pos)
        total = sum(v for k, v in out.items() if k.startswith("loss_"))
        assert isinstance(total, torch.Tensor)
        if not total.requires_grad:
            return False
        return float(sd._param_grads(total, policy).abs().max()) > 1e-6

    good = value_ok(HookedLoss) and reaches_policy(HookedLoss)
    return good and not value_ok(DualClipBothSigns) and not reaches_policy(DualClipBothSigns)


def demo_promotes_to_float64() -> bool:
    policy = sd._policy()
    td = _on_policy(policy)
    td.set(_K("advantage"), td.get(_K("advantage")).double())  # numpy-born advantages
    good = _make(HookedLoss, policy)(td)["loss_objective"]
    bad = _make(PromotesToFloat64, policy)(td)["loss_objective"]
    return bool(good.dtype == torch.float32 and bad.dtype != torch.float32)


def demo_gspo_sum_not_mean() -> bool:
    policy = sd._policy()
    td = _on_policy(policy, n=4, t=12, seed=3)
    m = td.get(_K("assistant_mask"))
    own = td.get(_K("sample_log_probs"))
    pos = torch.arange(m.shape[1], dtype=torch.float32).expand_as(own)
    off = 0.01 + 0.004 * pos  # small per-token offsets: every row's ρ inside the clip bounds
    td.set(_K("sample_log_probs"), torch.where(m, own - off, float("nan")))
    td.set(_K("advantage"), torch.tensor([1.0, -1.0, 0.5, -2.0]))
    tm = _trained(td)
    lr = torch.where(tm, off, 0.0).double()
    rho = torch.exp(lr.sum(1) / tm.sum(1).clamp(min=1))
    w = tm.double() / tm.sum()
    a = td.get(_K("advantage")).double()
    assert bool(((rho > 0.8) & (rho < 1.28)).all())
    want = float((w.sum(1) * -a * rho).sum())

    def value_ok(cls: type[HookedLoss]) -> bool:
        got = _f(_make(cls, policy, ratio="sequence")(td)["loss_objective"])
        return not sd._differs(got, want, 1e-4)

    return value_ok(HookedLoss) and not value_ok(GspoSumNotMean)


DEMOS: dict[str, Callable[[], bool]] = {name: globals()[f"demo_{name}"] for name in VARIANTS}
