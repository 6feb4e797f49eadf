"""TorchRL's LLM losses (GRPOLoss, DAPO, CISPOLoss) on the LLM layout v1."""

from __future__ import annotations

import inspect
from typing import Any

import torch
from tensordict import TensorDict, TensorDictBase

from posttrain._deps import optional_deps
from posttrain.adapters._hf import word_level_tokenizer
from posttrain.adapters._layout import global_counts
from posttrain.contracts.layout import LLM_LAYOUT_V1
from posttrain.contracts.loss import GlobalCounts

TORCHRL_AGGREGATIONS = {"token_mean": "token_mean", "seq_mean_token_mean": "prompt_mean"}
"""Contract aggregation -> GRPOLoss's name for it (TorchRL has no seq_mean_token_sum[_norm])."""

RATIOS = {"GRPOLoss": "token", "DAPO": "token", "CISPOLoss": "cispo"}
"""TorchRL loss class -> the contract's ``ratio`` option its adapted row computes (CISPOLoss's
through :func:`contract_cispo`)."""

# Terms TorchRL averages over every position of the padded batch (values are 0 off the mask).
_POSITION_MEANS = ("clip_fraction", "kl_approx", "entropy", "loss_kl_to_ref", "kl_to_ref")


def transformers_actor(
    policy: Any,
    tokenizer: Any = None,
    *,
    generate_kwargs: dict[str, Any] | None = None,
    pad_output: bool = True,
) -> Any:
    """A TorchRL ``TransformersWrapper`` in token mode returning log-probs.

    Scores given tokens, or generates when ``generate_kwargs`` are given. The tokenizer
    defaults to :func:`word_level_tokenizer` of the policy's config (nothing downloaded).

    Example:
        >>> from posttrain.testing import tiny_causal_lm  # doctest: +SKIP
        >>> actor = transformers_actor(tiny_causal_lm())  # doctest: +SKIP
    """
    with optional_deps():
        from torchrl.modules.llm import TransformersWrapper

    return TransformersWrapper(
        policy,
        tokenizer=tokenizer if tokenizer is not None else word_level_tokenizer(policy.config),
        input_mode="tokens",
        generate=generate_kwargs is not None,
        return_log_probs=True,
        pad_output=pad_output,
        generate_kwargs=generate_kwargs,
    )


def to_torchrl_layout(td: TensorDictBase) -> TensorDictBase:
    """A shallow copy whose advantage has GRPOLoss's shape [B, T, 1] (a view, no data copy).

    An assistant mask that marks position 0 is copied with position 0 cleared: no logit
    predicts that token, so it is no token of the loss, but TorchRL would score and count it.

    Example:
        >>> from posttrain.testing import llm_batch
        >>> to_torchrl_layout(llm_batch(2, 5)).get("advantage").shape
        torch.Size([2, 5, 1])
    """
    key = LLM_LAYOUT_V1.key("advantage")
    out = td.copy()
    asst_key = LLM_LAYOUT_V1.key("assistant_mask")
    asst = td.get(asst_key, None)
    if isinstance(asst, torch.Tensor) and asst.ndim >= 2 and bool(asst[..., 0].any()):
        asst = asst.clone()
        asst[..., 0] = False
        out.set(asst_key, asst)
    adv = td.get(key, None)
    if adv is None:  # leave the error to the loss, which names the key
        return out
    t = td.get(LLM_LAYOUT_V1.key("tokens")).shape[-1]
    adv = (
        adv[..., None, None].expand(*adv.shape, t, 1)
        if adv.ndim == td.batch_dims
        else adv[..., None]
    )
    out.set(key, adv)
    return out


class ContractLoss(torch.nn.Module):
    """A TorchRL LLM loss made to conform to ``LossModuleV1`` (thin: no copy of the data).

    Validates the batch against the LLM layout, maps the advantage to [B, T, 1], returns a
    TensorDict of the terms TorchRL computed (``None`` entries dropped), makes every term a
    scalar (``prompt_mean`` returns shape [1]) and averages ``clip_fraction``, ``kl_approx``,
    ``entropy`` and the KL to the reference over the tokens the loss trains on (TorchRL
    averages them over every position of the padded batch; its values are 0 outside the mask,
    so a rescale is exact). The KL term is then a token mean whatever the aggregation.

    Capability ``global_counts``: ``loss(td, counts=GlobalCounts(...))`` rescales TorchRL's
    micro-batch means to the global batch (``token_mean`` by this batch's tokens over
    ``counts.tokens``, ``prompt_mean`` by its rows over ``counts.sequences``; token means, the
    KL term and diagnostics, by the token ratio), so micro-batches add up. Without ``counts``,
    ``GlobalCounts.of(td)``: a row without assistant tokens is no sequence (TorchRL's
    ``prompt_mean`` averages over every row).

    Example:
        >>> from torchrl.objectives.llm import GRPOLoss
        >>> from posttrain.testing import llm_batch
        >>> from posttrain.testing import tiny_causal_lm
        >>> actor = transformers_actor(tiny_causal_lm())
        >>> loss = ContractLoss(GRPOLoss(actor, masking_strategy="rlhf", aggregation="prompt_mean"))
        >>> loss(llm_batch(2, 8, vocab_size=64))["loss_objective"].shape  # TorchRL's is [1]
        torch.Size([])
    """

    def __init__(self, loss: Any) -> None:
        super().__init__()
        self.loss = loss

    def forward(self, td: TensorDictBase, *, counts: GlobalCounts | None = None) -> TensorDict:
        """Compute the wrapped loss on ``td`` (never mutated), as a part of the batch ``counts``
        describes (default: ``td`` is the whole batch)."""
        LLM_LAYOUT_V1.validate_batch(
            td, require=("sample_log_probs", "advantage"), context=type(self.loss).__name__
        )
        own, c = global_counts(td, counts)
        per_token = own.tokens / max(c.tokens, 1)
        per_row = (
            per_token
            if getattr(self.loss, "aggregation", "token_mean") == "token_mean"
            else td.batch_size[0] / max(c.sequences, 1)  # prompt_mean: a mean over every row
        )
        tl = to_torchrl_layout(td)
        out = self.loss(tl)
        flat = out.to_tensordict() if hasattr(out, "to_tensordict") else out
        terms = {k: v for k, v in flat.items() if isinstance(v, torch.Tensor)}
        for k, v in terms.items():
            if k.startswith("loss_") and v.numel() == 1:
                terms[k] = v.reshape(())
        mask = tl.get(LLM_LAYOUT_V1.key("assistant_mask")) & torch.isfinite(
            td.get(LLM_LAYOUT_V1.key("sample_log_probs"))
        )
        share = mask.numel() / mask.sum().clamp_min(1)
        for k in _POSITION_MEANS:
            if k in terms:
                terms[k] = terms[k] * share * per_token
        for k, v in terms.items():
            if k.startswith("loss_") and k not in _POSITION_MEANS:
                terms[k] = v * per_row
        if own.tokens == 0:  # TorchRL's means of nothing are NaN; this part weighs nothing
            terms = {k: torch.zeros_like(v.detach()) for k, v in terms.items()}
        return TensorDict(terms, batch_size=[])


