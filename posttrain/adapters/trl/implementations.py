"""The TRL adapters' conformance declarations (entry points in ``pyproject.toml``)."""

from __future__ import annotations

from functools import partial
from typing import Any

from posttrain.adapters.trl.source import TRLRolloutSource
from posttrain.contracts.implementation import Implementation

GRPO_ROLLOUT = Implementation(
    "rollout",
    partial(TRLRolloutSource, num_generations=2),
    name="trl.GRPOTrainer generation (TRLRolloutSource)",
    capabilities={"log_probs", "groups", "ragged"},
    description="A real GRPOTrainer's model, processing class and generation config, generating "
    "through posttrain's rollout_func (CaptureRollouts): 2 completions per prompt, ragged.",
)
"""Entry point ``trl-grpo-rollout``."""


class TRLAsUsersRunIt:
    """TRL 1.16's ``GRPOTrainer._compute_loss`` with the global counts as TRL plumbs them.

    ``counts.tokens`` becomes ``num_items_in_batch`` (what TRL's trainer gathers over the
    generation batch), one accumulation step, and nothing else: no rescaling of the loss
    types that normalize by the micro-batch itself. The batch is mapped as the adapted row
    maps it (values outside the mask zeroed, as TRL's own pipeline holds them).

    Example:
        >>> from posttrain.testing import llm_batch, tiny_causal_lm  # doctest: +SKIP
        >>> loss = TRLAsUsersRunIt(tiny_causal_lm(vocab_size=64), "dapo")  # doctest: +SKIP
        >>> loss(llm_batch(2, 8, vocab_size=64))["loss_objective"].shape  # doctest: +SKIP
        torch.Size([])
    """

    def __init__(
        self, policy: Any, loss_type: str, aggregation: str | None = None, **config: Any
    ) -> None:
        from posttrain.adapters.trl.loss import TRLGRPOLoss

        self.inner = TRLGRPOLoss(policy, loss_type, aggregation, adapted=True, **config)
        self.trainer = self.inner.trainer

    def __call__(self, td: Any, *, counts: Any = None) -> Any:
        """TRL's loss of ``td`` with ``num_items_in_batch = counts.tokens``."""
        import torch
        from tensordict import TensorDict

        from posttrain.adapters._layout import global_counts
        from posttrain.adapters.trl.loss import trl_inputs
        from posttrain.contracts.layout import LLM_LAYOUT_V1

        LLM_LAYOUT_V1.validate_batch(td, require=("sample_log_probs", "advantage"), context="TRL")
        _, c = global_counts(td, counts)
        inputs, _ = trl_inputs(td, zero_outside=True)
        inputs["num_items_in_batch"] = torch.tensor(float(c.tokens))
        loss = self.trainer._compute_loss(self.inner.policy, inputs)
        return TensorDict({"loss_objective": loss.reshape(())}, batch_size=[])


def _cispo_default(policy: Any, aggregation: str | None = None, **config: Any) -> Any:
    from posttrain.adapters.trl.loss import TRLGRPOLoss

    return TRLGRPOLoss(policy, "cispo", aggregation, adapted=True, **config)


def _dapo_bf16(policy: Any, aggregation: str | None = None, **config: Any) -> Any:
    from posttrain.adapters.trl.loss import TRLGRPOLoss

    return TRLGRPOLoss(policy, "dapo", aggregation, adapted=True, bf16=True, **config)


def _users_loss(policy: Any, loss_type: str, aggregation: str, **config: Any) -> Any:
    return TRLAsUsersRunIt(policy, loss_type, aggregation, **config)


