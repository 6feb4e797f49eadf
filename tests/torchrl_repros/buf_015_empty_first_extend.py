"""BUF-015: an extend of 0 items into a buffer nothing was written to raises instead of doing nothing."""

import torch
from tensordict import TensorDict
from torchrl.data import LazyMemmapStorage, LazyTensorStorage, TensorDictReplayBuffer

for storage in (LazyTensorStorage(8), LazyMemmapStorage(8)):
    rb = TensorDictReplayBuffer(storage=storage)
    try:
        rb.extend(TensorDict({"a": torch.zeros(0, 3)}, batch_size=[0]))
        raise SystemExit("an empty first extend worked: the deviation is fixed")
    except IndexError as e:
        assert "out of bounds" in str(e), e