_CISPO_CLASSES: dict[type, type] = {}


def contract_cispo(cispo_loss: type) -> type:
    """``cispo_loss`` (TorchRL's ``CISPOLoss``) with CISPO's surrogate -A·sg(clip(r))·log pi.

    TorchRL's ``CISPOLoss._compute_policy_objective`` returns -A·clip(r) with the gradient
    through the clip, so a token whose ratio is outside [1 - ε_low, 1 + ε_high] gets no
    gradient at all; CISPO (MiniMax-M1) stops the gradient at the clipped weight instead, and
    every token keeps the gradient -A·clip(r)·d log pi. The subclass keeps TorchRL's
    pipeline (masks, bounds, ``clip_fraction``, aggregation) and changes only that term; it
    reads the policy's log-probs from the ``_cur_log_prob`` entry that
    ``GRPOLoss._log_weight`` writes (0 outside the mask).

    Example:
        >>> from torchrl.objectives.llm import CISPOLoss
        >>> contract_cispo(CISPOLoss).__mro__[1] is CISPOLoss
        True
    """
    if cispo_loss in _CISPO_CLASSES:
        return _CISPO_CLASSES[cispo_loss]

    class ContractCISPOLoss(cispo_loss):  # type: ignore[misc]
        def _log_weight(self, tensordict: TensorDictBase, adv_shape: torch.Size) -> Any:
            out = super()._log_weight(tensordict, adv_shape)
            self._posttrain_log_pi = tensordict.get("_cur_log_prob")
            return out

        def _compute_policy_objective(
            self, log_weight: torch.Tensor, advantage: torch.Tensor
        ) -> tuple[torch.Tensor, torch.Tensor]:
            log_pi = self.__dict__.pop("_posttrain_log_pi").reshape(log_weight.shape)
            clipped = log_weight.clamp(*self._clip_bounds)
            clip_fraction = (clipped != log_weight).to(log_weight.dtype).mean()
            return -clipped.exp().detach() * advantage * log_pi, clip_fraction

    ContractCISPOLoss.__qualname__ = ContractCISPOLoss.__name__
    _CISPO_CLASSES[cispo_loss] = ContractCISPOLoss
    return ContractCISPOLoss


def make_loss(cls_name: str, *, adapted: bool) -> Any:
    """A loss factory ``factory(policy, **options)`` for a TorchRL LLM loss class."""

    def factory(policy: Any, aggregation: str = "token_mean", **kwargs: Any) -> Any:
        with optional_deps():
            import torchrl.objectives.llm as llm

        cls = getattr(llm, cls_name)
        if adapted:
            if aggregation not in TORCHRL_AGGREGATIONS:
                raise ValueError(
                    f"aggregation: expected one of {sorted(TORCHRL_AGGREGATIONS)}, found {aggregation!r}"
                )
            ratio = kwargs.pop("ratio", None)
            if ratio is not None and ratio != RATIOS[cls_name]:
                raise ValueError(
                    f"ratio: {cls_name}'s surrogate is {RATIOS[cls_name]!r}, found {ratio!r}"
                )
            known = set(inspect.signature(cls.__init__).parameters) - {
                "self",
                "kwargs",
                "actor_network",
            }
            unknown = sorted(set(kwargs) - known)
            if unknown:
                raise TypeError(
                    f"{cls_name}: unknown keyword argument(s) {unknown}; accepted: {sorted(known)}"
                )
        agg = TORCHRL_AGGREGATIONS.get(aggregation, aggregation)
        if adapted and cls_name == "CISPOLoss":
            cls = contract_cispo(cls)
        loss = cls(transformers_actor(policy), masking_strategy="rlhf", aggregation=agg, **kwargs)
        return ContractLoss(loss) if adapted else _LayoutOnly(loss)

    factory.__name__ = f"{'adapted' if adapted else 'raw'}_{cls_name}"
    return factory


class _LayoutOnly(torch.nn.Module):
    """The raw row: only the advantage's shape is mapped, everything else is TorchRL's."""

    def __init__(self, loss: Any) -> None:
        super().__init__()
        self.loss = loss

    def forward(self, td: TensorDictBase) -> Any:
        return self.loss(to_torchrl_layout(td))
