"""LOSS-015: an advantage of shape [B, 1] (TorchRL's [B, 1, 1]) is broadcast along the tokens
instead of refused.
"""

import torch
from torchrl.objectives.llm import GRPOLoss

from posttrain.adapters.torchrl.loss import to_torchrl_layout, transformers_actor
from posttrain.testing import llm_batch, tiny_causal_lm

loss = GRPOLoss(transformers_actor(tiny_causal_lm()), masking_strategy="rlhf")
td = llm_batch(4, 10, vocab_size=64)
td.set("advantage", td.get("advantage")[:, None])  # [B, 1]: neither [B] nor [B, T]
out = loss(to_torchrl_layout(td))  # accepted: broadcast to every token, no error names the key
assert torch.isfinite(out.loss_objective).all()
