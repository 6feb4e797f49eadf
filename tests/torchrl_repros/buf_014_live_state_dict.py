"""BUF-014: state_dict() returns the live storage tensors: a snapshot changes with every later
extend.
"""

import torch
from tensordict import TensorDict
from torchrl.data import LazyTensorStorage, TensorDictReplayBuffer

rb = TensorDictReplayBuffer(storage=LazyTensorStorage(8))
rb.extend(TensorDict({"a": torch.ones(2), "b": torch.ones(2)}, batch_size=[2]))
snapshot = rb.state_dict()  # [1, 1] in "a"
rb.extend(TensorDict({"a": torch.full((8,), 5.0), "b": torch.ones(8)}, batch_size=[8]))
fresh = TensorDictReplayBuffer(storage=LazyTensorStorage(8))
fresh.load_state_dict(snapshot)
assert fresh[torch.arange(2)]["a"].tolist() == [5.0, 5.0]  # the later write, not the snapshot's
