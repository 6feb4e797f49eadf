"""LOSS-023, LOSS-021: CISPOLoss computes -A·clip(r) with the gradient through the clip, not
CISPO's -A·sg(clip(r))·log pi: a token whose ratio leaves [1 - ε_low, 1 + ε_high] gets no
gradient at all (CISPO keeps -A·clip(r)·d log pi for it), and the loss value is PPO's ratio
term, not the weighted log-likelihood.
"""

import torch
from torchrl.objectives.llm import CISPOLoss

from posttrain.adapters.torchrl.loss import to_torchrl_layout, transformers_actor
from posttrain.testing import llm_batch, tiny_causal_lm

policy = tiny_causal_lm()
loss = CISPOLoss(transformers_actor(policy), masking_strategy="rlhf")  # clip_epsilon=0.2
td = llm_batch(4, 10, vocab_size=64)
asst = td.get(("masks", "all_assistant_mask"))
# Behaviour log-probs of -30: every token's ratio exp(log pi + 30) is far above 1.2.
td.set(("log_probs", "full"), torch.where(asst, -30.0, float("nan")))
out = loss(to_torchrl_layout(td))
adv = td.get("advantage")[:, None].expand_as(asst)[asst]  # A of each assistant token
# The value is -1.2 x the token mean of A, whatever the policy (CISPO: -1.2 x mean of A log pi).
assert torch.isclose(out.loss_objective, -1.2 * adv.mean())
out.loss_objective.backward()
grads = [p.grad for p in policy.parameters()]
# No gradient reaches the policy (CISPO: -1.2 x A x d log pi for every token).
assert all(g is None or not g.any() for g in grads)
