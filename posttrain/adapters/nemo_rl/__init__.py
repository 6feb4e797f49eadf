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

from posttrain._deprecated import deprecated_attr
from posttrain.adapters.nemo_rl.advantages import grpo_advantages
from posttrain.adapters.nemo_rl.data_plane import NemoDataPlaneClient
from posttrain.adapters.nemo_rl.generation import NemoGeneration
from posttrain.adapters.nemo_rl.logger import NemoLogger
from posttrain.adapters.nemo_rl.loss import ContractAsNemoLoss, NemoLossModule
from posttrain.adapters.nemo_rl.storage import NemoReplayBuffer
from posttrain.adapters.nemo_rl.train_data import NemoFormatError, from_layout, to_layout
from posttrain.adapters.nemo_rl.weight_sync import NemoWeightSynchronizer

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
    "ContractAsNemoLoss",
    "NemoDataPlaneClient",
    "NemoFormatError",
    "NemoGeneration",
    "NemoLogger",
    "NemoLossModule",
    "NemoReplayBuffer",
    "NemoWeightSynchronizer",
    "from_layout",
    "grpo_advantages",
    "to_layout",
]

_MOVED = {
    "KVBatchMeta": (
        "posttrain.adapters.nemo_rl.data_plane:KVBatchMeta",
        "import it from posttrain.adapters.nemo_rl.data_plane",
    ),
    "NEMO_KEY": (
        "posttrain.adapters.nemo_rl.train_data:NEMO_KEY",
        "import it from posttrain.adapters.nemo_rl.train_data",
    ),
    "TOKEN_ALIGNED_FIELDS": (
        "posttrain.adapters.nemo_rl.wire:TOKEN_ALIGNED_FIELDS",
        "import it from posttrain.adapters.nemo_rl.wire",
    ),
    "flatten_message_logs": (
        "posttrain.adapters.nemo_rl.batching:flatten_message_logs",
        "import it from posttrain.adapters.nemo_rl.batching",
    ),
    "from_batches": (
        "posttrain.adapters.nemo_rl.batching:from_batches",
        "import it from posttrain.adapters.nemo_rl.batching",
    ),
    "global_counts": (
        "posttrain.adapters.nemo_rl.loss:global_counts",
        "import it from posttrain.adapters.nemo_rl.loss",
    ),
    "layout_to_wire": (
        "posttrain.adapters.nemo_rl.wire:layout_to_wire",
        "import it from posttrain.adapters.nemo_rl.wire",
    ),
    "materialize": (
        "posttrain.adapters.nemo_rl.wire:materialize",
        "import it from posttrain.adapters.nemo_rl.wire",
    ),
    "metric_name": (
        "posttrain.adapters.nemo_rl.logger:metric_name",
        "import it from posttrain.adapters.nemo_rl.logger",
    ),
    "nemo_loss_module": (
        "posttrain.adapters.nemo_rl.loss:nemo_loss_module",
        "import it from posttrain.adapters.nemo_rl.loss",
    ),
    "pack_jagged_fields": (
        "posttrain.adapters.nemo_rl.wire:pack_jagged_fields",
        "import it from posttrain.adapters.nemo_rl.wire",
    ),
    "shard_by_batch_size": (
        "posttrain.adapters.nemo_rl.batching:shard_by_batch_size",
        "import it from posttrain.adapters.nemo_rl.batching",
    ),
    "wire_to_layout": (
        "posttrain.adapters.nemo_rl.wire:wire_to_layout",
        "import it from posttrain.adapters.nemo_rl.wire",
    ),
}


def __getattr__(name: str) -> Any:
    return deprecated_attr(__name__, name, _MOVED)
