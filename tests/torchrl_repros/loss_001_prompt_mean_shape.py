"""LOSS-001: prompt_mean returns loss terms of shape [1] instead of scalars."""

# Needs an actor; with posttrain installed the suite's tiny policy is at hand:
from torchrl.objectives.llm import GRPOLoss

from posttrain.adapters.torchrl.loss import to_torchrl_layout, transformers_actor
from posttrain.testing import llm_batch, tiny_causal_lm

loss = GRPOLoss(
    transformers_actor(tiny_causal_lm()), masking_strategy="rlhf", aggregation="prompt_mean"
)
out = loss(to_torchrl_layout(llm_batch(4, 10, vocab_size=64)))
assert out.loss_objective.shape == (1,)
