"""OpenRLHF 0.11.2's ``PolicyLoss`` (``openrlhf/models/loss.py``) on the LLM layout v1.

OpenRLHF's package cannot be imported on CPU: ``openrlhf.models`` imports its actor, which
needs flash_attn, deepspeed and peft. The loss module itself needs only torch and
``masked_mean`` from ``openrlhf/models/utils.py``, whose one top-level import beyond torch is
``deepspeed`` (used by a function the loss never calls). :func:`openrlhf_loss_module` loads
those two files alone, from the installed distribution (``pip install --no-deps
openrlhf==0.11.2``), under private module names, with an empty ``deepspeed`` module standing
in while ``utils.py`` is executed; nothing of OpenRLHF's is copied.
"""

from __future__ import annotations

import importlib.util
import sys
import types
from pathlib import Path
from typing import Any

import torch
from tensordict import TensorDict, TensorDictBase

from posttrain.contracts.alignment import token_log_probs
from posttrain.contracts.layout import LLM_LAYOUT_V1
from posttrain.contracts.loss import GlobalCounts
from posttrain.contracts.validation import check

OPENRLHF_INSTALL = "pip install --no-deps openrlhf==0.11.2"
OPENRLHF_AGGREGATIONS = {"token_mean": True, "seq_mean_token_mean": False}
"""Contract aggregation -> PolicyLoss's ``token_level_loss`` (OpenRLHF has these two)."""

K = LLM_LAYOUT_V1.key
_PKG = "_posttrain_openrlhf_models"
_LOADED: dict[str, types.ModuleType] = {}


def openrlhf_loss_module() -> types.ModuleType:
    """``openrlhf/models/loss.py`` loaded alone (see the module docstring), once.

    Example:
        >>> openrlhf_loss_module().PolicyLoss.__name__  # doctest: +SKIP
        'PolicyLoss'
    """
    if "loss" in _LOADED:
        return _LOADED["loss"]
    spec = importlib.util.find_spec("openrlhf")
    if spec is None or spec.origin is None:
        raise ImportError(f"the OpenRLHF adapter needs OpenRLHF's files: {OPENRLHF_INSTALL}")
    models = Path(spec.origin).parent / "models"
    pkg = types.ModuleType(_PKG)
    pkg.__path__ = [str(models)]
    sys.modules[_PKG] = pkg
    stood_in = "deepspeed" not in sys.modules
    if stood_in:  # utils.py imports it at the top; masked_mean never uses it
        sys.modules["deepspeed"] = types.ModuleType("deepspeed")
    try:
        for name in ("utils", "loss"):
            s = importlib.util.spec_from_file_location(f"{_PKG}.{name}", models / f"{name}.py")
            if s is None or s.loader is None:
                raise ImportError(f"cannot load {models / name}.py")
            mod = importlib.util.module_from_spec(s)
            sys.modules[s.name] = mod
            s.loader.exec_module(mod)
            _LOADED[name] = mod
    finally:
        if stood_in:
            del sys.modules["deepspeed"]
    return _LOADED["loss"]


