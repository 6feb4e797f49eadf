"""Losses both ways between NeMo-RL's ``LossFunction`` and posttrain's ``LossModuleV1``.

NeMo-RL (``nemo_rl/algorithms/loss/interfaces.py``, commit 7ea279a; since v0.6 losses take
log-probs, before that logits): a loss has ``loss_type`` ("token_level" / "sequence_level"),
``input_type`` ("logprob", "logit", ...) and is called
``loss_fn(data=..., global_valid_seqs=..., global_valid_toks=..., next_token_logprobs=...)``
returning ``(loss, metrics)``. ``next_token_logprobs`` is [B, S-1]: entry t is
log p(input_ids[t+1]); data fields are [B, S] and the loss reads them ``[:, 1:]``. Each
microbatch's loss is already divided by the *global* count of valid tokens (or sequences)
over all microbatches and data-parallel ranks, so the losses add up to the full-batch loss
(``nemo_rl/models/automodel/train.py``); metrics are normalized the same way and summed.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping
from typing import Any

import torch
from tensordict import LazyStackedTensorDict, TensorDict, TensorDictBase

from posttrain.adapters.nemo_rl.mirror.loss_functions import (
    DPO_DEFAULTS,
    GENERATION_KEY,
    clipped_pg_metrics,
    clipped_pg_options,
)
from posttrain.adapters.nemo_rl.train_data import NemoFormatError, from_layout
from posttrain.adapters.nemo_rl.upstream import from_nemo_rl
from posttrain.contracts.alignment import token_log_probs
from posttrain.contracts.layout import LLM_LAYOUT_V1, Layout
from posttrain.contracts.loss import GlobalCounts
from posttrain.policy_loss import PolicyLoss

# What NeMo-RL's loss reads from ``data`` (``ClippedPGLossFn``,
# ``nemo_rl/algorithms/loss/loss_functions.py``), besides ``prev_logprobs`` (for which
# ``generation_logprobs`` stands in here) and, with a KL term, ``reference_policy_logprobs``.
_LOSS_DATA_KEYS = ("input_ids", "token_mask", "sample_mask", "advantages")

LOSS_TYPES = {"token_mean": "token_level", "seq_mean_token_mean": "sequence_level"}
"""posttrain aggregation -> NeMo-RL ``LossType`` value (NeMo-RL has no token-sum variants)."""


def _f(x: torch.Tensor) -> torch.Tensor:
    """float32, float64 kept (a float64 check stays float64 end to end)."""
    return x if x.dtype == torch.float64 else x.float()


def _whole(x: torch.Tensor | float) -> int:
    v = float(x)
    if v != round(v):
        raise ValueError(f"global counts: expected a whole number, found {v}")
    return round(v)


def _takes_counts(loss: Any) -> bool:
    """Whether ``loss(td, counts=...)`` is accepted (capability ``global_counts``)."""
    import inspect

    target = loss.forward if isinstance(loss, torch.nn.Module) else loss
    try:
        params = inspect.signature(target).parameters
    except (TypeError, ValueError):
        return False
    return "counts" in params


def _enum(name: str, value: str) -> Any:
    """NeMo-RL's enum member where nemo_rl imports, else its string value."""
    enum = from_nemo_rl(name)
    return value if enum is None else enum(value)


def global_counts(data: Mapping[str, Any]) -> tuple[torch.Tensor, torch.Tensor]:
    """``(valid sequences, valid tokens)`` of one batch, as NeMo-RL's workers count them.

    ``sum(sample_mask)`` and ``sum(token_mask[:, 1:] * sample_mask)`` (position 0 is never
    predicted); all-reduce them over data-parallel ranks for the global counts.

    Example:
        >>> import torch
        >>> global_counts({"token_mask": torch.tensor([[0, 1, 1], [0, 0, 1]]),
        ...                "sample_mask": torch.tensor([1.0, 0.0])})
        (tensor(1.), tensor(2.))
    """
    sm = data["sample_mask"].float()
    return sm.sum(), (data["token_mask"][:, 1:].float() * sm[:, None]).sum()


