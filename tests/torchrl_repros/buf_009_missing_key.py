"""BUF-009: extend accepts a batch with a stored key missing."""

import torch
from tensordict import TensorDict
from torchrl.data import LazyTensorStorage, TensorDictReplayBuffer

rb = TensorDictReplayBuffer(storage=LazyTensorStorage(8))
rb.extend(TensorDict({"a": torch.ones(2), "b": torch.ones(2)}, batch_size=[2]))
rb.extend(TensorDict({"a": torch.ones(2)}, batch_size=[2]))  # no "b": accepted
assert len(rb) == 4  # rows 2-3 of "b" hold whatever the storage had (uninitialised / zeros)
