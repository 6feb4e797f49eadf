"""ROLL-001: when the tokenizer's pad token is its EOS token (as in many real tokenizers), the EOS
that ends a response is taken for padding (masks are tokens != pad_token_id) and dropped from
the response and the masks.
"""

import tensordict

from posttrain.adapters.torchrl.rollout import (
    llm_collector,  # LLMCollector(TransformersWrapper(model))
)
from posttrain.conformance.suites.rollout import scripted_weights
from posttrain.testing import tiny_causal_lm

tensordict.set_list_to_stack(True).set()
model = tiny_causal_lm()
model.load_state_dict(scripted_weights(model, 0))  # after token 9: token 20, then EOS (2)
model.config.pad_token_id = model.generation_config.pad_token_id = model.config.eos_token_id
src = llm_collector(model, [[8, 9]], None, max_new_tokens=4)  # the tokenizer's pad is EOS too
td = next(iter(src.collector))
assert td.get(("tokens", "response"), as_list=True)[0].tolist() == [20]  # generated: [20, 2]
assert td.get(("tokens", "full"), as_list=True)[0].tolist() == [8, 9, 20]
src.shutdown()