class _GivenLogProbs(torch.nn.Module):
    """A stand-in causal LM whose log-prob of token 0 at each position is a given value.

    Over a two-token vocabulary, logit 0 is the given log-prob l and logit 1 is log(1 - e^l),
    so log_softmax at token 0 is exactly l and its derivative with respect to l is exactly 1:
    a loss built on a policy sees the given log-probs and passes gradients straight back.
    """

    def __init__(self, next_token_logprobs: torch.Tensor) -> None:
        super().__init__()
        self.lp = next_token_logprobs

    def forward(self, input_ids: torch.Tensor, attention_mask: Any = None) -> Any:
        lp = _f(self.lp)
        inside = lp < -1e-6
        other = torch.where(
            inside, torch.log1p(-torch.exp(lp.clamp(max=-1e-6))), torch.full_like(lp, -1e4)
        )
        body = torch.stack([lp, other], dim=-1)  # [B, S-1, 2]
        logits = torch.cat([body, torch.zeros_like(body[:, :1])], dim=1)  # [B, S, 2]
        return _Out(logits)


class _Out:
    def __init__(self, logits: torch.Tensor) -> None:
        self.logits = logits


class ContractAsNemoLoss:
    """A posttrain loss (a ``LossModuleV1`` built from a policy) as a NeMo-RL ``LossFunction``.

    ``make_loss(policy) -> LossModuleV1``; ``input_type`` is "logprob". NeMo-RL's data becomes
    an LLM-layout batch: the assistant mask is ``token_mask * sample_mask`` (what NeMo-RL's
    loss trains on), the behaviour log-probs are ``prev_logprobs`` (NeMo-RL's PPO ratio is
    taken against them; ``generation_logprobs`` when absent), the reference log-probs
    ``reference_policy_logprobs``, the advantage ``advantages``. The policy the loss sees
    returns exactly ``next_token_logprobs`` (gradients pass straight back). The loss, a token
    mean (``loss_type="token_level"``) or a sequence mean of token means
    (``"sequence_level"``) over this microbatch, is rescaled by local/global count so that
    microbatches and ranks add up to the full-batch loss, as NeMo-RL's own losses do.
    ``clip_fraction`` and ``kl_approx`` are reported likewise; entropy cannot be (only the
    sampled tokens' log-probs arrive) and is dropped. ``data`` without ``input_ids``,
    ``token_mask``, ``sample_mask``, ``advantages`` or behaviour log-probs raises
    ``NemoFormatError`` naming what is missing. ``metrics(loss, td, counts, out, data)``, if
    given, adds metrics of its own (the wrapped loss, its layout batch, the global counts, its
    output and NeMo-RL's data) to a loss taking ``counts``.

    Example:
        >>> from posttrain.policy_loss import PolicyLoss
        >>> loss_fn = ContractAsNemoLoss(lambda p: PolicyLoss(p, kl_coef=0.01))
        >>> loss_fn.loss_type, loss_fn.input_type
        ('token_level', 'logprob')
    """

    def __init__(
        self,
        make_loss: Callable[[Any], Any],
        *,
        loss_type: str = "token_level",
        layout: Layout = LLM_LAYOUT_V1,
        metrics: Callable[..., Mapping[str, float]] | None = None,
    ) -> None:
        if loss_type not in ("token_level", "sequence_level"):
            raise ValueError(
                f"loss_type: expected 'token_level' or 'sequence_level', found {loss_type!r}"
            )
        self.make_loss = make_loss
        self.loss_type = _enum("LossType", loss_type)
        self.input_type = _enum("LossInputType", "logprob")
        self._level = loss_type
        self.layout = layout
        self.metrics = metrics

    def __call__(
        self,
        next_token_logprobs: torch.Tensor | None = None,
        data: Mapping[str, Any] | None = None,
        global_valid_seqs: torch.Tensor | float | None = None,
        global_valid_toks: torch.Tensor | float | None = None,
        **kwargs: Any,
    ) -> tuple[torch.Tensor, dict[str, Any]]:
        """NeMo-RL's call; returns ``(loss, metrics)`` normalized by the global counts."""
        if next_token_logprobs is None or data is None:
            raise TypeError("expected next_token_logprobs= and data= (input_type 'logprob')")
        if global_valid_seqs is None or global_valid_toks is None:
            raise TypeError("expected global_valid_seqs= and global_valid_toks=")
        d = dict(getattr(data, "data", data))
        missing = [k for k in _LOSS_DATA_KEYS if k not in d]
        if "prev_logprobs" not in d and "generation_logprobs" not in d:
            missing.append("prev_logprobs")
        if missing:
            raise NemoFormatError(
                f"data: missing {missing}; NeMo-RL's loss data holds input_ids, token_mask, "
                "advantages and prev_logprobs (or generation_logprobs) [B, S] and sample_mask "
                f"[B]; found {sorted(d)}"
            )
        ids = d["input_ids"]
        b, s = ids.shape
        if tuple(next_token_logprobs.shape) != (b, s - 1):
            raise ValueError(
                f"next_token_logprobs: expected [{b}, {s - 1}] (input_ids [{b}, {s}] minus the "
                f"first position), found {list(next_token_logprobs.shape)}"
            )
        td = self._layout_batch(d)
        seqs, toks = global_counts(d)
        loss_module = self.make_loss(_GivenLogProbs(next_token_logprobs))
        if _takes_counts(loss_module):
            # The loss normalizes by NeMo-RL's global counts itself: sequences are
            # sum(sample_mask) (a sampled row without a token counts, as in NeMo-RL).
            counts = GlobalCounts(_whole(global_valid_toks), _whole(global_valid_seqs))
            out = loss_module(td, counts=counts)
            terms = {k: v for k, v in out.items() if isinstance(k, str) and k.startswith("loss_")}
            loss = torch.stack([v.reshape(()) for v in terms.values()]).sum()
            metrics: dict[str, Any] = {"loss": float(loss.detach())}
            for k, v in out.items():
                if isinstance(k, str) and isinstance(v, torch.Tensor) and v.numel() == 1:
                    metrics[k] = float(v.detach())
            if self.metrics is not None:
                metrics.update(self.metrics(loss_module, td, counts, out, d))
            metrics["num_valid_samples"] = float(seqs)
            return loss, metrics
        out = loss_module(td)
        terms = {k: v for k, v in out.items() if isinstance(k, str) and k.startswith("loss_")}
        loss = torch.stack([v.reshape(()) for v in terms.values()]).sum()
        # The wrapped loss averages over its own sequences holding a valid token (a sample
        # without one weighs nothing): rescaling by that count over NeMo-RL's global one gives
        # NeMo-RL's sum over sequences / global_valid_seqs, whichever rows it counts.
        with_tokens = ((d["token_mask"][:, 1:] > 0) & (d["sample_mask"] > 0)[:, None]).any(-1)
        local, total = (
            (toks, global_valid_toks)
            if self._level == "token_level"
            else (with_tokens.sum().float(), global_valid_seqs)
        )
        scale = local / torch.as_tensor(total, dtype=torch.float32).clamp_min(1e-8)
        # Metrics are token means in NeMo-RL whatever the loss type (masked_mean over tokens
        # with global_normalization_factor=global_valid_toks).
        tok_scale = toks / torch.as_tensor(global_valid_toks, dtype=torch.float32).clamp_min(1e-8)
        metrics = {"loss": float((loss * scale).detach())}
        for k in ("clip_fraction", "kl_approx", "kl_to_ref", *terms):
            if k in out.keys():  # noqa: SIM118 - a TensorDict's `in` is not its keys
                s = scale if k.startswith("loss_") else tok_scale
                metrics[k] = float((out.get(k) * s).detach())
        metrics["num_valid_samples"] = float(seqs)
        return loss * scale, metrics

    def _layout_batch(self, d: Mapping[str, Any]) -> TensorDict:
        ids = d["input_ids"]
        b, s = ids.shape
        sm = d["sample_mask"]
        mask = d["token_mask"].bool() & (sm > 0)[:, None]
        # NeMo-RL's PPO ratio is taken against prev_logprobs (the training policy's at
        # rollout time); the sampler's generation_logprobs travel apart, for the
        # importance-sampling correction and the mismatch metrics.
        behaviour = d.get("prev_logprobs", d.get("generation_logprobs"))
        k = self.layout.key
        fields: dict[Any, torch.Tensor] = {
            # Token ids are all 0: the stand-in policy's log-prob of token 0 is the given one.
            k("tokens"): torch.zeros_like(ids, dtype=torch.int64),
            k("attention_mask"): torch.ones(b, s, dtype=torch.bool),
            k("assistant_mask"): mask,
            k("sample_log_probs"): _f(behaviour),
            k("advantage"): _f(d["advantages"]),
        }
        if "generation_logprobs" in d:
            fields[GENERATION_KEY] = _f(d["generation_logprobs"])
        ref = d.get("reference_policy_logprobs")
        if ref is not None:
            fields[k("ref_log_probs")] = _f(ref)
        if "rewards" in d:
            fields[k("reward")] = _f(torch.as_tensor(d["rewards"]))
        return TensorDict(fields, batch_size=[b])


