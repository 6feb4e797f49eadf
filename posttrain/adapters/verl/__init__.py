"""verl adapters: verl's registered policy losses as loss implementations (verl imported lazily).

:mod:`posttrain.adapters.verl.data` converts a verl ``DataProto`` to the LLM layout and back.

Example:
    >>> from posttrain.adapters.verl import VerlLoss
    >>> VerlLoss.__name__
    'VerlLoss'
"""

# Not a public package (docs/api.md): no ``__all__``; the names below are re-exported for the
# field matrix's rows and for verl users who want them.
from posttrain.adapters.verl.loss import VERL_AGGREGATIONS as VERL_AGGREGATIONS
from posttrain.adapters.verl.loss import VerlLoss as VerlLoss
