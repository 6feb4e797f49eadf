"""NeMo-RL adapters: NeMo-RL's data formats and interfaces over posttrain's contracts.

NeMo-RL cannot be installed from the package index (it holds a 0.0.0 placeholder), so these
adapters follow its source at commit 7ea279a (cited per function) and are pinned by vectors
its own code produced; where ``nemo_rl`` imports, its classes are used.

Example:
    >>> from posttrain.adapters.nemo_rl import to_layout
    >>> to_layout.__name__
    'to_layout'
"""

from posttrain.adapters.nemo_rl.data_plane import NemoDataPlaneClient
from posttrain.adapters.nemo_rl.generation import NemoGeneration
from posttrain.adapters.nemo_rl.logger import NemoLogger
from posttrain.adapters.nemo_rl.loss import ContractAsNemoLoss, NemoLossModule
from posttrain.adapters.nemo_rl.replay_buffer import NemoAsyncReplayBuffer, NemoReplayBuffer
from posttrain.adapters.nemo_rl.train_data import NemoFormatError, from_layout, to_layout
from posttrain.adapters.nemo_rl.weight_sync import (
    NemoShardedWeightSynchronizer,
    NemoWeightSynchronizer,
)

__all__ = [
    "ContractAsNemoLoss",
    "NemoAsyncReplayBuffer",
    "NemoDataPlaneClient",
    "NemoFormatError",
    "NemoGeneration",
    "NemoLogger",
    "NemoLossModule",
    "NemoReplayBuffer",
    "NemoShardedWeightSynchronizer",
    "NemoWeightSynchronizer",
    "from_layout",
    "to_layout",
]
