"""The reference policy-gradient loss: PPO/GRPO-style clipped objective on the LLM layout."""

from __future__ import annotations

import math
import numbers
from typing import Any

import torch
from tensordict import TensorDict, TensorDictBase

from posttrain._kl import KL_ESTIMATORS, kl_estimate
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

    Options beyond PPO/GRPO (each NeMo-RL ``ClippedPGLossConfig`` key maps to one, see
    :func:`posttrain.adapters.nemo_rl.loss.clipped_pg_options`): ``ratio`` (:data:`RATIOS`:
    per token, GSPO's per sequence, forced on-policy, none = REINFORCE, GSPO's token form,
    CISPO), ``dual_clip`` c > 1,
    ``cispo``, ``kl_estimator`` (:data:`KL_ESTIMATORS`), ``kl_input_clamp`` / ``kl_output_clamp``,
    ``kl_gradient`` (:data:`KL_GRADIENTS`: NeMo-RL differentiates the KL times
    exp(log p - sg(log p)), ``"score"``), ``importance_correction`` /
    ``importance_bounds`` (:data:`IMPORTANCE_CORRECTIONS`: weights pi_sample / pi_generation
    with the sampler's log-probs at ``generation_key``), ``positive_nll_coef`` (VAPO's
    ``loss_positive_nll`` on rows rewarded > 0) and ``nemo_metrics`` (NeMo-RL's metric set:
    ``token_mult_prob_error``, ``kl_penalty``, ``probs_ratio``, ...).

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
        >>> out = PolicyGradientLoss(policy, kl_coef=1.0, kl_estimator="k2", nemo_metrics=True)(td)
        >>> float(out["kl_penalty"]) == float(out["loss_kl_to_ref"])
        True
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
        ratio: str = "token",
        dual_clip: float | None = None,
        cispo: bool = False,
        kl_estimator: str = "k3",
        kl_input_clamp: float | None = None,
        kl_output_clamp: float | None = None,
        kl_gradient: str = "pathwise",
        importance_correction: str | None = None,
        importance_bounds: tuple[float | None, float] | None = None,
        generation_key: Any = None,
        positive_nll_coef: float = 0.0,
        nemo_metrics: bool = False,
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
        _choice("ratio", ratio, RATIOS)
        _choice("kl_estimator", kl_estimator, KL_ESTIMATORS)
        _choice("kl_gradient", kl_gradient, KL_GRADIENTS)
        _choice("importance_correction", importance_correction, IMPORTANCE_CORRECTIONS)
        if dual_clip is not None and (not _real(dual_clip) or not dual_clip > 1):
            raise ValueError(f"dual_clip: expected None or a number > 1, found {dual_clip!r}")
        for name, v in (("kl_input_clamp", kl_input_clamp), ("kl_output_clamp", kl_output_clamp)):
            if v is not None and (not _real(v) or not v >= 0):
                raise ValueError(f"{name}: expected None or a number >= 0, found {v!r}")
        if not _real(positive_nll_coef) or not positive_nll_coef >= 0:
            raise ValueError(
                f"positive_nll_coef: expected a number >= 0, found {positive_nll_coef!r}"
            )
        if (cispo and ratio not in ("token", "cispo")) or (
            (cispo or ratio == "cispo") and dual_clip is not None
        ):
            raise ValueError(
                f"cispo: needs ratio='token' (or 'cispo') and no dual_clip (NeMo-RL's rule), "
                f"found ratio={ratio!r}, dual_clip={dual_clip!r}"
            )
        bounds = _bounds(importance_correction, importance_bounds)
        self.policy = policy
        self.aggregation = aggregation
        self.clip = (float(low), float(high))
        self.kl_coef = float(kl_coef)
        self.entropy_coef = float(entropy_coef)
        self.t_norm = t_norm
        self.ratio = ratio
        self.dual_clip = None if dual_clip is None else float(dual_clip)
        self.cispo = bool(cispo) or ratio == "cispo"  # ratio 'cispo' (loss 1.5) is cispo=True
        self.kl_estimator = kl_estimator
        self.kl_clamp = (kl_input_clamp, kl_output_clamp)
        self.kl_gradient = kl_gradient
        self.importance_correction = importance_correction
        self.importance_bounds = bounds
        self.generation_key = generation_key
        self.positive_nll_coef = float(positive_nll_coef)
        self.nemo_metrics = bool(nemo_metrics)
        self.layout = layout
        need = ["sample_log_probs", "advantage"] + (["ref_log_probs"] if kl_coef > 0 else [])
        if positive_nll_coef > 0:
            need.append("reward")
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

    def _clamped(self, ratio: torch.Tensor) -> torch.Tensor:
        """The ratio clipped to [1 - ε_low, 1 + ε_high]; unclipped where there is no PPO ratio
        (``ratio="none"``: the log-prob itself; ``"on_policy"``: exactly 1)."""
        if self.ratio in ("none", "on_policy"):
            return ratio
        low, high = self.clip
        return ratio.clamp(1 - low, 1 + high)

    def _surrogate(
        self, adv: torch.Tensor, ratio: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Per-token PPO loss max(-A r, -A clip(r)) (and its min with -A c where A < 0 under
        dual clip c) and where a clipped term is the active one."""
        pg1, pg2 = -adv * ratio, -adv * self._clamped(ratio)
        clipped = pg2 > pg1
        loss = torch.where(clipped, pg2, pg1)
        if self.dual_clip is not None:
            pg3 = -adv * self.dual_clip
            dual = (adv < 0) & (pg3 < loss)
            loss, clipped = torch.where(dual, pg3, loss), clipped | dual
        return loss, clipped

    def _cispo(
        self, adv: torch.Tensor, ratio: torch.Tensor, logp: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """CISPO's per-token loss -A·sg(clip(r))·log p (MiniMax-M1; verl's
        ``compute_policy_loss_cispo``) and where the weight is clipped: a clipped weight bounds
        the token's gradient, it does not zero it."""
        ratio_c = self._clamped(ratio)
        return -adv * ratio_c.detach() * logp, ratio_c != ratio

    def _ratios(self, logp: torch.Tensor, prox: torch.Tensor, fm: torch.Tensor) -> torch.Tensor:
        """The per-token ratio the surrogate clips (1 off the mask)."""
        mask = fm > 0
        if self.ratio == "none":  # REINFORCE: the surrogate is -A log p
            return logp
        if self.ratio in ("sequence", "gspo_token"):  # GSPO: the row's geometric mean
            mean = ((logp - prox) * fm).sum(-1, keepdim=True) / fm.sum(-1, keepdim=True).clamp_min(
                1
            )
            if self.ratio == "gspo_token":  # sg(ρ)·exp(logp_t - sg(logp_t)), verl's gspo
                return torch.where(mask, (mean.detach() + logp - logp.detach()).exp(), 1.0)
            return torch.where(mask, mean.exp().expand_as(logp), 1.0)
        return torch.where(mask, (logp - prox).exp(), 1.0)  # "on_policy": prox is logp.detach()

    def _importance(
        self, prox: torch.Tensor, old: torch.Tensor, fm: torch.Tensor, counts: GlobalCounts
    ) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
        """Off-policy weights pi_prox / pi_behaviour (per token, or per sequence under
        ``ratio="sequence"``), truncated as declared, and their metrics."""
        prox, old = prox.detach(), old.detach()
        mask = fm > 0
        n_tok, n_seq = max(counts.tokens, 1), max(counts.sequences, 1)
        if self.ratio in ("sequence", "gspo_token"):
            w = ((prox - old) * fm).sum(-1, keepdim=True).exp()
        else:
            w = torch.where(mask, (prox - old).exp(), 1.0)
        metrics: dict[str, torch.Tensor] = {}
        kind, bounds = self.importance_correction, self.importance_bounds
        if kind in ("tis", "icepop"):
            assert bounds is not None
            lo, hi = bounds
            out = (w > hi) | (w < lo)
            metrics["is_oob_ratio"] = (out.to(fm.dtype) * fm).sum() / n_tok
            w = w.clamp(lo, hi) if kind == "tis" else torch.where(out, 0.0, w)
        elif kind == "seq_mask_tis":
            assert bounds is not None
            lo, hi = bounds
            geo = (((prox - old) * fm).sum(-1) / fm.sum(-1).clamp_min(1)).exp()
            kept = ((geo >= lo) & (geo <= hi)).to(fm.dtype)
            rows = mask.any(-1).to(fm.dtype)
            metrics["is_oob_ratio"] = ((1 - kept) * rows).sum() / n_seq
            w = w * kept[:, None]
        if self.ratio in ("sequence", "gspo_token"):
            # NeMo-RL's reduction: a [B, 1] weight times a [B] sample mask broadcasts to
            # [B, B], i.e. the sum of every row's weight times the valid rows, over the global
            # sequence count.
            valid_rows = float(mask.any(-1).sum())
            metrics["sampling_importance_ratio"] = w.sum() * valid_rows / n_seq
        else:
            metrics["sampling_importance_ratio"] = (w * fm).sum() / n_tok
        return w.expand_as(fm), metrics

    def _kl(self, logp: torch.Tensor, ref: torch.Tensor, old: torch.Tensor) -> torch.Tensor:
        """Per-token KL estimate to the reference: k1, k2 or k3 of log(pi_ref / pi), clamped on
        the way in and out as declared, and weighted as ``kl_gradient`` says (the weight's
        gradient is the score-function term; detached where the input clamp is active)."""
        logr = ref - logp
        weight = None
        if self.kl_gradient == "score":
            weight = (logp - logp.detach()).exp()
        elif self.kl_gradient == "behaviour":
            weight = (logp - old.detach()).exp()
        lo_in, lo_out = self.kl_clamp
        if lo_in is not None:
            clamped = logr.clamp(-lo_in, lo_in)
            if weight is not None:
                weight = torch.where(logr == clamped, weight, weight.detach())
            logr = clamped
        kl = kl_estimate(logr, self.kl_estimator)
        if weight is not None:
            kl = weight * kl
        if lo_out is not None:
            kl = kl.clamp(-lo_out, lo_out)
        return kl

    def _nemo_metrics(
        self,
        logp: torch.Tensor,
        prox: torch.Tensor,
        old: torch.Tensor,
        ratio: torch.Tensor,
        mask: torch.Tensor,
        tm: torch.Tensor,
        out: dict[str, torch.Tensor],
    ) -> dict[str, torch.Tensor]:
        """NeMo-RL's ClippedPGLossFn metrics, each a token sum over the global token count
        (extrema excepted: this batch's)."""
        logp, prox, old, ratio = logp.detach(), prox.detach(), old.detach(), ratio.detach()
        ratio_c = self._clamped(ratio)
        fm = mask.to(logp.dtype)
        est = self.kl_estimator
        mix = torch.log(0.5 * prox.exp() + 0.5 * old.exp())
        # NeMo-RL's Jensen-Shannon term is k3-shaped whatever the KL type.
        js = 0.5 * kl_estimate(prox - mix) + 0.5 * kl_estimate(old - mix)
        inf = torch.tensor(float("inf"), dtype=logp.dtype)
        pick, pick_c = ratio[mask], ratio_c[mask]
        res = {
            "probs_ratio": (ratio * tm).sum(),
            "probs_ratio_clamped": (ratio_c * tm).sum(),
            "probs_ratio_min": pick.min() if pick.numel() else inf,
            "probs_ratio_max": pick.max() if pick.numel() else -inf,
            "probs_ratio_clamped_min": pick_c.min() if pick.numel() else inf,
            "probs_ratio_clamped_max": pick_c.max() if pick.numel() else -inf,
            "token_mult_prob_error": ((old - prox).abs() * fm).exp().mul(tm).sum(),
            "gen_kl_error": (kl_estimate(prox - old, est) * tm).sum(),
            "policy_kl_error": (kl_estimate(old - prox, est) * tm).sum(),
            "js_divergence_error": (js * tm).sum(),
            "approx_entropy": -((logp - old).exp() * logp * tm).sum(),
        }
        kl_term = out.get("loss_kl_to_ref")
        res["kl_penalty"] = (
            kl_term / self.kl_coef if kl_term is not None else torch.zeros((), dtype=logp.dtype)
        )
        return res

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
        self.layout.validate_batch(
            td, require=self._require, any_float=True, context=type(self).__name__
        )
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

        gen = old  # the sampler's log-probs: the proximal ones unless declared apart
        if self.generation_key is not None:
            if self.generation_key not in td.keys(include_nested=True):
                raise KeyError(
                    f"{self.generation_key!r}: generation_key is set but the batch has no such "
                    "entry"
                )
            raw = td.get(self.generation_key)
            if raw.shape != logp.shape or not raw.is_floating_point():
                raise ValueError(
                    f"{self.generation_key!r}: expected float log-probs of shape "
                    f"{list(logp.shape)}, found {raw.dtype} {list(raw.shape)}"
                )
            gen = torch.where(mask, raw.to(logp.dtype), 0.0)
        prev = logp.detach() if self.ratio == "on_policy" else old

        own = GlobalCounts(int(mask.sum()), int(mask.any(-1).sum()))
        if counts is None:
            counts = own
        elif own.tokens > counts.tokens or own.sequences > counts.sequences:
            raise ValueError(
                f"counts: this batch alone holds {own.tokens} assistant tokens in "
                f"{own.sequences} sequences, more than the global {counts}"
            )
        fm = mask.to(logp.dtype)
        n_tok = max(counts.tokens, 1)
        ratio = self._ratios(logp, prev, fm)
        if self.cispo:
            per_token, active = self._cispo(adv, ratio, logp)
        else:
            per_token, active = self._surrogate(adv, ratio)
        is_w, is_metrics = self._importance(prev, gen, fm, counts)
        if self.importance_correction is not None:
            per_token = is_w * per_token
        w = self._weights(mask, counts).to(logp.dtype)
        out: dict[str, torch.Tensor] = {"loss_objective": (per_token * w).sum()}

        # Diagnostics: sums over the assistant tokens / the global token count, so that the
        # micro-batches' values add up to the whole batch's token mean.
        tm = fm / n_tok
        if self.kl_coef > 0:
            ref = torch.where(mask, td.get(k("ref_log_probs")).to(logp.dtype), 0.0)
            kl = torch.where(mask, self._kl(logp, ref, gen), 0.0)
            out["loss_kl_to_ref"] = self.kl_coef * (kl * w).sum()
            out["kl_to_ref"] = (kl * tm).sum().detach()
        if self.positive_nll_coef > 0:
            # NeMo-RL's VAPO term: -log p over the tokens of rows rewarded > 0, a mean over
            # this batch's own such tokens (NeMo-RL normalizes it locally, not globally).
            good = fm * (td.get(k("reward")).to(logp.dtype) > 0)[:, None]
            nll = (-logp * good).sum() / good.sum() if good.sum() > 0 else logp.sum() * 0.0
            out["loss_positive_nll"] = self.positive_nll_coef * nll
        ent = _entropy(logits)
        if self.entropy_coef > 0:
            out["loss_entropy"] = -self.entropy_coef * (torch.where(mask, ent, 0.0) * w).sum()
        with torch.no_grad():
            out["clip_fraction"] = ((active & mask).to(tm.dtype) * tm).sum()
            d_old = old - logp
            out["kl_approx"] = (torch.where(mask, kl_estimate(d_old), 0.0) * tm).sum()
            out["entropy"] = (torch.where(mask, ent, 0.0) * tm).sum()
            if self.nemo_metrics:
                out.update(is_metrics)
                out.update(self._nemo_metrics(logp, prev, gen, ratio, mask, tm, out))
                out["positive_nll_loss"] = (
                    out["loss_positive_nll"] / self.positive_nll_coef
                    if self.positive_nll_coef > 0
                    else torch.zeros((), dtype=logp.dtype)
                )
        return TensorDict(out, batch_size=[])