class NemoLossModule(torch.nn.Module):
    """A NeMo-RL ``LossFunction`` as a ``LossModuleV1`` over ``policy`` (one microbatch).

    Each call converts the layout batch with :func:`from_layout`, computes the policy's
    next-token log-probs (or passes logits, for ``input_type`` "logit"), counts valid
    sequences and tokens in this batch (the global counts of a single microbatch on a single
    rank), and returns ``loss_objective`` = NeMo-RL's loss plus its numeric metrics.

    Example:
        >>> from posttrain.policy_loss import PolicyLoss
        >>> from posttrain.testing import tiny_causal_lm
        >>> from posttrain.testing import llm_batch
        >>> module = NemoLossModule(ContractAsNemoLoss(PolicyLoss), tiny_causal_lm())
        >>> module(llm_batch(2, 6, vocab_size=64))["loss_objective"].shape
        torch.Size([])
    """

    def __init__(self, loss_fn: Any, policy: Any, *, layout: Layout = LLM_LAYOUT_V1) -> None:
        super().__init__()
        self.loss_fn = loss_fn
        self.policy = policy
        self.layout = layout

    def forward(self, td: TensorDictBase, *, counts: GlobalCounts | None = None) -> TensorDict:
        """NeMo-RL's loss of the policy on ``td`` (never mutated).

        ``counts``: the global batch's, passed as ``global_valid_toks`` and
        ``global_valid_seqs`` (capability ``global_counts``); default ``GlobalCounts.of(td)``,
        whose sequences are the rows holding an assistant token (posttrain's rule: NeMo-RL's
        ``sample_mask`` sum would count a row without one).
        """
        if counts is not None and not isinstance(counts, GlobalCounts):
            raise TypeError(f"counts: expected a GlobalCounts, found {type(counts).__name__}")
        self.layout.validate_batch(
            td,
            require=("sample_log_probs", "advantage"),
            ragged=isinstance(td, LazyStackedTensorDict),
            context="NemoLossModule",
        )
        data = dict(getattr(from_layout(td, layout=self.layout), "data", None) or {})
        if not data:
            data = dict(from_layout(td, layout=self.layout))
        attn = torch.arange(data["input_ids"].shape[1]) < data["input_lengths"][:, None]
        logits = self.policy(input_ids=data["input_ids"], attention_mask=attn.long()).logits
        c = counts if counts is not None else GlobalCounts.of(td, layout=self.layout)
        kind = str(getattr(self.loss_fn.input_type, "value", self.loss_fn.input_type))
        inputs: dict[str, Any]
        if kind == "logprob":
            inputs = {"next_token_logprobs": token_log_probs(logits, data["input_ids"])[:, 1:]}
        elif kind == "logit":
            inputs = {"logits": logits}
        else:
            raise ValueError(f"input_type: expected 'logprob' or 'logit', found {kind!r}")
        loss, metrics = self.loss_fn(
            data=data,
            global_valid_seqs=torch.tensor(float(c.sequences)),
            global_valid_toks=torch.tensor(float(c.tokens)),
            **inputs,
        )
        out: dict[str, torch.Tensor] = {"loss_objective": loss.reshape(())}
        for k, v in metrics.items():
            numeric = isinstance(v, int | float) and math.isfinite(float(v))
            if k != "loss" and not k.startswith("loss_") and numeric:
                out[k] = torch.tensor(float(v))
        return TensorDict(out, batch_size=[])


