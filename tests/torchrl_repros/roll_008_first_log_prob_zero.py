"""ROLL-008: the log-prob of the first generated token is set to 0 (_log_probs_generate:
log_probs[:, 0] = 0).
"""

import torch
from tensordict import TensorDict, lazy_stack
from torchrl.modules.llm import TransformersWrapper
from torchrl.modules.llm.policies import Tokens

from posttrain.adapters.torchrl.rollout import word_level_tokenizer  # a local WordLevel tokenizer
from posttrain.testing import tiny_causal_lm  # a 1-layer Llama built from a config

model = tiny_causal_lm()
gen = TransformersWrapper(
    model,
    tokenizer=word_level_tokenizer(model.config),
    input_mode="tokens",
    return_log_probs=True,
    pad_output=False,
    generate_kwargs={"max_new_tokens": 3, "do_sample": False},
)
out = gen(lazy_stack([TensorDict(tokens=Tokens(prompt=torch.tensor([5, 6, 7])), batch_size=())]))
full = out[0]["tokens", "full"]
with torch.no_grad():
    logp = model(full[None]).logits[0].log_softmax(-1)[:-1].gather(-1, full[1:, None])[:, 0]
returned = out[0]["log_probs", "response"]
assert returned[0] == 0.0 and logp[2] < -1.0  # first response token: 0 instead of log p
assert torch.allclose(returned[1:], logp[3:])  # the later ones are right
