"""TorchRL adapters: thin wrappers that make TorchRL components conform (torchrl imported lazily).

Example:
    >>> from posttrain.adapters.torchrl import ValidatedReplayBuffer
    >>> ValidatedReplayBuffer.__name__
    'ValidatedReplayBuffer'
"""

from posttrain.adapters.torchrl.buffer import ValidatedReplayBuffer

__all__ = ["ValidatedReplayBuffer"]