def nemo_loss_module(policy: Any, aggregation: str = "token_mean", **overrides: Any) -> Any:
    """The conformance factory of the round trip: reference loss -> NeMo-RL -> ``LossModuleV1``.

    posttrain's ``PolicyLoss`` (clip 0.2, k3 KL 0.01, as NeMo-RL's default
    ``ClippedPGLossConfig``) wrapped as a NeMo-RL ``LossFunction``, wrapped back as a
    ``LossModuleV1``: the loss suite then checks that both wrappers keep every property.

    Example:
        >>> from posttrain.testing import tiny_causal_lm
        >>> type(nemo_loss_module(tiny_causal_lm())).__name__
        'NemoLossModule'
    """
    if aggregation not in LOSS_TYPES:
        raise ValueError(
            f"aggregation: expected one of {sorted(LOSS_TYPES)} (NeMo-RL's loss types), "
            f"found {aggregation!r}"
        )
    opts = {"kl_coef": 0.01, **overrides}
    PolicyLoss(policy, aggregation=aggregation, **opts)  # unknown options fail here

    def make(p: Any) -> Any:
        return PolicyLoss(p, aggregation=aggregation, **opts)

    return NemoLossModule(ContractAsNemoLoss(make, loss_type=LOSS_TYPES[aggregation]), policy)


