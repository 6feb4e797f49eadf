"""ROLL-004: a plain state dict (documented as accepted: 'dict: A regular dict containing weights')
fails with AttributeError.
"""

import tensordict

from posttrain.adapters.torchrl.rollout import llm_collector  # LLMCollector + TransformersWrapper
from posttrain.testing import tiny_causal_lm

tensordict.set_list_to_stack(True).set()
model = tiny_causal_lm()
src = llm_collector(model, [[5, 6, 7], [8, 9]], None, max_new_tokens=4)
collector = src.collector  # torchrl.collectors.llm.LLMCollector(..., track_policy_version=True)
next(iter(src))
try:
    collector.update_policy_weights_(model.state_dict())
    raise SystemExit("accepted: the deviation is fixed")
except AttributeError as e:
    assert "'data'" in str(e)  # 'collections.OrderedDict' object has no attribute 'data'
assert collector.policy_version == 0
