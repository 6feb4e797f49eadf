"""LOSS-010: the KL to the reference is averaged over every position of the padded batch, so
padding dilutes it.
"""

import torch
from torchrl.objectives.llm import GRPOLoss

from posttrain.adapters.torchrl.loss import to_torchrl_layout, transformers_actor
from posttrain.testing import llm_batch, tiny_causal_lm

ref = ("next", "ref_log_probs", "full")
loss = GRPOLoss(transformers_actor(tiny_causal_lm()), masking_strategy="rlhf", kl_to_ref_coeff=0.1)
td = llm_batch(4, 10, vocab_size=64)
td.set(ref, td.get(("log_probs", "full")) - 0.5)  # the same gap on every assistant token
padded = td.apply(lambda x: torch.cat([x, x.new_zeros(4, 3)], 1) if x.ndim == 2 else x)
with torch.no_grad():
    a = loss(to_torchrl_layout(td)).loss_kl_to_ref
    b = loss(to_torchrl_layout(padded)).loss_kl_to_ref
assert b < a  # three padding columns shrank the KL penalty (it is .mean() over positions)
