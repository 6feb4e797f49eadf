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
)

__all__ = ["IGNORE_INDEX", "BufferDataset", "WorkerRefused", "prompt_dataset", "sft_dataset"]
