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

from posttrain.adapters._layout import token_inputs
from posttrain.contracts.loss import GlobalCounts

OPENRLHF_INSTALL = "pip install --no-deps openrlhf==0.11.2"
OPENRLHF_AGGREGATIONS = {"token_mean": True, "seq_mean_token_mean": False}
"""Contract aggregation -> PolicyLoss's ``token_level_loss`` (OpenRLHF has these two)."""

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
        x = token_inputs(
            td,
            counts,
            adapted=self.adapted,
            batch_info=global_batch_info,
            context="OpenRLHF PolicyLoss",
        )
        loss, clip_ratio, ppo_kl, _, _ = self.loss(
            x.log_probs(self.policy),
            x.old_log_probs,
            x.advantage,
            action_mask=x.mask.float(),
            **x.batch_info,
        )
        out = {"loss_objective": loss.reshape(())}
        if not self.adapted:  # OpenRLHF's micro-batch means, as its actor logs them
            out |= {"clip_ratio": clip_ratio.detach(), "ppo_kl": ppo_kl.detach()}
        return TensorDict(out, batch_size=[])
