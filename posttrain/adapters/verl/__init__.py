"""verl adapters: verl's registered policy losses as loss implementations (verl imported lazily).

Example:
    >>> from posttrain.adapters.verl import VerlLoss
    >>> VerlLoss.__name__
    'VerlLoss'
"""

from posttrain.adapters.verl.loss import VERL_AGGREGATIONS, VerlLoss

__all__ = ["VERL_AGGREGATIONS", "VerlLoss"]