def clipped_pg_loss(cfg: Mapping[str, Any] | None = None) -> ContractAsNemoLoss:
    """NeMo-RL's ``ClippedPGLossFn(cfg)`` built from posttrain's ``PolicyLoss``.

    Called as NeMo-RL calls its loss (``next_token_logprobs=``, ``data=``,
    ``global_valid_seqs=``, ``global_valid_toks=``); returns NeMo-RL's loss, gradient and
    metrics (:func:`clipped_pg_metrics`: ``token_mult_prob_error``, ``kl_penalty``,
    ``probs_ratio``, ...). ``data`` needs ``generation_logprobs`` as well as
    ``prev_logprobs``.

    Example:
        >>> loss_fn = clipped_pg_loss({"use_importance_sampling_correction": True})
        >>> loss_fn.loss_type, loss_fn.input_type
        ('token_level', 'logprob')
    """
    opts, level = clipped_pg_options(cfg or {})
    return ContractAsNemoLoss(
        lambda p: PolicyLoss(p, opts), loss_type=level, metrics=clipped_pg_metrics
    )


class SupervisedAsNemoLoss:
    """posttrain's ``NLLLoss`` or ``DPOLoss`` as NeMo-RL's ``NLLLossFn`` / ``DPOLossFn``.

    Built by :func:`nll_loss` and :func:`dpo_loss`. NeMo-RL's data becomes an LLM-layout
    batch (assistant mask ``token_mask * sample_mask``; DPO's ``reference_policy_logprobs``
    are next-token aligned in NeMo-RL, ``[:, :-1]``, and move one position right), the policy
    returns ``next_token_logprobs`` exactly, and the loss is normalized by NeMo-RL's global
    counts.

    Example:
        >>> nll_loss().loss_type, dpo_loss().loss_type
        ('token_level', 'sequence_level')
    """

    def __init__(self, make_loss: Callable[[Any], Any], *, kind: str) -> None:
        self.make_loss = make_loss
        self.kind = kind
        level = "token_level" if kind == "nll" else "sequence_level"
        self.loss_type = _enum("LossType", level)
        self.input_type = _enum("LossInputType", "logprob")

    def __call__(
        self,
        next_token_logprobs: torch.Tensor,
        data: Mapping[str, Any],
        global_valid_seqs: torch.Tensor | float,
        global_valid_toks: torch.Tensor | float,
    ) -> tuple[torch.Tensor, dict[str, Any]]:
        """NeMo-RL's call; returns ``(loss, metrics)``."""
        d = dict(getattr(data, "data", data))
        need = ["input_ids", "token_mask", "sample_mask"]
        need += ["reference_policy_logprobs"] if self.kind == "dpo" else []
        missing = [k for k in need if k not in d]
        if missing:
            raise NemoFormatError(f"data: missing {missing}; found {sorted(d)}")
        ids = d["input_ids"]
        b, s = ids.shape
        mask = d["token_mask"].bool() & (d["sample_mask"] > 0)[:, None]
        k = LLM_LAYOUT_V1.key
        fields: dict[Any, torch.Tensor] = {
            k("tokens"): torch.zeros_like(ids, dtype=torch.int64),
            k("attention_mask"): torch.ones(b, s, dtype=torch.bool),
            k("assistant_mask"): mask,
        }
        if self.kind == "dpo":
            ref = _f(d["reference_policy_logprobs"])
            fields[k("ref_log_probs")] = torch.cat([torch.zeros_like(ref[:, :1]), ref[:, :-1]], 1)
        td = TensorDict(fields, batch_size=[b])
        counts = GlobalCounts(_whole(global_valid_toks), _whole(global_valid_seqs))
        out = self.make_loss(_GivenLogProbs(next_token_logprobs))(td, counts=counts)
        terms = [v for key, v in out.items() if isinstance(key, str) and key.startswith("loss_")]
        loss = torch.stack(terms).sum()
        metrics: dict[str, Any] = {"loss": float(loss.detach())}
        for key, v in out.items():
            if not key.startswith("loss_"):
                metrics[key] = float(v)
        sm = d["sample_mask"].float()
        metrics["num_valid_samples"] = float(sm.sum() / (2 if self.kind == "dpo" else 1))
        return loss, metrics


