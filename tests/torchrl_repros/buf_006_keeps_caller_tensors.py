"""BUF-006: extend keeps the caller's tensors (views of its rows): writing into the batch
afterwards changes the stored items.
"""

import torch
from tensordict import TensorDict
from torchrl.data import LazyStackStorage, TensorDictReplayBuffer

rb = TensorDictReplayBuffer(storage=LazyStackStorage(8))
batch = TensorDict({"a": torch.arange(4.0)}, batch_size=[4])
rb.extend(batch)
batch["a"].fill_(99.0)  # the caller reuses its tensor
assert rb[torch.arange(4)]["a"].tolist() == [99.0] * 4  # the buffer's items changed with it
