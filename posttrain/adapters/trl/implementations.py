"""The TRL adapters' conformance declarations (entry points in ``pyproject.toml``)."""

from __future__ import annotations

from functools import partial

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