class OpenRLHFPolicyLoss(torch.nn.Module):
    """OpenRLHF's ``PolicyLoss`` as a ``LossModuleV1``.

    OpenRLHF's actor scores the action tokens; here log-probs come from the suite's policy
    over the whole row, ``action_mask`` is the assistant mask. ``adapted=False`` (the raw row)
    hands PolicyLoss the layout's tensors as they are (advantage broadcast to [B, T]), no
    global counts. ``adapted=True`` validates the batch, clears position 0 of the mask, zeroes
    values outside it and maps capability ``global_counts`` to PolicyLoss's own arguments:
    ``batch_num_tokens = counts.tokens``, ``global_batch_size = counts.sequences``,
    ``dp_size = 1``.

    Example:
        >>> from posttrain.testing import llm_batch, tiny_causal_lm  # doctest: +SKIP
        >>> loss = OpenRLHFPolicyLoss(tiny_causal_lm(vocab_size=64))  # doctest: +SKIP
        >>> loss(llm_batch(2, 8, vocab_size=64))["loss_objective"].shape  # doctest: +SKIP
        torch.Size([])
    """

    def __init__(
        self,
        policy: Any,
        aggregation: str = "token_mean",
        *,
        adapted: bool = True,
        ratio: str | None = None,
        **options: Any,
    ) -> None:
        super().__init__()
        mod = openrlhf_loss_module()
        own = "sequence" if options.get("policy_loss_type") == "gspo" else "token"
        if adapted and ratio is not None and ratio != own:
            raise ValueError(f"ratio: this PolicyLoss's surrogate is {own!r}, found {ratio!r}")
        if adapted and aggregation not in OPENRLHF_AGGREGATIONS:
            raise ValueError(
                f"aggregation: expected one of {sorted(OPENRLHF_AGGREGATIONS)}, found {aggregation!r}"
            )
        self.policy = policy
        self.adapted = adapted
        token_level = OPENRLHF_AGGREGATIONS.get(aggregation, True)
        self.loss = mod.PolicyLoss(token_level_loss=token_level, **options)

    def forward(
        self,
        td: TensorDictBase,
        *,
        counts: GlobalCounts | None = None,
        global_batch_info: dict[str, Any] | None = None,
    ) -> TensorDict:
        """PolicyLoss of ``td`` (never mutated), as a part of the batch ``counts`` describes.

        ``global_batch_info`` (raw row only): PolicyLoss's own ``batch_num_tokens``,
        ``global_batch_size`` and ``dp_size``, as OpenRLHF's actor passes them; default: none.
        """
        if self.adapted:
            check(td, require=("sample_log_probs", "advantage"), context="OpenRLHF PolicyLoss")
            if global_batch_info is not None:
                raise TypeError("global_batch_info: the adapted row takes counts=GlobalCounts")
            if counts is not None and not isinstance(counts, GlobalCounts):
                raise TypeError(f"counts: expected a GlobalCounts, found {type(counts).__name__}")
        elif counts is not None:
            raise TypeError("counts: the raw OpenRLHF row takes no global counts")
        tokens, att = td.get(K("tokens")), td.get(K("attention_mask"))
        mask = td.get(K("assistant_mask"))
        old, adv = td.get(K("sample_log_probs")), td.get(K("advantage"))
        if adv.ndim == tokens.ndim - 1:
            adv = adv[..., None].expand_as(old)
        kwargs: dict[str, Any] = dict(global_batch_info or {})
        if self.adapted:
            own = GlobalCounts.of(td)
            c = counts if counts is not None else own
            if own.tokens > c.tokens or own.sequences > c.sequences:
                raise ValueError(
                    f"counts: this batch alone holds {own.tokens} assistant tokens in "
                    f"{own.sequences} sequences, more than the global {c}"
                )
            mask = mask & att
            mask = torch.cat([torch.zeros_like(mask[..., :1]), mask[..., 1:]], dim=-1)
            old = torch.where(mask, old.float(), 0.0)
            adv = torch.where(mask, adv.float(), 0.0)
            kwargs = {"dp_size": 1, "batch_num_tokens": c.tokens, "global_batch_size": c.sequences}
        logits = self.policy(input_ids=tokens, attention_mask=att.long()).logits
        logp = token_log_probs(logits, tokens)
        if self.adapted:
            logp = torch.where(mask, logp, 0.0)
        loss, clip_ratio, ppo_kl, _, _ = self.loss(
            logp, old, adv, action_mask=mask.float(), **kwargs
        )
        out = {"loss_objective": loss.reshape(())}
        if not self.adapted:  # OpenRLHF's micro-batch means, as its actor logs them
            out |= {"clip_ratio": clip_ratio.detach(), "ppo_kl": ppo_kl.detach()}
        return TensorDict(out, batch_size=[])
