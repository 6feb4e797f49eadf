"""The configurable policy-gradient loss: :class:`PolicyLossOptions` applied to a batch."""

from __future__ import annotations

import dataclasses
from typing import Any

import torch
from tensordict import TensorDict, TensorDictBase

from posttrain._kl import kl_estimate
from posttrain.contracts.layout import LLM_LAYOUT_V1, Layout
from posttrain.contracts.loss import GlobalCounts
from posttrain.policy_loss.aggregation import token_weights
from posttrain.policy_loss.importance import importance_weights
from posttrain.policy_loss.inputs import LossInputs, entropy, read_inputs
from posttrain.policy_loss.kl import kl_to_reference
from posttrain.policy_loss.options import SEQUENCE_RATIOS, PolicyLossOptions
from posttrain.policy_loss.ratio import cispo_surrogate, clamped, clipped_surrogate, ratios

_FIELDS = tuple(f.name for f in dataclasses.fields(PolicyLossOptions))


class PolicyLoss(torch.nn.Module):
    """A ``LossModuleV1`` configured by :class:`PolicyLossOptions`: the loss the adapters build.

    ``PolicyLoss(policy, **fields)`` or ``PolicyLoss(policy, options)``; an unknown keyword is
    refused by name. Everything is computed only where the assistant mask is True (position
    0 excluded); values elsewhere, NaN included, never reach outputs or gradients.

    Returns ``loss_objective``, ``loss_kl_to_ref`` (``kl_coef`` > 0), ``loss_entropy``
    (``entropy_coef`` > 0), ``loss_positive_nll`` (``positive_nll_coef`` > 0) and the
    diagnostics ``clip_fraction``, ``kl_approx`` (k3 of the behaviour KL), ``entropy`` and,
    with a KL term, ``kl_to_ref``: token means over the global counts, so micro-batches add
    up (capability ``global_counts``: ``loss(td, counts=GlobalCounts.of(whole_batch))``).

    Example:
        >>> from posttrain.testing import llm_batch, tiny_causal_lm
        >>> policy = tiny_causal_lm(vocab_size=64)
        >>> out = PolicyLoss(policy, ratio="sequence", kl_coef=0.1)(llm_batch(2, 8, vocab_size=64))
        >>> sorted(k for k in out.keys() if k.startswith("loss_"))
        ['loss_kl_to_ref', 'loss_objective']
        >>> PolicyLoss(policy, aggregaton="token_mean")
        Traceback (most recent call last):
        ...
        TypeError: aggregaton: not a PolicyLossOptions field; expected one of ['aggregation', 't_norm', 'clip_epsilon', 'dual_clip', 'ratio', 'kl_coef', 'kl_estimator', 'kl_input_clamp', 'kl_output_clamp', 'kl_gradient', 'importance_correction', 'importance_bounds', 'generation_key', 'entropy_coef', 'positive_nll_coef']
    """

    def __init__(
        self,
        policy: Any,
        options: PolicyLossOptions | None = None,
        *,
        layout: Layout = LLM_LAYOUT_V1,
        **fields: Any,
    ) -> None:
        super().__init__()
        unknown = sorted(set(fields) - set(_FIELDS))
        if unknown:
            raise TypeError(
                f"{unknown[0]}: not a PolicyLossOptions field; expected one of {list(_FIELDS)}"
            )
        if options is not None and fields:
            raise TypeError(f"options: given together with the fields {sorted(fields)}")
        self.policy = policy
        self.options = options if options is not None else PolicyLossOptions(**fields)
        self.layout = layout

    def inputs(self, td: TensorDictBase, counts: GlobalCounts | None = None) -> LossInputs:
        """``td`` validated and read: the policy's log-probs and the masked fields."""
        return read_inputs(
            self.policy,
            td,
            self.layout,
            require=self.options.required,
            generation_key=self.options.generation_key,
            counts=counts,
            context=type(self).__name__,
        )

    def proximal(self, x: LossInputs) -> torch.Tensor:
        """The ratio's denominator: ``sample_log_probs``, the policy's own under ``on_policy``."""
        return x.logp.detach() if self.options.ratio == "on_policy" else x.old

    def forward(self, td: TensorDictBase, *, counts: GlobalCounts | None = None) -> TensorDict:
        """Compute the loss terms and diagnostics for ``td`` (never mutated).

        ``counts``: the global batch's when ``td`` is one micro-batch of it (default
        ``GlobalCounts.of(td)``).
        """
        o = self.options
        x = self.inputs(td, counts)
        fm, w = x.fm, self._weights(x.mask, x.counts).to(x.logp.dtype)
        per_token, active = self._policy_gradient(x)
        out: dict[str, torch.Tensor] = {"loss_objective": (per_token * w).sum()}
        tm = fm / max(x.counts.tokens, 1)  # diagnostics: token means over the global count
        if o.kl_coef > 0:
            ref = x.masked(td, self.layout.key("ref_log_probs"))
            kl = torch.where(x.mask, self._kl(x.logp, ref, x.gen), 0.0)
            out["loss_kl_to_ref"] = o.kl_coef * (kl * w).sum()
            out["kl_to_ref"] = (kl * tm).sum().detach()
        if o.positive_nll_coef > 0:
            # VAPO's term: NeMo-RL normalizes it by this batch's own such tokens, not globally.
            good = fm * (td.get(self.layout.key("reward")).to(fm.dtype) > 0)[:, None]
            nll = (-x.logp * good).sum() / good.sum() if good.sum() > 0 else x.logp.sum() * 0.0
            out["loss_positive_nll"] = o.positive_nll_coef * nll
        ent = torch.where(x.mask, entropy(x.logits), 0.0)
        if o.entropy_coef > 0:
            out["loss_entropy"] = -o.entropy_coef * (ent * w).sum()
        with torch.no_grad():
            out["clip_fraction"] = ((active & x.mask).to(tm.dtype) * tm).sum()
            out["kl_approx"] = (torch.where(x.mask, kl_estimate(x.old - x.logp), 0.0) * tm).sum()
            out["entropy"] = (ent * tm).sum()
        return TensorDict(out, batch_size=[])

    def _policy_gradient(self, x: LossInputs) -> tuple[torch.Tensor, torch.Tensor]:
        """Per-token surrogate loss (importance-weighted as declared) and where it clipped."""
        o = self.options
        prox = self.proximal(x)
        ratio = self._ratios(x.logp, prox, x.fm)
        if o.ratio == "cispo":
            per_token, active = self._cispo(x.adv, ratio, x.logp)
        else:
            per_token, active = self._surrogate(x.adv, ratio)
        if o.importance_correction is not None:
            per_token = self.importance(x, prox)[0].expand_as(per_token) * per_token
        return per_token, active

    def importance(self, x: LossInputs, prox: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """:func:`~posttrain.policy_loss.importance.importance_weights` under these options."""
        o = self.options
        per_seq = o.ratio in SEQUENCE_RATIOS
        bounds: Any = o.importance_bounds  # (low, high) floats once validated
        return importance_weights(prox, x.gen, x.fm, o.importance_correction, bounds, per_seq)

    # One method per term, so that a subclass can change one of them.
    def _weights(self, mask: torch.Tensor, counts: GlobalCounts) -> torch.Tensor:
        return token_weights(mask, counts, self.options.aggregation, self.options.t_norm)

    def _ratios(self, logp: torch.Tensor, prox: torch.Tensor, fm: torch.Tensor) -> torch.Tensor:
        return ratios(logp, prox, fm, self.options.ratio)

    def _clamped(self, ratio: torch.Tensor) -> torch.Tensor:
        return clamped(ratio, self.options.ratio, self.options.clip)

    def _surrogate(
        self, adv: torch.Tensor, ratio: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        return clipped_surrogate(adv, ratio, self._clamped(ratio), self.options.dual_clip)

    def _cispo(
        self, adv: torch.Tensor, ratio: torch.Tensor, logp: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        return cispo_surrogate(adv, ratio, self._clamped(ratio), logp)

    def _kl(self, logp: torch.Tensor, ref: torch.Tensor, gen: torch.Tensor) -> torch.Tensor:
        o = self.options
        clamps = (o.kl_input_clamp, o.kl_output_clamp)
        return kl_to_reference(logp, ref, gen, o.kl_estimator, o.kl_gradient, clamps)
