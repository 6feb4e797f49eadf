"""ROLL-002: a prompt token equal to the tokenizer's pad id is dropped: TransformersWrapper in
token mode derives the prompt's attention mask as tokens != pad_token_id, so the model never
sees the token and the batch's prompt is not the one given.
"""

import tensordict

from posttrain.adapters.torchrl.rollout import (
    llm_collector,  # LLMCollector(TransformersWrapper(model))
)
from posttrain.testing import tiny_causal_lm

tensordict.set_list_to_stack(True).set()
model = tiny_causal_lm()  # pad id 0, eos 2: token 0 is a token of the vocabulary like any other
src = llm_collector(model, [[5, 0, 7], [0, 8]], None, max_new_tokens=2)
td = next(iter(src.collector))
assert [p.tolist() for p in td.get(("tokens", "prompt"), as_list=True)] == [[5, 7], [8]]
src.shutdown()