def _loss_rows() -> dict[str, Implementation]:
    """The TRL loss rows beyond ``posttrain.adapters.trl.loss.ROWS``: cispo at TRL's defaults
    and the ``trl-users-*`` rows (TRL imported lazily)."""
    from posttrain.adapters.trl.loss import LOSS_TYPES, MAX_COMPLETION_LENGTH, RATIOS

    rows: dict[str, Implementation] = {
        "trl-adapted-cispo-default": Implementation(
            "loss",
            partial(_cispo_default, aggregation=LOSS_TYPES["cispo"]),
            name="TRLGRPOLoss(trl GRPOTrainer._compute_loss(loss_type='cispo'))",
            capabilities={"per_token_advantage", "global_counts"},
            options={"aggregation": LOSS_TYPES["cispo"], "ratio": RATIOS["cispo"]},
            extras={"t_norm": MAX_COMPLETION_LENGTH},
            description="TRL 1.16's cispo at GRPOConfig's defaults (epsilon_high unset: "
            "GRPOTrainer takes epsilon, 0.2, and clamps the ratio weight at 0.2 itself); "
            "otherwise as trl-adapted-cispo.",
            known_failures=CISPO_DEFAULT_KNOWN,
        )
    }
    rows["trl-adapted-dapo-bf16-default"] = Implementation(
        "loss",
        partial(_dapo_bf16, aggregation=LOSS_TYPES["dapo"]),
        name="TRLGRPOLoss(trl GRPOTrainer._compute_loss(loss_type='dapo', bf16=True))",
        capabilities={"per_token_advantage", "global_counts", "clip"},
        options={"aggregation": LOSS_TYPES["dapo"], "ratio": RATIOS["dapo"]},
        extras={"t_norm": MAX_COMPLETION_LENGTH, "clip_epsilon": 0.2},
        description="TRL 1.16's dapo at GRPOConfig's default bf16=True (the policy under "
        "bfloat16 autocast), checked at the suite's float32 tolerances; otherwise as "
        "trl-adapted-dapo.",
        known_failures=BF16_DEFAULT_KNOWN,
    )
    for lt in USERS:
        rows[f"trl-users-{lt}"] = Implementation(
            "loss",
            partial(_users_loss, loss_type=lt, aggregation=LOSS_TYPES[lt]),
            name=f"TRLAsUsersRunIt(trl GRPOTrainer._compute_loss(loss_type={lt!r}))",
            capabilities={"per_token_advantage", "global_counts", "clip"},
            options={"aggregation": LOSS_TYPES[lt], "ratio": RATIOS[lt]},
            extras={"t_norm": MAX_COMPLETION_LENGTH, "clip_epsilon": 0.2},
            description="TRL 1.16's loss with the global counts passed only as TRL passes "
            "them: counts.tokens as num_items_in_batch, one accumulation step, no rescaling.",
            known_failures=USERS_KNOWN[lt],
        )
    return rows


USERS = ("grpo", "bnpo", "dapo")
"""The loss types with a ``trl-users-<loss_type>`` row."""

CISPO_DEFAULT_KNOWN = frozenset({"LOSS-003", "LOSS-016", "LOSS-021"})
"""What ``trl-adapted-cispo-default`` fails, measured with TRL 1.16."""

BF16_DEFAULT_KNOWN = frozenset({"LOSS-003", "LOSS-016", "LOSS-017", "LOSS-021"})
"""What ``trl-adapted-dapo-bf16-default`` fails, measured with TRL 1.16 on CPU: bfloat16
rounding (a loss value 1e-4 off) against float32 tolerances."""

USERS_KNOWN: dict[str, frozenset[str]] = {
    "grpo": frozenset({"LOSS-003", "LOSS-016", "LOSS-017"}),
    "bnpo": frozenset({"LOSS-016", "LOSS-017"}),
    # Across gloo ranks (loss 1.9): TRL's all-gather of per-row clip ratios aborts on shards
    # of different sizes (TRLGRPOLoss pads every rank's rows to the most any holds; a loop
    # calling _compute_loss itself does not).
    "dapo": frozenset({"LOSS-017"}),
}
"""What each ``trl-users-<loss_type>`` row fails, measured with TRL 1.16."""


def __getattr__(name: str) -> Any:
    # The loss rows are made on first use: importing the rollout declaration above needs
    # nothing of TRL's loss module.
    if name == "ROWS":
        return _loss_rows()
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
