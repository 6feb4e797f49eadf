"""verl adapters: verl's registered policy losses as loss implementations (verl imported lazily).

:mod:`posttrain.adapters.verl.data` converts a verl ``DataProto`` to the LLM layout and back.

Example:
    >>> from posttrain.adapters.verl import VerlLoss
    >>> VerlLoss.__name__
    'VerlLoss'
"""

from posttrain.adapters.verl.loss import VERL_AGGREGATIONS, VerlLoss

__all__ = ["VERL_AGGREGATIONS", "VerlLoss"]
