"""BUF-010: extend accepts a batch with a key the buffer does not store."""

import torch
from tensordict import TensorDict
from torchrl.data import LazyTensorStorage, TensorDictReplayBuffer

rb = TensorDictReplayBuffer(storage=LazyTensorStorage(8))
rb.extend(TensorDict({"a": torch.ones(2), "b": torch.ones(2)}, batch_size=[2]))
rb.extend(TensorDict({"a": torch.ones(2), "b": torch.ones(2), "c": torch.ones(2)}, batch_size=[2]))
assert (
    len(rb) == 4
)  # "c" was accepted (LazyTensorStorage adds a column, LazyMemmapStorage drops it)
