"""OpenRLHF adapters: its PolicyLoss as a loss implementation, loaded from its own file alone
(OpenRLHF's package imports flash_attn and deepspeed, which do not install on CPU).

Example:
    >>> from posttrain.adapters.openrlhf import OpenRLHFPolicyLoss
    >>> OpenRLHFPolicyLoss.__name__
    'OpenRLHFPolicyLoss'
"""

# Not a public package (docs/api.md): no ``__all__``; the names below are re-exported for the
# field matrix's rows and for OpenRLHF users who want them.
from posttrain.adapters.openrlhf.loss import OpenRLHFPolicyLoss as OpenRLHFPolicyLoss
from posttrain.adapters.openrlhf.loss import openrlhf_loss_module as openrlhf_loss_module
