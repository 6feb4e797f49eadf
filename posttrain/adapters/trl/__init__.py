"""TRL adapters: replay buffers as TRL datasets (prompts, SFT, preference pairs), HF reward models and TRL reward functions as
contract rewards, TRL's generations captured into any buffer (TRL imported lazily).

Example:
    >>> from posttrain.adapters.trl import BufferDataset
    >>> BufferDataset.__name__
    'BufferDataset'
"""

from typing import TYPE_CHECKING, Any

from posttrain._deprecated import deprecated_attr
from posttrain.adapters.trl.callback import CatalogueCallback
from posttrain.adapters.trl.dataset import (
    BufferDataset,
    MissingKey,
    WorkerRefused,
    prompt_dataset,
    sft_dataset,
)
from posttrain.adapters.trl.loss import TRLGRPOLoss
from posttrain.adapters.trl.preference import preference_dataset
from posttrain.adapters.trl.reward import RewardModule, hf_reward_model, trl_reward, trl_reward_func
from posttrain.adapters.trl.rollout import CaptureRollouts
from posttrain.adapters.trl.source import TRLRolloutSource

if TYPE_CHECKING:  # the deprecated names below, typed for code that still uses them
    from posttrain.adapters.trl.dataset import IGNORE_INDEX as IGNORE_INDEX
    from posttrain.adapters.trl.dataset import to_padded as to_padded
    from posttrain.adapters.trl.reward import sequences as sequences
    from posttrain.errors import SourceClosed as SourceClosed

__all__ = [
    "BufferDataset",
    "CaptureRollouts",
    "CatalogueCallback",
    "MissingKey",
    "RewardModule",
    "TRLGRPOLoss",
    "TRLRolloutSource",
    "WorkerRefused",
    "hf_reward_model",
    "preference_dataset",
    "prompt_dataset",
    "sft_dataset",
    "trl_reward",
    "trl_reward_func",
]

_MOVED = {
    "SourceClosed": ("posttrain.errors:SourceClosed", "import it from posttrain"),
    "IGNORE_INDEX": (
        "posttrain.adapters.trl.dataset:IGNORE_INDEX",
        "the label of an ignored position is -100",
    ),
    "to_padded": (
        "posttrain.adapters.trl.dataset:to_padded",
        "import it from posttrain.adapters.trl.dataset",
    ),
    "sequences": (
        "posttrain.adapters.trl.reward:sequences",
        "import it from posttrain.adapters.trl.reward",
    ),
}


def __getattr__(name: str) -> Any:
    return deprecated_attr(__name__, name, _MOVED)
