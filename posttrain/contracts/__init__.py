"""posttrain's contracts: Protocols, key contracts and requirement catalogues (v1).

Depends on torch, tensordict and pydantic only; everything else in posttrain imports from here,
never the other way round. A contract's catalogue is ``get_contract(id)``; a layout checks a
batch with ``LLM_LAYOUT_V1.validate_batch(td)`` (raises) or ``LLM_LAYOUT_V1.violations(td)`` (returns).

Example:
    >>> from posttrain.contracts import CONTRACTS, LLM_LAYOUT_V1
    >>> sorted(CONTRACTS)
    ['buffer', 'dpo_loss', 'generation', 'loss', 'metrics', 'nll_loss', 'rollout', 'weight_sync']
    >>> LLM_LAYOUT_V1.key("assistant_mask")
    ('masks', 'all_assistant_mask')
"""

from posttrain.contracts.buffer import (
    ReplayBufferV1,
    SupportsCheckpoint,
    SupportsPriority,
    SupportsRead,
)
from posttrain.contracts.contract import Contract, DeclarationError
from posttrain.contracts.generation import GenerationClientV1, GenerationServerV1
from posttrain.contracts.implementation import Implementation
from posttrain.contracts.layout import LLM_LAYOUT_V1, Layout
from posttrain.contracts.loss import (
    GlobalCounts,
    LossModuleV1,
    LossOutput,
    SupportsGlobalCounts,
)
from posttrain.contracts.metrics import MetricSinkV1
from posttrain.contracts.registry import CONTRACTS, get_contract
from posttrain.contracts.requirements import Requirement
from posttrain.contracts.rollout import RolloutSourceV1
from posttrain.contracts.validation import ContractViolation
from posttrain.contracts.weight_sync import WeightReceiverV1, WeightSenderV1

__all__ = [
    "CONTRACTS",
    "LLM_LAYOUT_V1",
    "Contract",
    "ContractViolation",
    "DeclarationError",
    "GenerationClientV1",
    "GenerationServerV1",
    "GlobalCounts",
    "Implementation",
    "Layout",
    "LossModuleV1",
    "LossOutput",
    "MetricSinkV1",
    "ReplayBufferV1",
    "Requirement",
    "RolloutSourceV1",
    "SupportsCheckpoint",
    "SupportsGlobalCounts",
    "SupportsPriority",
    "SupportsRead",
    "WeightReceiverV1",
    "WeightSenderV1",
    "get_contract",
]
