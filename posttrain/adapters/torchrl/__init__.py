"""TorchRL adapters: thin wrappers that make TorchRL components conform (torchrl imported lazily).

Buffer (``ValidatedReplayBuffer``), rollout (``llm_collector``, ``ContractCollector``), loss
(``ContractLoss`` over TorchRL's GRPO-family losses), generation (``inference_server``, ``ContractInferenceServer``) and weight
sync (``weight_sync_pair`` in process, ``dist_weight_sync_pair`` over torch.distributed,
``ray_weight_sync_pair`` over Ray). The conformance rows of every raw and adapted component are
module attributes of ``posttrain.adapters.torchrl.implementations`` named by the entry points.

Example:
    >>> from posttrain.adapters.torchrl import ValidatedReplayBuffer
    >>> ValidatedReplayBuffer.__name__
    'ValidatedReplayBuffer'
"""

from posttrain.adapters.torchrl.buffer import ValidatedReplayBuffer
from posttrain.adapters.torchrl.dist_weight_sync import dist_weight_sync_pair
from posttrain.adapters.torchrl.generation import ContractInferenceServer, inference_server
from posttrain.adapters.torchrl.loss import ContractLoss
from posttrain.adapters.torchrl.ray_weight_sync import ray_weight_sync_pair
from posttrain.adapters.torchrl.rollout import ContractCollector, llm_collector
from posttrain.adapters.torchrl.weight_sync import weight_sync_pair

__all__ = [
    "ContractCollector",
    "ContractInferenceServer",
    "ContractLoss",
    "ValidatedReplayBuffer",
    "dist_weight_sync_pair",
    "inference_server",
    "llm_collector",
    "ray_weight_sync_pair",
    "weight_sync_pair",
]