def _real(x: object) -> bool:
    return isinstance(x, numbers.Real) and not isinstance(x, bool)  # numpy floats too


RATIOS = ("token", "sequence", "on_policy", "none", "gspo_token", "cispo")
"""``ratio`` values: the PPO ratio per token, GSPO's per-sequence geometric mean, exactly 1
with the policy's gradient (NeMo-RL ``force_on_policy_ratio``), none (REINFORCE: -A log p,
NeMo-RL ``disable_ppo_ratio``), GSPO's token form sg(ρ_seq)·exp(logp_t - sg(logp_t)) (verl's
``gspo``), CISPO's -A·sg(clip(r))·log p (the same as ``cispo=True``).

Example:
    >>> RATIOS[0]
    'token'
"""
KL_GRADIENTS = ("pathwise", "score", "behaviour")
"""How the KL estimate is differentiated: as written (``pathwise``), times
exp(log pi - sg(log pi)) (``score``: value 1, adds the score-function term, NeMo-RL's form),
or times exp(log pi - log pi_behaviour) (``behaviour``: NeMo-RL's on-policy KL approximation).

Example:
    >>> "score" in KL_GRADIENTS
    True
"""
IMPORTANCE_CORRECTIONS = (None, "plain", "tis", "icepop", "seq_mask_tis")
"""Off-policy correction by pi_prox / pi_behaviour: none, plain, clamped to
``importance_bounds`` (tis), zeroed outside them per token (icepop) or per sequence by the
geometric mean (seq_mask_tis).

Example:
    >>> IMPORTANCE_CORRECTIONS[2]
    'tis'
"""


def _choice(name: str, value: object, allowed: tuple[Any, ...]) -> None:
    if value not in allowed:
        raise ValueError(f"{name}: expected one of {list(allowed)}, found {value!r}")


def _bounds(
    kind: str | None, bounds: tuple[float | None, float] | None
) -> tuple[float, float] | None:
    """Validated (low, high) truncation bounds; ``tis`` defaults its low bound to 0."""
    if kind in (None, "plain"):
        if bounds is not None:
            raise ValueError(
                f"importance_bounds: only with a truncating importance_correction, found {bounds!r}"
            )
        return None
    ok = isinstance(bounds, tuple | list) and len(bounds) == 2
    lo: Any = bounds[0] if ok and bounds is not None else None
    hi: Any = bounds[1] if ok and bounds is not None else None
    if lo is None and kind == "tis":
        lo = 0.0
    if not ok or not _real(lo) or not _real(hi) or not 0 <= lo <= hi or not hi > 0:
        raise ValueError(
            f"importance_bounds: {kind} needs (low, high) with 0 <= low <= high and high > 0, "
            f"found {bounds!r}"
        )
    return float(lo), float(hi)
