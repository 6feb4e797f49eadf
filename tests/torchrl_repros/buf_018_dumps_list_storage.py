"""BUF-018: dumps refuses list-backed storages, so ragged buffers cannot be checkpointed with it."""

import tempfile

import torch
from tensordict import TensorDict
from torchrl.data import LazyStackStorage, TensorDictReplayBuffer

rb = TensorDictReplayBuffer(storage=LazyStackStorage(8))
rb.extend(TensorDict({"a": torch.arange(2)}, batch_size=[2]))
try:
    rb.dumps(tempfile.mkdtemp())
    raise SystemExit("dumps worked: the deviation is fixed")
except NotImplementedError as e:
    assert "ListStorage" in str(e)
