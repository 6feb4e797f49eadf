"""TRL adapters: replay buffers as TRL datasets (prompts, SFT, preference pairs), HF reward models and TRL reward functions as
contract rewards, TRL's generations captured into any buffer (TRL imported lazily).

Example:
    >>> from posttrain.adapters.trl import BufferDataset
    >>> BufferDataset.__name__
    'BufferDataset'
"""

from posttrain.adapters.trl.callback import CatalogueCallback
from posttrain.adapters.trl.dataset import (
    BufferDataset,
    prompt_dataset,
    sft_dataset,
)
from posttrain.adapters.trl.loss import TRLGRPOLoss
from posttrain.adapters.trl.preference import preference_dataset
from posttrain.adapters.trl.reward import RewardModule, hf_reward_model, trl_reward, trl_reward_func
from posttrain.adapters.trl.rollout import CaptureRollouts
from posttrain.adapters.trl.source import TRLRolloutSource

__all__ = [
    "BufferDataset",
    "CaptureRollouts",
    "CatalogueCallback",
    "RewardModule",
    "TRLGRPOLoss",
    "TRLRolloutSource",
    "hf_reward_model",
    "preference_dataset",
    "prompt_dataset",
    "sft_dataset",
    "trl_reward",
    "trl_reward_func",
]
