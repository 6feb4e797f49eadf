"""NeMo-RL adapters: NeMo-RL's data formats and interfaces over posttrain's contracts.

NeMo-RL cannot be installed from the package index (it holds a 0.0.0 placeholder), so these
adapters follow its source at commit 7ea279a (cited per function) and are pinned by vectors
its own code produced; where ``nemo_rl`` imports, its classes are used.

Example:
    >>> from posttrain.adapters.nemo_rl import to_layout
    >>> to_layout.__name__
    'to_layout'
"""

from posttrain.adapters.nemo_rl.advantages import grpo_advantages
from posttrain.adapters.nemo_rl.codec import (
    NEMO_KEY,
    TOKEN_ALIGNED_FIELDS,
    NemoFormatError,
    flatten_message_logs,
    from_batches,
    from_layout,
    layout_to_wire,
    materialize,
    pack_jagged_fields,
    shard_by_batch_size,
    to_layout,
    wire_to_layout,
)
from posttrain.adapters.nemo_rl.data_plane import KVBatchMeta, NemoDataPlaneClient
from posttrain.adapters.nemo_rl.generation import NemoGeneration
from posttrain.adapters.nemo_rl.logger import NemoLogger, metric_name
from posttrain.adapters.nemo_rl.loss import (
    ContractAsNemoLoss,
    NemoLossModule,
    global_counts,
    nemo_loss_module,
)
from posttrain.adapters.nemo_rl.storage import NemoReplayBuffer
from posttrain.adapters.nemo_rl.weight_sync import NemoWeightSynchronizer

__all__ = [
    "NEMO_KEY",
    "TOKEN_ALIGNED_FIELDS",
    "ContractAsNemoLoss",
    "KVBatchMeta",
    "NemoDataPlaneClient",
    "NemoFormatError",
    "NemoGeneration",
    "NemoLogger",
    "NemoLossModule",
    "NemoReplayBuffer",
    "NemoWeightSynchronizer",
    "flatten_message_logs",
    "from_batches",
    "from_layout",
    "global_counts",
    "grpo_advantages",
    "layout_to_wire",
    "materialize",
    "metric_name",
    "nemo_loss_module",
    "pack_jagged_fields",
    "shard_by_batch_size",
    "to_layout",
    "wire_to_layout",
]
