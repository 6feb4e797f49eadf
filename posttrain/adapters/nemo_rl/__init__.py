"""NeMo-RL adapters: NeMo-RL's data formats and interfaces over posttrain's contracts.

NeMo-RL cannot be installed from the package index (it holds a 0.0.0 placeholder), so these
adapters follow its source at commit 7ea279a (cited per function) and are pinned by vectors
its own code produced; where ``nemo_rl`` imports, its classes are used.

Example:
    >>> from posttrain.adapters.nemo_rl import to_layout
    >>> to_layout.__name__
    'to_layout'
"""

from typing import TYPE_CHECKING, Any

from posttrain._deprecated import deprecated_attr, moved_to
from posttrain.adapters.nemo_rl.advantages import grpo_advantages
from posttrain.adapters.nemo_rl.async_buffer import NemoAsyncReplayBuffer
from posttrain.adapters.nemo_rl.batched_data_dict import BatchedDataDict
from posttrain.adapters.nemo_rl.data_plane import NemoAsyncGroupSlots, NemoDataPlaneClient
from posttrain.adapters.nemo_rl.generation import NemoGeneration
from posttrain.adapters.nemo_rl.logger import NemoLogger
from posttrain.adapters.nemo_rl.loss import ContractAsNemoLoss, NemoLossModule
from posttrain.adapters.nemo_rl.storage import NemoReplayBuffer
from posttrain.adapters.nemo_rl.train_data import NemoFormatError, from_layout, to_layout
from posttrain.adapters.nemo_rl.weight_sync import (
    NemoShardedWeightSynchronizer,
    NemoWeightSynchronizer,
)

if TYPE_CHECKING:  # the deprecated names below, typed for code that still uses them
    from posttrain.adapters.nemo_rl.batching import flatten_message_logs as flatten_message_logs
    from posttrain.adapters.nemo_rl.batching import from_batches as from_batches
    from posttrain.adapters.nemo_rl.batching import shard_by_batch_size as shard_by_batch_size
    from posttrain.adapters.nemo_rl.data_plane import KVBatchMeta as KVBatchMeta
    from posttrain.adapters.nemo_rl.logger import metric_name as metric_name
    from posttrain.adapters.nemo_rl.loss import global_counts as global_counts
    from posttrain.adapters.nemo_rl.loss import nemo_loss_module as nemo_loss_module
    from posttrain.adapters.nemo_rl.train_data import NEMO_KEY as NEMO_KEY
    from posttrain.adapters.nemo_rl.wire import TOKEN_ALIGNED_FIELDS as TOKEN_ALIGNED_FIELDS
    from posttrain.adapters.nemo_rl.wire import layout_to_wire as layout_to_wire
    from posttrain.adapters.nemo_rl.wire import materialize as materialize
    from posttrain.adapters.nemo_rl.wire import pack_jagged_fields as pack_jagged_fields
    from posttrain.adapters.nemo_rl.wire import wire_to_layout as wire_to_layout

__all__ = [
    "BatchedDataDict",
    "ContractAsNemoLoss",
    "NemoAsyncGroupSlots",
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
    "grpo_advantages",
    "to_layout",
]

_MOVED = {
    **moved_to("posttrain.adapters.nemo_rl.data_plane", "KVBatchMeta"),
    **moved_to("posttrain.adapters.nemo_rl.train_data", "NEMO_KEY"),
    **moved_to(
        "posttrain.adapters.nemo_rl.wire",
        "TOKEN_ALIGNED_FIELDS",
        "layout_to_wire",
        "materialize",
        "pack_jagged_fields",
        "wire_to_layout",
    ),
    **moved_to(
        "posttrain.adapters.nemo_rl.batching",
        "flatten_message_logs",
        "from_batches",
        "shard_by_batch_size",
    ),
    **moved_to("posttrain.adapters.nemo_rl.loss", "global_counts", "nemo_loss_module"),
    **moved_to("posttrain.adapters.nemo_rl.logger", "metric_name"),
}


def __getattr__(name: str) -> Any:
    return deprecated_attr(__name__, name, _MOVED)
