"""LOSS-005, LOSS-012: entropy, clip_fraction and kl_approx are averaged over every position of the
padded batch, so padding and prompt length change them.
"""

import torch
from torchrl.objectives.llm import GRPOLoss

from posttrain.adapters.torchrl.loss import to_torchrl_layout, transformers_actor
from posttrain.testing import llm_batch, tiny_causal_lm

loss = GRPOLoss(transformers_actor(tiny_causal_lm()), masking_strategy="rlhf")
td = llm_batch(4, 10, vocab_size=64)
padded = td.apply(lambda x: torch.cat([x, x.new_zeros(4, 3)], 1) if x.ndim == 2 else x)
with torch.no_grad():
    a, b = loss(to_torchrl_layout(td)), loss(to_torchrl_layout(padded))
for name in ("entropy", "clip_fraction", "kl_approx"):
    # three padding columns shrink each by 40/52 (the share of real positions): 1.35 -> 1.04 entropy
    assert torch.isclose(b.get(name), a.get(name) * 40 / 52), name
