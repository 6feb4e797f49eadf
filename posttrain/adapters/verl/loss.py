"""verl's registered policy losses (``verl.trainer.ppo.core_algos``) on the LLM layout v1.

verl's actor turns logits into the response tokens' log-probs, then calls the registered
``compute_policy_loss_<mode>(old_log_prob, log_prob, advantages, response_mask,
loss_agg_mode, config)``, which aggregates through ``agg_loss`` with the global-batch figures
of ``config.global_batch_info`` (``dp_size``, ``batch_num_tokens``, ``global_batch_size``,
``loss_scale_factor``). :class:`VerlLoss` does exactly that with the suite's policy and
verl's own ``ActorConfig``; the loss math is verl's, only the tensors are mapped.
"""

from __future__ import annotations

from typing import Any

import torch
from tensordict import TensorDict, TensorDictBase

from posttrain.adapters._layout import token_inputs
from posttrain.contracts.loss import GlobalCounts

VERL_AGGREGATIONS = {
    "token_mean": "token-mean",
    "seq_mean_token_mean": "seq-mean-token-mean",
    "seq_mean_token_sum": "seq-mean-token-sum",
    "seq_mean_token_sum_norm": "seq-mean-token-sum-norm",
}
"""Contract aggregation -> verl's ``loss_agg_mode`` (verl's ``token-sum`` has no contract
counterpart: a sum over tokens is no mean of anything, so it has no row)."""

VERL_INSTALL = "pip install --no-deps verl==0.9.1 omegaconf codetiming"

# Options of verl's ActorConfig / PolicyLossConfig a row may set (LOSS-008 names the rest).
_ACTOR_OPTIONS = (
    "clip_ratio",
    "clip_ratio_low",
    "clip_ratio_high",
    "clip_ratio_c",
    "tau_pos",
    "tau_neg",
)
_POLICY_LOSS_OPTIONS = (
    "clip_cov_ratio",
    "clip_cov_lb",
    "clip_cov_ub",
    "kl_cov_ratio",
    "ppo_kl_coef",
    "dro_beta",
)

RATIOS = {
    "vanilla": "token",
    "clip_cov": "token",
    "kl_cov": "token",
    "bypass_mode": "token",
    "gspo": "gspo_token",
    "geo_mean": "sequence",
    "gpg": "none",
    "dro": "none",
    "cispo": "cispo",
}
"""verl loss mode -> the contract's ``ratio`` option its surrogate is (loss 1.5).
``core_algos.compute_policy_loss_gspo`` builds GSPO's token form, log s_t = sg(log s_seq) +
log_prob - sg(log_prob) (``gspo_token``); ``compute_policy_loss_cispo`` is
-sg(clip(ratio, 1 - clip_ratio_low, 1 + clip_ratio_high))·A·log_prob (``cispo``). sapo (a
sigmoid gate of r) and dppo_tv/dppo_kl (a truncated, detached ratio times log p) are none of
the contract's forms: no ``ratio`` is declared."""


def core_algos() -> Any:
    """``verl.trainer.ppo.core_algos``, or an ImportError saying how to install it on CPU.

    Example:
        >>> sorted(core_algos().POLICY_LOSS_REGISTRY)[:3]  # doctest: +SKIP
        ['bypass_mode', 'cispo', 'clip_cov']
    """
    try:
        import verl.trainer.ppo.core_algos as ca
    except ImportError as e:  # verl's own pins would replace torch and transformers
        raise ImportError(f"the verl adapters need verl's core_algos: {VERL_INSTALL}") from e
    return ca


def actor_config(
    loss_mode: str, aggregation: str, global_batch_info: dict[str, Any], **options: Any
) -> Any:
    """verl's own ``ActorConfig`` for one loss mode and aggregation (a single-process actor).

    Example:
        >>> actor_config("vanilla", "token-mean", {}).clip_ratio  # doctest: +SKIP
        0.2
    """
    core_algos()
    from verl.workers.config.actor import ActorConfig, PolicyLossConfig

    actor = {k: v for k, v in options.items() if k in _ACTOR_OPTIONS}
    pl = {k: v for k, v in options.items() if k in _POLICY_LOSS_OPTIONS}
    if "clip_ratio" in actor:  # verl's low/high default to 0.2, not to clip_ratio
        actor.setdefault("clip_ratio_low", actor["clip_ratio"])
        actor.setdefault("clip_ratio_high", actor["clip_ratio"])
    return ActorConfig(
        strategy="fsdp",
        rollout_n=1,
        ppo_micro_batch_size_per_gpu=1,
        loss_agg_mode=aggregation,
        policy_loss=PolicyLossConfig(loss_mode=loss_mode, **pl),
        global_batch_info=dict(global_batch_info),
        **actor,
    )


