"""posttrain's contracts: Protocols, key contracts and requirement catalogues (v1).

Depends on torch, tensordict and pydantic only; everything else in posttrain imports from here,
never the other way round.

Example:
    >>> from posttrain.contracts import CONTRACTS, LLM_LAYOUT_V1
    >>> sorted(CONTRACTS)
    ['buffer', 'generation', 'loss', 'metrics', 'rollout', 'weight_sync']
    >>> LLM_LAYOUT_V1.key("assistant_mask")
    ('masks', 'all_assistant_mask')
"""

from posttrain.contracts.alignment import token_log_probs
from posttrain.contracts.buffer import (
    BUFFER,
    ReplayBufferV1,
    SupportsCheckpoint,
    SupportsPriority,
    SupportsRead,
)
from posttrain.contracts.contract import Capability, Contract, DeclarationError, Option
from posttrain.contracts.generation import GENERATION, GenerationClientV1, GenerationServerV1
from posttrain.contracts.implementation import Implementation
from posttrain.contracts.layout import LLM_LAYOUT_V1, Key, Layout, LayoutField, key_str, norm_key
from posttrain.contracts.loss import AGGREGATIONS, LOSS, LossModuleV1, LossOutput
from posttrain.contracts.metrics import METRIC_NAME, METRICS, MetricSinkV1
from posttrain.contracts.registry import CONTRACTS, get_contract
from posttrain.contracts.requirements import Level, Requirement
from posttrain.contracts.rollout import ROLLOUT, RolloutSourceV1
from posttrain.contracts.validation import (
    LAYOUT_REQUIREMENTS,
    ContractViolation,
    Violation,
    check,
    validate,
)
from posttrain.contracts.weight_sync import WEIGHT_SYNC, WeightReceiverV1, WeightSenderV1

__all__ = [
    "AGGREGATIONS",
    "BUFFER",
    "CONTRACTS",
    "GENERATION",
    "LAYOUT_REQUIREMENTS",
    "LLM_LAYOUT_V1",
    "LOSS",
    "METRICS",
    "METRIC_NAME",
    "ROLLOUT",
    "WEIGHT_SYNC",
    "Capability",
    "Contract",
    "ContractViolation",
    "DeclarationError",
    "GenerationClientV1",
    "GenerationServerV1",
    "Implementation",
    "Key",
    "Layout",
    "LayoutField",
    "Level",
    "LossModuleV1",
    "LossOutput",
    "MetricSinkV1",
    "Option",
    "ReplayBufferV1",
    "Requirement",
    "RolloutSourceV1",
    "SupportsCheckpoint",
    "SupportsPriority",
    "SupportsRead",
    "Violation",
    "WeightReceiverV1",
    "WeightSenderV1",
    "check",
    "get_contract",
    "key_str",
    "norm_key",
    "token_log_probs",
    "validate",
]
