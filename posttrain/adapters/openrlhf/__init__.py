"""OpenRLHF adapters: its PolicyLoss as a loss implementation, loaded from its own file alone
(OpenRLHF's package imports flash_attn and deepspeed, which do not install on CPU).

Example:
    >>> from posttrain.adapters.openrlhf import OpenRLHFPolicyLoss
    >>> OpenRLHFPolicyLoss.__name__
    'OpenRLHFPolicyLoss'
"""

from posttrain.adapters.openrlhf.loss import OpenRLHFPolicyLoss, openrlhf_loss_module

__all__ = ["OpenRLHFPolicyLoss", "openrlhf_loss_module"]