class VerlLoss(torch.nn.Module):
    """One of verl's registered policy losses as a ``LossModuleV1``.

    ``adapted=False`` (the raw row) hands verl the layout's tensors as they are, the advantage
    broadcast to verl's [B, T] and the assistant mask as ``response_mask``, with an empty
    ``global_batch_info`` (verl's defaults: the micro-batch's own counts, and for
    ``seq-mean-token-sum-norm`` the tensor's width). ``adapted=True`` validates the batch,
    clears position 0 of the mask (no logit predicts it), zeroes values outside the mask,
    and maps capability ``global_counts``: ``batch_num_tokens = counts.tokens``,
    ``global_batch_size = counts.sequences``, ``dp_size = 1`` (the contract's ranks all-reduce
    gradients by sum; verl's ``dp_size`` factor undoes FSDP's mean), ``loss_scale_factor =
    t_norm``. verl's metrics (``actor/pg_clipfrac``, ``actor/ppo_kl``: means over the
    micro-batch, combined by verl as a mean of micro-batch means) are returned by the raw row
    only.

    Example:
        >>> from posttrain.testing import llm_batch, tiny_causal_lm  # doctest: +SKIP
        >>> loss = VerlLoss(tiny_causal_lm(vocab_size=64), "vanilla", adapted=True)  # doctest: +SKIP
        >>> loss(llm_batch(2, 8, vocab_size=64))["loss_objective"].shape  # doctest: +SKIP
        torch.Size([])
    """

    def __init__(
        self,
        policy: Any,
        loss_mode: str = "vanilla",
        aggregation: str = "token_mean",
        *,
        adapted: bool = True,
        t_norm: float | None = None,
        ratio: str | None = None,
        **options: Any,
    ) -> None:
        super().__init__()
        ca = core_algos()
        if adapted and ratio is not None and ratio != RATIOS.get(loss_mode):
            raise ValueError(
                f"ratio: verl's {loss_mode} surrogate is "
                f"{RATIOS.get(loss_mode, 'none of the contract forms')!r}, found {ratio!r}"
            )
        if loss_mode not in ca.POLICY_LOSS_REGISTRY:
            raise ValueError(
                f"loss_mode: expected one of {sorted(ca.POLICY_LOSS_REGISTRY)}, found {loss_mode!r}"
            )
        if adapted and aggregation not in VERL_AGGREGATIONS:
            raise ValueError(
                f"aggregation: expected one of {sorted(VERL_AGGREGATIONS)}, found {aggregation!r}"
            )
        unknown = sorted(set(options) - set(_ACTOR_OPTIONS) - set(_POLICY_LOSS_OPTIONS))
        if unknown:
            raise TypeError(
                f"VerlLoss: unknown keyword argument(s) {unknown}; accepted: "
                f"{sorted(_ACTOR_OPTIONS + _POLICY_LOSS_OPTIONS)}"
            )
        self.policy = policy
        self.loss_mode = loss_mode
        self.agg = VERL_AGGREGATIONS.get(aggregation, aggregation)
        self.adapted = adapted
        self.t_norm = t_norm
        self.options = options
        self.fn = ca.get_policy_loss_fn(loss_mode)

    def forward(
        self,
        td: TensorDictBase,
        *,
        counts: GlobalCounts | None = None,
        global_batch_info: dict[str, Any] | None = None,
    ) -> TensorDict:
        """verl's loss of ``td`` (never mutated), as a part of the batch ``counts`` describes.

        ``global_batch_info`` (raw row only): verl's own figures, as its trainer sets them
        (``batch_num_tokens``, ``global_batch_size``, ``dp_size``); default: none.
        """
        x = token_inputs(
            td,
            counts,
            adapted=self.adapted,
            batch_info=global_batch_info,
            context=f"verl {self.loss_mode}",
        )
        info = x.batch_info
        if self.adapted:
            info["loss_scale_factor"] = self.t_norm
        logp = x.log_probs(self.policy)
        config = actor_config(self.loss_mode, self.agg, info, **self.options)
        pg_loss, metrics = self.fn(
            old_log_prob=x.old_log_probs,
            log_prob=logp,
            advantages=x.advantage,
            response_mask=x.mask,
            loss_agg_mode=self.agg,
            config=config,
        )
        out: dict[str, Any] = {"loss_objective": pg_loss.reshape(())}
        if not self.adapted:
            out.update({k: float(v) for k, v in metrics.items()})
            return TensorDict({"loss_objective": out.pop("loss_objective")}, batch_size=[]).update(
                {k.replace("/", "_"): torch.tensor(v) for k, v in out.items()}
            )
        return TensorDict(out, batch_size=[])
