"""The configurable policy-gradient loss the adapters build on, one module per job.

:mod:`~posttrain.policy_loss.options` holds every option, documented once
(:class:`PolicyLossOptions`); :mod:`~posttrain.policy_loss.aggregation` the aggregations'
weights; :mod:`~posttrain.policy_loss.ratio` the ratios and surrogates;
:mod:`~posttrain.policy_loss.importance` the off-policy weights;
:mod:`~posttrain.policy_loss.kl` the KL to the reference; :mod:`~posttrain.policy_loss.inputs`
what is read from a batch; :mod:`~posttrain.policy_loss.loss` the module itself. The small
reference loss is :class:`posttrain.reference_impls.PolicyGradientLoss`.

Example:
    >>> from posttrain.policy_loss import PolicyLoss, PolicyLossOptions
    >>> from posttrain.testing import tiny_causal_lm
    >>> PolicyLoss(tiny_causal_lm(), PolicyLossOptions(ratio="cispo")).options.ratio
    'cispo'
"""

# Not a public package (docs/api.md): no ``__all__``; the names below are re-exported for the
# adapters and the field matrix's rows.
from posttrain.policy_loss.loss import PolicyLoss as PolicyLoss
from posttrain.policy_loss.options import IMPORTANCE_CORRECTIONS as IMPORTANCE_CORRECTIONS
from posttrain.policy_loss.options import KL_GRADIENTS as KL_GRADIENTS
from posttrain.policy_loss.options import RATIOS as RATIOS
from posttrain.policy_loss.options import PolicyLossOptions as PolicyLossOptions
