"""ROLL-007: once its declared total is spent, a shut-down LLMCollector answers a new iteration
with an empty one (StopIteration) instead of an error; without a total it raises.

Repro: the rollout suite's ROLL-007 (a source with a total of 2 run to its end, shut down).
"""

import tensordict

from posttrain.adapters.torchrl.rollout import llm_collector  # LLMCollector + TransformersWrapper
from posttrain.testing import tiny_causal_lm

tensordict.set_list_to_stack(True).set()
src = llm_collector(tiny_causal_lm(), [[5, 6, 7], [8, 9]], 1, max_new_tokens=2)
collector = src.collector  # torchrl.collectors.llm.LLMCollector(..., total_dialog_turns=2)
assert sum(1 for _ in collector) == 1  # the declared total: one batch
collector.shutdown()
collector.shutdown()
try:
    left = list(collector)
except Exception:
    raise SystemExit("raised: the deviation is fixed") from None
assert left == []  # iterating after shutdown() ended silently

endless = llm_collector(tiny_causal_lm(), [[5, 6, 7]], None, max_new_tokens=2).collector
next(iter(endless))
endless.shutdown()
try:
    next(iter(endless))
    raise SystemExit("yielded a batch after shutdown()")
except StopIteration:
    raise SystemExit("stopped: the deviation is wider") from None
except AttributeError:
    pass  # without a total it raises ('LLMCollector' object has no attribute 'env')
