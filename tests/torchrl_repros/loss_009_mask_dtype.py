"""LOSS-009: a mask of the wrong dtype is not refused by name: a float assistant mask fails on '~'
naming no key, an int64 attention mask is accepted.
"""

import torch
from torchrl.objectives.llm import GRPOLoss

from posttrain.adapters.torchrl.loss import to_torchrl_layout, transformers_actor
from posttrain.testing import llm_batch, tiny_causal_lm

loss = GRPOLoss(transformers_actor(tiny_causal_lm()), masking_strategy="rlhf")
td = llm_batch(4, 10, vocab_size=64)
bad = td.clone()
bad.set(("masks", "all_assistant_mask"), td.get(("masks", "all_assistant_mask")).float())
try:
    loss(to_torchrl_layout(bad))
    raise SystemExit("a float assistant mask was accepted: a different deviation")
except TypeError as e:
    assert "assistant" not in str(e)  # "~ (operator.invert) is only implemented on integer ..."
bad = td.clone()
bad.set(("masks", "all_attention_mask"), td.get(("masks", "all_attention_mask")).long())
out = loss(to_torchrl_layout(bad))  # accepted: no error names the key or the dtype
assert torch.isfinite(out.loss_objective).all()
