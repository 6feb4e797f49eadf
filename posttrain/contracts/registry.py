"""Every contract, by id."""

from __future__ import annotations

from posttrain.contracts.buffer import BUFFER
from posttrain.contracts.contract import Contract
from posttrain.contracts.dpo_loss import DPO
from posttrain.contracts.generation import GENERATION
from posttrain.contracts.loss import LOSS
from posttrain.contracts.metrics import METRICS
from posttrain.contracts.nll_loss import NLL
from posttrain.contracts.rollout import ROLLOUT
from posttrain.contracts.weight_sync import WEIGHT_SYNC

CONTRACTS: dict[str, Contract] = {
    c.id: c for c in (BUFFER, ROLLOUT, WEIGHT_SYNC, LOSS, METRICS, GENERATION, NLL, DPO)
}
"""The v1 contracts by id, in dependency order.

Example:
    >>> list(CONTRACTS)
    ['buffer', 'rollout', 'weight_sync', 'loss', 'metrics', 'generation', 'nll_loss', 'dpo_loss']
"""


def get_contract(contract_id: str) -> Contract:
    """Look a contract up by id, with an error that lists the known ids.

    Example:
        >>> get_contract("loss").requirement("LOSS-003").title
        'aggregation weights'
    """
    try:
        return CONTRACTS[contract_id]
    except KeyError:
        raise KeyError(
            f"unknown contract {contract_id!r}; known contracts: {', '.join(CONTRACTS)}"
        ) from None
