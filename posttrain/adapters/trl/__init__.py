"""TRL adapters: replay buffers as TRL datasets, HF reward models and TRL reward functions as
contract rewards, TRL's generations captured into any buffer (TRL imported lazily).

Example:
    >>> from posttrain.adapters.trl import BufferDataset
    >>> BufferDataset.__name__
    'BufferDataset'
"""

from posttrain.adapters.trl.dataset import (
    IGNORE_INDEX,
    BufferDataset,
    WorkerRefused,
    prompt_dataset,
    sft_dataset,
    to_padded,
)
from posttrain.adapters.trl.reward import (
    RewardModule,
    hf_reward_model,
    sequences,
    trl_reward,
    trl_reward_func,
)
from posttrain.adapters.trl.rollout import CaptureRollouts
from posttrain.adapters.trl.source import SourceClosed, TRLRolloutSource

__all__ = [
    "IGNORE_INDEX",
    "BufferDataset",
    "CaptureRollouts",
    "RewardModule",
    "SourceClosed",
    "TRLRolloutSource",
    "WorkerRefused",
    "hf_reward_model",
    "prompt_dataset",
    "sequences",
    "sft_dataset",
    "to_padded",
    "trl_reward",
    "trl_reward_func",
]
