"""posttrain's contracts: Protocols, key contracts and requirement catalogues (v1).

Depends on torch, tensordict and pydantic only; everything else in posttrain imports from here,
never the other way round. A contract's catalogue is ``get_contract(id)``; a layout checks a
batch with ``LLM_LAYOUT_V1.check(td)`` (raises) or ``LLM_LAYOUT_V1.violations(td)`` (returns).

Example:
    >>> from posttrain.contracts import CONTRACTS, LLM_LAYOUT_V1
    >>> sorted(CONTRACTS)
    ['buffer', 'dpo_loss', 'generation', 'loss', 'metrics', 'nll_loss', 'rollout', 'weight_sync']
    >>> LLM_LAYOUT_V1.key("assistant_mask")
    ('masks', 'all_assistant_mask')
"""

from typing import TYPE_CHECKING, Any

from posttrain._deprecated import deprecated_attr
from posttrain.contracts.alignment import token_log_probs
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
    AGGREGATIONS,
    GlobalCounts,
    LossModuleV1,
    LossOutput,
    SupportsGlobalCounts,
)
from posttrain.contracts.metrics import MetricSinkV1
from posttrain.contracts.registry import CONTRACTS, get_contract
from posttrain.contracts.requirements import Requirement
from posttrain.contracts.rollout import RolloutSourceV1
from posttrain.contracts.validation import ContractViolation, Violation
from posttrain.contracts.weight_sync import WeightReceiverV1, WeightSenderV1

if TYPE_CHECKING:  # the deprecated names below, typed for code that still uses them
    from posttrain.contracts.buffer import BUFFER as BUFFER
    from posttrain.contracts.contract import Capability as Capability
    from posttrain.contracts.contract import Option as Option
    from posttrain.contracts.generation import GENERATION as GENERATION
    from posttrain.contracts.layout import Key as Key
    from posttrain.contracts.layout import LayoutField as LayoutField
    from posttrain.contracts.layout import key_str as key_str
    from posttrain.contracts.layout import norm_key as norm_key
    from posttrain.contracts.loss import LOSS as LOSS
    from posttrain.contracts.metrics import METRIC_NAME as METRIC_NAME
    from posttrain.contracts.metrics import METRICS as METRICS
    from posttrain.contracts.requirements import Level as Level
    from posttrain.contracts.rollout import ROLLOUT as ROLLOUT
    from posttrain.contracts.validation import LAYOUT_REQUIREMENTS as LAYOUT_REQUIREMENTS
    from posttrain.contracts.validation import check as check
    from posttrain.contracts.validation import validate as validate
    from posttrain.contracts.weight_sync import WEIGHT_SYNC as WEIGHT_SYNC

__all__ = [
    "AGGREGATIONS",
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
    "Violation",
    "WeightReceiverV1",
    "WeightSenderV1",
    "get_contract",
    "token_log_probs",
]


def _contract(cid: str, const: str) -> tuple[str, str]:
    return f"posttrain.contracts.{cid}:{const}", f"use get_contract({cid!r})"


_MOVED = {
    "check": (
        "posttrain.contracts.validation:check",
        "use Layout.check: LLM_LAYOUT_V1.check(td, ...) raises the same ContractViolation",
    ),
    "validate": (
        "posttrain.contracts.validation:validate",
        "use Layout.violations: LLM_LAYOUT_V1.violations(td, ...) returns the same list",
    ),
    "BUFFER": _contract("buffer", "BUFFER"),
    "GENERATION": _contract("generation", "GENERATION"),
    "LOSS": _contract("loss", "LOSS"),
    "METRICS": _contract("metrics", "METRICS"),
    "ROLLOUT": _contract("rollout", "ROLLOUT"),
    "WEIGHT_SYNC": _contract("weight_sync", "WEIGHT_SYNC"),
    "LAYOUT_REQUIREMENTS": (
        "posttrain.contracts.validation:LAYOUT_REQUIREMENTS",
        "import it from posttrain.contracts.validation",
    ),
    "Capability": ("posttrain.contracts.contract:Capability", "see Contract.capabilities"),
    "Option": ("posttrain.contracts.contract:Option", "see Contract.options"),
    "Key": ("posttrain.contracts.layout:Key", "a key is a str or a tuple of str"),
    "LayoutField": ("posttrain.contracts.layout:LayoutField", "use Layout.field(name)"),
    "Level": ("posttrain.contracts.requirements:Level", "use Requirement.level"),
    "METRIC_NAME": (
        "posttrain.contracts.metrics:METRIC_NAME",
        "import it from posttrain.contracts.metrics",
    ),
    "key_str": ("posttrain.contracts.layout:key_str", "import it from posttrain.contracts.layout"),
    "norm_key": (
        "posttrain.contracts.layout:norm_key",
        "import it from posttrain.contracts.layout",
    ),
}


def __getattr__(name: str) -> Any:
    return deprecated_attr(__name__, name, _MOVED)
