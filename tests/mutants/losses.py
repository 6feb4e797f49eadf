"""Deliberately broken losses: each must fail the suite with its requirement's id.

Each mutant is the reference ``PolicyGradientLoss`` (or, for a declared option it lacks, the
configurable ``PolicyLoss``) with one realistic bug, several of them TorchRL 0.14
``GRPOLoss``'s own (shape [1] terms, swallowed keyword arguments, silent fallback for unknown
aggregations, diagnostics diluted by prompt and padding positions).
"""

from __future__ import annotations

from dataclasses import replace
from functools import partial
from typing import Any

import torch
from tensordict import TensorDict, TensorDictBase

from posttrain.contracts import LLM_LAYOUT_V1, GlobalCounts, Implementation
from posttrain.contracts.loss import AGGREGATIONS
from posttrain.policy_loss import PolicyLoss
from posttrain.reference_impls import PolicyGradientLoss

__all__ = ["DUAL_CLIP", "EXTRA_MUTANTS", "MUTANTS"]

K = LLM_LAYOUT_V1.key
ASST, ATT, SLP, RLP, ADV = (
    K("assistant_mask"),
    K("attention_mask"),
    K("sample_log_probs"),
    K("ref_log_probs"),
    K("advantage"),
)


class _Edit(PolicyGradientLoss):
    """The reference with a hook before (on the batch) and after (on the outputs)."""

    def pre(self, td: TensorDictBase) -> TensorDictBase:
        return td

    def post(self, out: TensorDict, td: TensorDictBase) -> TensorDict:
        return out

    def forward(self, td: TensorDictBase, *, counts: GlobalCounts | None = None) -> TensorDict:
        return self.post(super().forward(self.pre(td), counts=counts), td)


class ShapeOneObjective(_Edit):  # GRPOLoss's prompt_mean bug
    def post(self, out: TensorDict, td: TensorDictBase) -> TensorDict:
        return TensorDict(
            {k: (v.reshape(1) if k == "loss_objective" else v) for k, v in out.items()}
        )


class Detached(_Edit):
    def post(self, out: TensorDict, td: TensorDictBase) -> TensorDict:
        return out.detach()


class TokenMeanWhateverDeclared(PolicyGradientLoss):
    def _weights(self, mask: torch.Tensor, counts: GlobalCounts) -> torch.Tensor:
        m = mask.float()
        return m / m.sum()


class TrainsOnPrompt(_Edit):
    """Zero-fills NaN log-probs and trains on every attended token, prompt included."""

    def pre(self, td: TensorDictBase) -> TensorDictBase:
        td = td.clone()
        td.set(SLP, td.get(SLP).nan_to_num(0.0))
        td.set(RLP, td.get(RLP).nan_to_num(0.0))
        td.set(ASST, td.get(ATT).clone())
        return td


class DividesByAllPositions(PolicyGradientLoss):
    def _weights(self, mask: torch.Tensor, counts: GlobalCounts) -> torch.Tensor:
        return mask.float() / mask.numel()


class NormalisesConsecutivePairs(_Edit):
    """Treats consecutive rows as a group (implicit grouping): order now matters."""

    def pre(self, td: TensorDictBase) -> TensorDictBase:
        td = td.clone()
        adv = td.get(ADV)
        pairs = adv.reshape(-1, 2, *adv.shape[1:]) if adv.shape[0] % 2 == 0 else adv[None]
        td.set(ADV, (pairs - pairs.mean(1, keepdim=True) + 0.3 * pairs[:, :1]).reshape(adv.shape))
        return td


class MutatesInput(_Edit):
    def pre(self, td: TensorDictBase) -> TensorDictBase:
        td.set_(SLP, td.get(SLP).nan_to_num(0.0))
        return td


class SwallowsOptions(PolicyGradientLoss):  # GRPOLoss: **kwargs and a silent fallback
    def __init__(self, policy: Any, *, aggregation: str = "token_mean", **kwargs: Any) -> None:
        super().__init__(
            policy,
            aggregation=aggregation if aggregation in AGGREGATIONS else "token_mean",
            kl_coef=0.05,
            entropy_coef=0.01,
        )


class FillsMissingFields(_Edit):
    def pre(self, td: TensorDictBase) -> TensorDictBase:
        td = td.clone()
        if ADV not in td.keys(True, True):
            td.set(ADV, torch.zeros(td.batch_size))
        td.set(SLP, td.get(SLP).float())
        return td


class KlOverAttention(_Edit):
    def post(self, out: TensorDict, td: TensorDictBase) -> TensorDict:
        att = td.get(ATT).float()
        ref = td.get(RLP).nan_to_num(0.0)
        own = td.get(SLP).nan_to_num(0.0)
        d = (ref - own) * att
        out.set(
            "loss_kl_to_ref",
            out.get("loss_kl_to_ref") + self.kl_coef * (d.exp() - d - 1).sum() / att.sum(),
        )
        return out