def nll_loss() -> SupervisedAsNemoLoss:
    """NeMo-RL's ``NLLLossFn()`` built from posttrain's ``NLLLoss``.

    Example:
        >>> nll_loss().input_type
        'logprob'
    """
    from posttrain.reference_impls.nll_loss import NLLLoss

    return SupervisedAsNemoLoss(lambda p: NLLLoss(p), kind="nll")


def dpo_loss(cfg: Mapping[str, Any] | None = None) -> SupervisedAsNemoLoss:
    """NeMo-RL's ``DPOLossFn(DPOLossConfig(**cfg))`` built from posttrain's ``DPOLoss``.

    Example:
        >>> dpo_loss({"sft_loss_weight": 0.1}).kind
        'dpo'
    """
    from posttrain.reference_impls.dpo_loss import DPOLoss

    c = dict(cfg or {})
    unknown = sorted(set(c) - set(DPO_DEFAULTS))
    if unknown:
        raise ValueError(f"DPOLossConfig: unknown keys {unknown}")
    c = {**DPO_DEFAULTS, **c}
    opts = {
        "beta": c["reference_policy_kl_penalty"],
        "preference_weight": c["preference_loss_weight"],
        "sft_weight": c["sft_loss_weight"],
        "preference_average": c["preference_average_log_probs"],
        "sft_average": c["sft_average_log_probs"],
    }
    return SupervisedAsNemoLoss(lambda p: DPOLoss(p, **opts), kind="dpo")
