"""BUF-004: sample(n) returns fewer than n items when the current epoch has fewer left."""

import torch
from tensordict import TensorDict
from torchrl.data import LazyTensorStorage, SamplerWithoutReplacement, TensorDictReplayBuffer

rb = TensorDictReplayBuffer(storage=LazyTensorStorage(8), sampler=SamplerWithoutReplacement())
rb.extend(TensorDict({"a": torch.arange(5)}, batch_size=[5]))
rb.sample(4)
assert rb.sample(5).batch_size == torch.Size([1])  # asked for 5