class KlOverPositions(
    _Edit
):  # TorchRL GRPOLoss._kl_to_ref: masked k3, then .mean() over all positions
    def post(self, out: TensorDict, td: TensorDictBase) -> TensorDict:
        mask = td.get(ASST)
        d = torch.where(mask, td.get(RLP) - td.get(SLP), 0.0)
        out.set("loss_kl_to_ref", self.kl_coef * (d.expm1() - d).mean())
        return out


class SumsTokenAdvantages(_Edit):
    """Sums a [B, T] advantage over T into a [B] one: every token of a row gets the row's
    total. Killed by LOSS-003 since loss 1.2 (a [B, T] advantage, different at each position)."""

    def pre(self, td: TensorDictBase) -> TensorDictBase:
        adv = td.get(ADV)
        if adv.ndim == 2:
            td = td.clone()
            td.set(ADV, adv.nan_to_num(0.0).sum(-1), inplace=False)
        return td


class TokenAdvantagesDropKl(_Edit):
    """Given a [B, T] advantage, returns no ``loss_kl_to_ref``: the per-token path leaves the KL
    penalty to the advantages (as KL-in-reward pipelines do), so the same batch trains without
    its KL term. ``loss_objective`` and its gradient are right."""

    def post(self, out: TensorDict, td: TensorDictBase) -> TensorDict:
        if td.get(ADV).ndim == 2:
            out = out.exclude("loss_kl_to_ref")
        return out


class DilutedDiagnostics(_Edit):  # TorchRL: averaged over every attended position
    def post(self, out: TensorDict, td: TensorDictBase) -> TensorDict:
        share = td.get(ASST).float().sum() / td.get(ATT).float().sum()
        for k in ("clip_fraction", "kl_approx", "entropy"):
            out.set(k, out.get(k) * share)
        return out


