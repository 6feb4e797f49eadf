"""Test data builders: the batches and tiny policies the conformance suites use, for your tests.

An implementer testing a buffer, loss or rollout source beside the kit builds the same inputs
the suites build: LLM-layout batches whose items carry unique ids (``llm_batch``,
``ragged_llm_batch``, read back with ``item_uids``) and seeded one-layer Hugging Face models
(``tiny_causal_lm``, ``tiny_reward_model``; ``forced_token_weights`` makes one emit a chosen
token). The layout itself is :data:`posttrain.contracts.LLM_LAYOUT_V1`.

Example:
    >>> from posttrain.testing import item_uids, llm_batch
    >>> item_uids(llm_batch(2, uid_start=4))
    [4, 5]
"""

from posttrain.testing.batches import PROMPT_LEN, item_uids, llm_batch, ragged_llm_batch
from posttrain.testing.policies import forced_token_weights, tiny_causal_lm, tiny_reward_model

__all__ = [
    "PROMPT_LEN",
    "forced_token_weights",
    "item_uids",
    "llm_batch",
    "ragged_llm_batch",
    "tiny_causal_lm",
    "tiny_reward_model",
]