class NoClip(PolicyGradientLoss):
    """The plain importance-weighted objective: the declared clip bounds are never applied."""

    def _surrogate(
        self, adv: torch.Tensor, ratio: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        return -adv * ratio, torch.zeros_like(ratio, dtype=torch.bool)


class MaxInsteadOfMin(PolicyGradientLoss):
    """Takes the max of the clipped and unclipped objectives (the min of the losses)."""

    def _surrogate(
        self, adv: torch.Tensor, ratio: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        low, high = self.clip
        pg1, pg2 = -adv * ratio, -adv * ratio.clamp(1 - low, 1 + high)
        return torch.minimum(pg1, pg2), pg2 < pg1


class SymmetricClip(PolicyGradientLoss):
    """Clips with ε_low on both sides although (ε_low, ε_high) is declared: no clip-higher."""

    def _surrogate(
        self, adv: torch.Tensor, ratio: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        low = self.clip[0]
        pg1, pg2 = -adv * ratio, -adv * ratio.clamp(1 - low, 1 + low)
        return torch.where(pg2 > pg1, pg2, pg1), pg2 > pg1


class DualClipLoss(PolicyGradientLoss):
    """A correct dual-clip PPO loss (Ye et al. 2020; NeMo-RL's ``ratio_clip_c``): where the
    advantage is negative the per-token loss is also capped at -A·c. Not a mutant: the suite
    must pass it, and :class:`IgnoresDualClip` is its broken twin."""

    def __init__(self, policy: Any, *, dual_clip: float = 3.0, **kwargs: Any) -> None:
        super().__init__(policy, **kwargs)
        self.cap = float(dual_clip)  # not the reference's own dual_clip: IgnoresDualClip drops it

    def _surrogate(
        self, adv: torch.Tensor, ratio: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        per_token, clipped = super()._surrogate(adv, ratio)
        cap = -adv * self.cap
        capped = (adv < 0) & (cap < per_token)
        return torch.where(capped, cap, per_token), clipped | capped


class IgnoresDualClip(DualClipLoss):
    """Declares dual clip c but applies the ordinary clip only."""

    def _surrogate(
        self, adv: torch.Tensor, ratio: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        return PolicyGradientLoss._surrogate(self, adv, ratio)


class MasksAsWeights(_Edit):
    """Takes a float or integer mask as weights (its non-zero entries as True) instead of
    refusing it: a NeMo-RL-style token_mask passes silently."""

    def pre(self, td: TensorDictBase) -> TensorDictBase:
        td = td.clone()
        for key in (ASST, ATT):
            m = td.get(key)
            if m.dtype != torch.bool:
                td.set(key, m != 0)
        return td


class RatioInDataDtype(PolicyGradientLoss):
    """Accepts bf16/fp16 behaviour log-probs but computes the surrogate in the batch's precision
    instead of its own: the ratio is rounded to that dtype (off by up to 0.4% in bf16)."""

    _data_dtype = torch.float32

    def forward(self, td: TensorDictBase, *, counts: GlobalCounts | None = None) -> TensorDict:
        slp = td.get(SLP, None)
        self._data_dtype = slp.dtype if slp is not None else torch.float32
        return super().forward(td, counts=counts)

    def _surrogate(
        self, adv: torch.Tensor, ratio: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        if self._data_dtype in (torch.bfloat16, torch.float16):
            ratio = ratio.to(self._data_dtype).to(ratio.dtype)
        return super()._surrogate(adv, ratio)


class BroadcastsAdvantage(_Edit):
    """Lets any advantage that broadcasts through: [B, 1] is expanded along T, a per-token
    advantage shorter than T is taken as covering the last positions (left-padded)."""

    def pre(self, td: TensorDictBase) -> TensorDictBase:
        t = td.get(K("tokens")).shape[-1]
        adv = td.get(ADV, None)
        if adv is None or adv.ndim != 2 or adv.shape[-1] == t:
            return td
        td = td.clone()
        if adv.shape[-1] == 1:
            adv = adv.expand(-1, t)
        elif adv.shape[-1] < t:
            adv = torch.nn.functional.pad(adv, (t - adv.shape[-1], 0))
        td.set(ADV, adv.contiguous(), inplace=False)
        return td


class AlignsLogProbs(_Edit):
    """Takes log-probs of another length as right-aligned with the tokens: a [B, T - 1]
    next-token tensor is left-padded, a longer one cut to its last T (all silently off by one)."""

    def pre(self, td: TensorDictBase) -> TensorDictBase:
        t = td.get(K("tokens")).shape[-1]
        td = td.clone()
        for key in (SLP, RLP):
            v = td.get(key, None)
            if v is None or v.ndim != 2 or v.shape[-1] == t:
                continue
            if v.shape[-1] < t:
                v = torch.nn.functional.pad(v, (t - v.shape[-1], 0), value=float("nan"))
            else:
                v = v[:, -t:]
            td.set(key, v.contiguous(), inplace=False)
        return td


class ShiftedTokenAdvantage(_Edit):
    """Reads a [B, T] advantage one position late (token t gets the value stored at t-1), as
    when token-level advantages are laid out like logits; a [B] advantage is unaffected."""

    def pre(self, td: TensorDictBase) -> TensorDictBase:
        adv = td.get(ADV, None)
        if not isinstance(adv, torch.Tensor) or adv.ndim != 2:
            return td
        td = td.clone()
        td.set(ADV, torch.roll(adv, shifts=1, dims=1), inplace=False)
        return td


class ShiftedEntropy(_Edit):
    """Reports as entropy of token t that of the distribution at t (which predicts t+1), not
    at t-1: the shift the log-probs get right is lost in the diagnostic."""

    def post(self, out: TensorDict, td: TensorDictBase) -> TensorDict:
        with torch.no_grad():
            attn = td.get(ATT)
            logits = self.policy(input_ids=td.get(K("tokens")), attention_mask=attn.long()).logits
            lp = torch.log_softmax(logits.float(), -1)
            h = -(lp.exp() * lp).sum(-1)  # h[:, t]: the distribution at t, one position late
            mask = td.get(ASST) & attn
            mask[:, 0] = False
            out.set("entropy", torch.where(mask, h, 0.0).sum() / mask.sum().clamp_min(1))
        return out


class _PerRowPolicy:
    """Runs ``policy`` once per row on its tokens up to its last attended one and stacks the
    logits back into [B, T, V], padded with zeros after each row (or, ``pad_left``, before)."""

    def __init__(self, policy: Any, pad_left: bool) -> None:
        self.policy = policy
        self.pad_left = pad_left

    def __call__(self, *, input_ids: torch.Tensor, attention_mask: torch.Tensor) -> Any:
        rows = []
        for i in range(input_ids.shape[0]):
            end = int(attention_mask[i].nonzero().max()) + 1
            logits = self.policy(
                input_ids=input_ids[i : i + 1, :end], attention_mask=attention_mask[i : i + 1, :end]
            ).logits[0]
            pad = input_ids.shape[1] - end
            rows.append(
                torch.nn.functional.pad(logits, (0, 0, pad, 0) if self.pad_left else (0, 0, 0, pad))
            )
        return _Logits(torch.stack(rows))


class _Logits:
    def __init__(self, logits: torch.Tensor) -> None:
        self.logits = logits


class PerRowForward(PolicyGradientLoss):
    """The reference calling the policy once per sequence, trimmed to its length. Correct
    (``tests/conformance/test_loss_suite.py`` runs it); :class:`PerRowForwardPadsLeft` is its broken twin."""

    pad_left = False

    def __init__(self, policy: Any, **kwargs: Any) -> None:
        super().__init__(_PerRowPolicy(policy, self.pad_left), **kwargs)


class PerRowForwardPadsLeft(PerRowForward):
    """Per-sequence forward whose logits are stacked back left-padded (a ``pad_sequence`` with
    ``padding_side="left"``) into a right-padded batch: every shorter row's tokens are scored
    by the logits of earlier positions."""

    pad_left = True


class _Counted(PolicyGradientLoss):
    """The reference with the counts it is given rewritten by :meth:`recount` first."""

    def recount(self, td: TensorDictBase, counts: GlobalCounts | None) -> GlobalCounts | None:
        return counts

    def forward(self, td: TensorDictBase, *, counts: GlobalCounts | None = None) -> TensorDict:
        return super().forward(td, counts=self.recount(td, counts))


class IgnoresCounts(_Counted):
    """Takes ``counts`` and drops it: every micro-batch is normalized as a whole batch."""

    def recount(self, td: TensorDictBase, counts: GlobalCounts | None) -> GlobalCounts | None:
        return None


class LocalTokenMean(_Counted):
    """Token mean over the micro-batch's own tokens under accumulation (the sequence count is
    the global one): what a loss computing ``mask.sum()`` locally does."""

    def recount(self, td: TensorDictBase, counts: GlobalCounts | None) -> GlobalCounts | None:
        return (
            None if counts is None else GlobalCounts(GlobalCounts.of(td).tokens, counts.sequences)
        )


class LocalSequenceMean(_Counted):
    """Sequence mean over the micro-batch's own sequences (the token count is the global one)."""

    def recount(self, td: TensorDictBase, counts: GlobalCounts | None) -> GlobalCounts | None:
        return (
            None if counts is None else GlobalCounts(counts.tokens, GlobalCounts.of(td).sequences)
        )


class PaddedWidthCounts(_Counted):
    """Token count taken from the padded width: sequences x the batch's width T (dr_grpo's
    ``max_completion_length`` read off the micro-batch)."""

    def recount(self, td: TensorDictBase, counts: GlobalCounts | None) -> GlobalCounts | None:
        c = counts or GlobalCounts.of(td)
        return GlobalCounts(c.sequences * td.get(K("tokens")).shape[1], c.sequences)


class CountsEveryRow(_Counted):
    """Counts every row as a sequence, one without assistant tokens included (TRL grpo's
    ``.mean()`` over rows)."""

    def recount(self, td: TensorDictBase, counts: GlobalCounts | None) -> GlobalCounts | None:
        return counts or GlobalCounts(GlobalCounts.of(td).tokens, td.batch_size[0])


class RankLocalCounts(_Counted):
    """Under torch.distributed, normalizes by its micro-batch's own counts, whatever
    ``counts`` says (a DDP loop that averages per-rank token means); in one process it is the
    reference."""

    def recount(self, td: TensorDictBase, counts: GlobalCounts | None) -> GlobalCounts | None:
        import torch.distributed as dist

        if dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1:
            return GlobalCounts.of(td)
        return counts


class CountsFromLastCall(_Counted):
    """Keeps the last counts it was given and normalizes a later call without counts by them
    (a trainer that sets the global counts on the loss once per step and never clears them):
    a plain call after an accumulated step is weighted as a micro-batch. Killed by LOSS-003
    since loss 1.9 (one loss object on a live policy, called with another batch's counts
    first)."""

    last: GlobalCounts | None = None

    def recount(self, td: TensorDictBase, counts: GlobalCounts | None) -> GlobalCounts | None:
        if counts is not None:
            self.last = counts
        return self.last


class AdvantagesKeptPerBatch(_Edit):
    """Reads a batch's advantages once and keeps them by the batch object (a whitening cache
    keyed by the batch): the same batch with advantages rewritten in place, as a trainer
    reusing its buffers does, is trained on the old ones. Killed by LOSS-003 since loss 1.9
    (in-place changes of a batch between calls)."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.kept: dict[int, torch.Tensor] = {}

    def pre(self, td: TensorDictBase) -> TensorDictBase:
        adv = self.kept.setdefault(id(td), td.get(ADV).clone())
        if adv.shape != td.get(ADV).shape:
            return td
        return td.clone().set(ADV, adv, inplace=False)


class KlApproxOtherThanDeclared(PolicyGradientLoss):
    """Declares ``extras['kl_approx'] = "k1"`` (the mean of sample_log_probs - log pi, as
    TorchRL and verl report it) but reports k3 of that log-ratio, the reference's estimator."""


class KlTermLocal(PolicyGradientLoss):
    """The policy-gradient term over the global counts, the KL term over the micro-batch's
    own tokens: the same as the whole batch's wherever the KL is zero (at ratio 1 with the
    reference equal to the policy), off by the micro-batch's share of tokens elsewhere."""

    def forward(self, td: TensorDictBase, *, counts: GlobalCounts | None = None) -> TensorDict:
        out = super().forward(td, counts=counts)
        if counts is not None and "loss_kl_to_ref" in out.keys():  # noqa: SIM118
            out["loss_kl_to_ref"] = super().forward(td).get("loss_kl_to_ref")
        return out


class KlApproxToReference(_Edit):
    """``kl_approx`` reports the KL to the reference (the ``kl_to_ref`` diagnostic): zero at
    ratio 1 with the reference equal to the policy, as the behaviour KL is."""

    def post(self, out: TensorDict, td: TensorDictBase) -> TensorDict:
        out["kl_approx"] = out.get("kl_to_ref")
        return out


class DiagnosticsPerMicroBatch(PolicyGradientLoss):
    """Loss terms over the global counts, but diagnostics averaged over the micro-batch alone
    (a mean of means once micro-batches are combined)."""

    def forward(self, td: TensorDictBase, *, counts: GlobalCounts | None = None) -> TensorDict:
        out = super().forward(td, counts=counts)
        local = super().forward(td)
        for k in ("clip_fraction", "kl_approx", "entropy"):
            out.set(k, local.get(k))
        return out


class IgnoresKlEstimator(PolicyLoss):
    """Takes ``kl_estimator`` (validated) and computes k3 whatever it says."""

    def __init__(self, policy: Any, *, kl_estimator: str = "k3", **kwargs: Any) -> None:
        super().__init__(policy, kl_estimator=kl_estimator, **kwargs)
        self.options = replace(self.options, kl_estimator="k3")


class K1SignFlipped(PolicyLoss):
    """k1 as log pi_ref - log pi (the sign of KL(pi_ref || pi)'s estimator, not KL(pi || pi_ref)'s)."""

    def _kl(self, logp: torch.Tensor, ref: torch.Tensor, old: torch.Tensor) -> torch.Tensor:
        return -super()._kl(logp, ref, old)


class IgnoresKlGradient(PolicyLoss):
    """Takes ``kl_gradient`` (validated) and differentiates the estimate as written."""

    def __init__(self, policy: Any, *, kl_gradient: str = "pathwise", **kwargs: Any) -> None:
        super().__init__(policy, kl_gradient=kl_gradient, **kwargs)
        self.options = replace(self.options, kl_gradient="pathwise")


class AlwaysScoreKl(PolicyLoss):
    """Adds the score-function term whatever ``kl_gradient`` says (NeMo-RL's form everywhere)."""

    def __init__(self, policy: Any, *, kl_gradient: str = "pathwise", **kwargs: Any) -> None:
        super().__init__(policy, kl_gradient=kl_gradient, **kwargs)
        self.options = replace(self.options, kl_gradient="score")


class IgnoresRatio(PolicyLoss):
    """Takes ``ratio`` (validated) and clips the per-token ratio whatever it says."""

    def __init__(self, policy: Any, *, ratio: str = "token", **kwargs: Any) -> None:
        super().__init__(policy, ratio=ratio, **kwargs)
        self.options = replace(self.options, ratio="token")


class ArithmeticSequenceRatio(PolicyLoss):
    """GSPO's sequence ratio as the arithmetic mean of the token ratios, not the geometric."""

    def _ratios(self, logp: torch.Tensor, prox: torch.Tensor, fm: torch.Tensor) -> torch.Tensor:
        if self.options.ratio != "sequence":
            return super()._ratios(logp, prox, fm)
        r = torch.where(fm > 0, (logp - prox).exp(), 0.0)
        mean = r.sum(-1, keepdim=True) / fm.sum(-1, keepdim=True).clamp_min(1)
        return torch.where(fm > 0, mean.expand_as(logp), 1.0)


class NoneAsOnPolicy(PolicyLoss):
    """``ratio="none"`` (REINFORCE, -A log pi) computed as a forced ratio of 1 (-A)."""

    def __init__(self, policy: Any, *, ratio: str = "token", **kwargs: Any) -> None:
        super().__init__(policy, ratio=ratio, **kwargs)
        if ratio == "none":
            self.options = replace(self.options, ratio="on_policy")


class GspoTokenForm(PolicyLoss):
    """``ratio="sequence"`` as GSPO-token (verl's form): sg(ρ_seq)·exp(logp_t - sg(logp_t)),
    the same value and, with a [B] advantage, the same gradient; with a [B, T] one each token
    gets its own A_t·ρ instead of the row's mixed advantages."""

    def _ratios(self, logp: torch.Tensor, prox: torch.Tensor, fm: torch.Tensor) -> torch.Tensor:
        r = super()._ratios(logp, prox, fm)
        if self.options.ratio != "sequence":
            return r
        return torch.where(fm > 0, r.detach() * (logp - logp.detach()).exp(), 1.0)


class GspoNeverClips(PolicyLoss):
    """``ratio="sequence"`` whose surrogate never clips the sequence ratio (-A·ρ throughout)."""

    def _clamped(self, ratio: torch.Tensor) -> torch.Tensor:
        return ratio if self.options.ratio == "sequence" else super()._clamped(ratio)


class GspoTokenAsSequence(PolicyLoss):
    """``ratio="gspo_token"`` computed as the sequence ratio: the same value, and with a [B, T]
    advantage each token's gradient mixes its row's advantages instead of its own A_t·ρ."""

    def __init__(self, policy: Any, *, ratio: str = "token", **kwargs: Any) -> None:
        super().__init__(policy, ratio=ratio, **kwargs)
        if ratio == "gspo_token":
            self.options = replace(self.options, ratio="sequence")


class GspoTokenNeverClips(PolicyLoss):
    """``ratio="gspo_token"`` whose surrogate never clips the sequence ratio's value."""

    def _clamped(self, ratio: torch.Tensor) -> torch.Tensor:
        return ratio if self.options.ratio == "gspo_token" else super()._clamped(ratio)


class CispoWeightNotDetached(PolicyLoss):
    """``ratio="cispo"`` with the gradient flowing through the weight: -A·clip(r)·log p
    differentiated as written, so an unclipped token's gradient is -A·r·(1 + log p)·w."""

    def _cispo(
        self, adv: torch.Tensor, ratio: torch.Tensor, logp: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        ratio_c = self._clamped(ratio)
        return -adv * ratio_c * logp, ratio_c != ratio


class CispoAsClippedSurrogate(PolicyLoss):
    """``ratio="cispo"`` computed as PPO's token surrogate: value Σ w·(-A·r), not
    Σ w·(-A·sg(r)·log p), though the gradient inside the bounds is the same."""

    def __init__(self, policy: Any, *, ratio: str = "token", **kwargs: Any) -> None:
        super().__init__(policy, ratio=ratio, **kwargs)
        if ratio == "cispo":
            self.options = replace(self.options, ratio="token")


class CispoClippedWeightStopsGradient(PolicyLoss):
    """``ratio="cispo"`` whose clipped tokens get no gradient (PPO's rule): the same value, but
    where the weight is clipped the token's log-prob is detached too."""

    def _cispo(
        self, adv: torch.Tensor, ratio: torch.Tensor, logp: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        ratio_c = self._clamped(ratio)
        active = ratio_c != ratio
        return -adv * ratio_c.detach() * torch.where(active, logp.detach(), logp), active


class CispoUnclippedWeight(PolicyLoss):
    """``ratio="cispo"`` whose weight is never clipped: -A·sg(r)·log p at every ratio."""

    def _clamped(self, ratio: torch.Tensor) -> torch.Tensor:
        return ratio if self.options.ratio == "cispo" else super()._clamped(ratio)


class KlWithoutGradient(PolicyLoss):
    """The KL estimate computed from a detached log pi: ``loss_kl_to_ref`` has no grad_fn."""

    def _kl(self, logp: torch.Tensor, ref: torch.Tensor, old: torch.Tensor) -> torch.Tensor:
        return super()._kl(logp.detach(), ref, old)


class KlOfMeanLogRatio(PolicyLoss):
    """The estimator taken of each row's mean log-ratio, broadcast to its tokens: the same as
    the per-token estimate only where log r is constant along the row."""

    def _kl(self, logp: torch.Tensor, ref: torch.Tensor, old: torch.Tensor) -> torch.Tensor:
        fm = (logp != 0).to(logp.dtype)  # the caller zeroes logp off the assistant tokens
        mean = ((ref - logp) * fm).sum(-1, keepdim=True) / fm.sum(-1, keepdim=True).clamp_min(1)
        return super()._kl(logp, logp + mean, old)


class KlImportanceWeighted(PolicyLoss):
    """``kl_gradient="score"`` done as k·exp(log pi - sample_log_probs) (NeMo-RL's
    use_on_policy_kl_approximation): the same as the score form at ratio 1 only."""

    def __init__(self, policy: Any, *, kl_gradient: str = "pathwise", **kwargs: Any) -> None:
        super().__init__(policy, kl_gradient=kl_gradient, **kwargs)
        if kl_gradient == "score":
            self.options = replace(self.options, kl_gradient="behaviour")


class SequenceMeanOfEmptyRow(PolicyGradientLoss):
    """Divides a row's sum by its assistant-token count unguarded: a row without an
    assistant token (a truncated answer) makes 0/0 and every term NaN. Killed by LOSS-001
    since loss 1.8 (drawn batches whose first or last row holds no assistant token)."""

    def _weights(self, mask: torch.Tensor, counts: GlobalCounts) -> torch.Tensor:
        if self.aggregation != "seq_mean_token_mean":
            return super()._weights(mask, counts)
        m = mask.double()
        return m / (max(counts.sequences, 1) * m.sum(-1, keepdim=True))


class ContiguousAnswer(_Edit):
    """Takes the answer as one span, every attended position from the first assistant token
    on (a single-turn trainer's response slice): tool output inside a multi-turn answer, a
    hole in the assistant mask, is trained on. Killed by LOSS-004 since loss 1.8 (drawn
    masks with holes)."""

    def pre(self, td: TensorDictBase) -> TensorDictBase:
        td = td.clone()
        asst, att = td.get(ASST), td.get(ATT)
        t = asst.shape[-1]
        first = torch.where(asst.any(-1), asst.float().argmax(-1), t)
        td.set(ASST, att & (torch.arange(t)[None, :] >= first[:, None]))
        return td


class ClampsAdvantages(PolicyGradientLoss):
    """Clamps advantages to [-10, 10] before the surrogate (an outlier guard some trainers
    put in front of the loss): a large advantage's token gets the gradient of 10. Killed by
    LOSS-014 since loss 1.8 (drawn advantages up to 50 in magnitude)."""

    def _surrogate(
        self, adv: torch.Tensor, ratio: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        return super()._surrogate(adv.clamp(-10.0, 10.0), ratio)


class CaseInsensitiveOptions(PolicyGradientLoss):
    """Reads its aggregation case-insensitively (``value.lower()``, as many config parsers
    do): ``"SEQ_MEAN_TOKEN_MEAN"`` is taken for a value the spec does not define. Killed by
    LOSS-008 since loss 1.8 (near misses of the declared value)."""

    def __init__(self, policy: Any, *, aggregation: str = "token_mean", **kwargs: Any) -> None:
        super().__init__(policy, aggregation=aggregation.lower(), **kwargs)


_CLIP = (0.2, 0.28)


def _clip_impl(req: str, cls: type, **extras: Any) -> Implementation:
    """A mutant declaring capability clip with asymmetric bounds (and dual clip if given)."""
    kw: dict[str, Any] = {"dual_clip": extras["dual_clip"]} if "dual_clip" in extras else {}
    return Implementation(
        "loss",
        partial(cls, aggregation="seq_mean_token_mean", clip_epsilon=_CLIP, kl_coef=0.05, **kw),
        name=f"mutant-{req}-{cls.__name__}",
        capabilities={"kl_to_ref", "per_token_advantage", "diagnostics", "clip"},
        options={"aggregation": "seq_mean_token_mean"},
        extras={"clip_epsilon": _CLIP, **extras},
    )


def _impl(req: str, cls: type, agg: str = "seq_mean_token_mean", **kw: Any) -> Implementation:
    kw.setdefault("capabilities", {"kl_to_ref", "per_token_advantage", "diagnostics"})
    factory = (
        partial(cls, aggregation=agg, kl_coef=0.05, entropy_coef=0.01)
        if cls is not SwallowsOptions
        else cls
    )
    return Implementation(
        "loss", factory, name=f"mutant-{req}-{cls.__name__}", options={"aggregation": agg}, **kw
    )


_COUNTED = {"kl_to_ref", "per_token_advantage", "diagnostics", "global_counts"}


def _opt_impl(req: str, cls: type, **declared: str) -> Implementation:
    """A mutant declaring a 1.4 option: the value reaches the factory only as declared."""
    return Implementation(
        "loss",
        partial(cls, clip_epsilon=_CLIP, kl_coef=0.05),
        name=f"mutant-{req}-{cls.__name__}",
        capabilities={"kl_to_ref", "per_token_advantage", "diagnostics", "clip"},
        options={"aggregation": "seq_mean_token_mean", **declared},
        extras={"clip_epsilon": _CLIP},
    )


MUTANTS: dict[str, Implementation] = {
    "LOSS-001": _impl("LOSS-001", ShapeOneObjective),
    "LOSS-002": _impl("LOSS-002", Detached),
    "LOSS-003": _impl("LOSS-003", TokenMeanWhateverDeclared),
    "LOSS-004": _impl("LOSS-004", TrainsOnPrompt),
    "LOSS-005": _impl("LOSS-005", DividesByAllPositions, agg="token_mean"),
    "LOSS-006": _impl("LOSS-006", NormalisesConsecutivePairs),
    "LOSS-007": _impl("LOSS-007", MutatesInput),
    "LOSS-008": _impl("LOSS-008", SwallowsOptions, agg="token_mean"),
    "LOSS-009": _impl("LOSS-009", FillsMissingFields),
    "LOSS-010": _impl("LOSS-010", KlOverAttention),
    "LOSS-011": _impl("LOSS-011", TokenAdvantagesDropKl),
    "LOSS-012": _impl("LOSS-012", DilutedDiagnostics),
    "LOSS-013": _impl("LOSS-013", PolicyGradientLoss, capabilities={"ragged"}),
    "LOSS-014": _clip_impl("LOSS-014", NoClip),
    "LOSS-015": _impl("LOSS-015", BroadcastsAdvantage),
    "LOSS-016": _impl("LOSS-016", IgnoresCounts, capabilities=_COUNTED),
    "LOSS-017": _impl("LOSS-017", LocalTokenMean, agg="token_mean", capabilities=_COUNTED),
    "LOSS-018": _impl("LOSS-018", DiagnosticsPerMicroBatch, capabilities=_COUNTED),
    "LOSS-019": _opt_impl("LOSS-019", IgnoresKlEstimator, kl_estimator="k2"),
    "LOSS-020": _opt_impl("LOSS-020", IgnoresKlGradient, kl_gradient="score"),
    "LOSS-021": _opt_impl("LOSS-021", IgnoresRatio, ratio="sequence"),
    "LOSS-022": _opt_impl("LOSS-022", GspoNeverClips, ratio="sequence"),
    "LOSS-023": _opt_impl("LOSS-023", CispoClippedWeightStopsGradient, ratio="cispo"),
    "LOSS-024": _impl("LOSS-024", KlApproxToReference),
}
"""Requirement id -> a loss that breaks exactly that requirement."""

EXTRA_MUTANTS: list[tuple[str, Implementation]] = [
    ("LOSS-010", _impl("LOSS-010", KlOverPositions)),
    ("LOSS-009", _impl("LOSS-009", MasksAsWeights)),
    ("LOSS-009", _impl("LOSS-009", RatioInDataDtype)),
    ("LOSS-014", _clip_impl("LOSS-014", MaxInsteadOfMin)),
    ("LOSS-014", _clip_impl("LOSS-014", SymmetricClip)),
    ("LOSS-014", _clip_impl("LOSS-014", IgnoresDualClip, dual_clip=3.0)),
    ("LOSS-015", _impl("LOSS-015", AlignsLogProbs)),
    ("LOSS-003", _impl("LOSS-003", SumsTokenAdvantages)),
    ("LOSS-003", _impl("LOSS-003", ShiftedTokenAdvantage)),
    ("LOSS-003", _impl("LOSS-003", PerRowForwardPadsLeft)),
    ("LOSS-012", _impl("LOSS-012", ShiftedEntropy)),
    ("LOSS-017", _impl("LOSS-017", LocalSequenceMean, capabilities=_COUNTED)),
    ("LOSS-017", _impl("LOSS-017", IgnoresCounts, agg="token_mean", capabilities=_COUNTED)),
    ("LOSS-017", _impl("LOSS-017", PaddedWidthCounts, agg="token_mean", capabilities=_COUNTED)),
    ("LOSS-016", _impl("LOSS-016", CountsEveryRow, capabilities=_COUNTED)),
    ("LOSS-017", _impl("LOSS-017", KlTermLocal, agg="token_mean", capabilities=_COUNTED)),
    ("LOSS-019", _opt_impl("LOSS-019", K1SignFlipped, kl_estimator="k1")),
    ("LOSS-020", _opt_impl("LOSS-020", AlwaysScoreKl, kl_gradient="pathwise")),
    ("LOSS-021", _opt_impl("LOSS-021", ArithmeticSequenceRatio, ratio="sequence")),
    ("LOSS-021", _opt_impl("LOSS-021", NoneAsOnPolicy, ratio="none")),
    ("LOSS-020", _opt_impl("LOSS-020", KlWithoutGradient, kl_gradient="pathwise")),
    ("LOSS-019", _opt_impl("LOSS-019", KlOfMeanLogRatio, kl_estimator="k3")),
    ("LOSS-020", _opt_impl("LOSS-020", KlOfMeanLogRatio, kl_gradient="pathwise")),
    ("LOSS-020", _opt_impl("LOSS-020", KlImportanceWeighted, kl_gradient="score")),
    ("LOSS-021", _opt_impl("LOSS-021", GspoTokenForm, ratio="sequence")),
    # loss 1.5: GSPO's token form and CISPO
    ("LOSS-021", _opt_impl("LOSS-021", GspoTokenAsSequence, ratio="gspo_token")),
    ("LOSS-022", _opt_impl("LOSS-022", GspoTokenNeverClips, ratio="gspo_token")),
    ("LOSS-021", _opt_impl("LOSS-021", CispoWeightNotDetached, ratio="cispo")),
    ("LOSS-021", _opt_impl("LOSS-021", CispoAsClippedSurrogate, ratio="cispo")),
    ("LOSS-023", _opt_impl("LOSS-023", CispoUnclippedWeight, ratio="cispo")),
    # loss 1.6: every term live under micro-batching, the sequence means' rule by default,
    # kl_approx pinned down
    ("LOSS-003", _impl("LOSS-003", CountsEveryRow, capabilities=_COUNTED)),
    ("LOSS-024", _impl("LOSS-024", KlApproxOtherThanDeclared, extras={"kl_approx": "k1"})),
    # loss 1.7: micro-batches add up across data-parallel ranks too
    ("LOSS-017", _impl("LOSS-017", RankLocalCounts, agg="token_mean", capabilities=_COUNTED)),
    # loss 1.8: drawn batches (any shape, empty first/last rows, holes) and clip ratios
    ("LOSS-001", _impl("LOSS-001", SequenceMeanOfEmptyRow)),
    ("LOSS-004", _impl("LOSS-004", ContiguousAnswer)),
    ("LOSS-014", _clip_impl("LOSS-014", ClampsAdvantages)),
    ("LOSS-008", _impl("LOSS-008", CaseInsensitiveOptions)),
    # loss 1.9: one loss object on a live policy
    ("LOSS-003", _impl("LOSS-003", CountsFromLastCall, capabilities=_COUNTED)),
    ("LOSS-003", _impl("LOSS-003", AdvantagesKeptPerBatch)),
]
"""Further bugs a requirement must catch besides its main mutant: (requirement id, mutant)."""

DUAL_CLIP = Implementation(
    "loss",
    partial(
        DualClipLoss,
        aggregation="seq_mean_token_mean",
        clip_epsilon=_CLIP,
        kl_coef=0.05,
        dual_clip=3.0,
    ),
    name="DualClipLoss (correct)",
    capabilities={"kl_to_ref", "per_token_advantage", "diagnostics", "clip"},
    options={"aggregation": "seq_mean_token_mean"},
    extras={"clip_epsilon": _CLIP, "dual_clip": 3.0},
)
"""Not a mutant: a correct dual-clip loss, which must pass every requirement."""
