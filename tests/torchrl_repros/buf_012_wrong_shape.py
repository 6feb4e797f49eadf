"""BUF-012: a wrong item shape fails half-way: the error names no key and the write position still
advances.
"""

import torch
from tensordict import TensorDict
from torchrl.data import LazyTensorStorage, TensorDictReplayBuffer

rb = TensorDictReplayBuffer(storage=LazyTensorStorage(8))
rb.extend(TensorDict({"a": torch.ones(2), "b": torch.ones(2)}, batch_size=[2]))
try:
    rb.extend(TensorDict({"a": torch.ones(2), "b": torch.ones(2, 3)}, batch_size=[2]))
except RuntimeError as e:
    assert "'b'" not in str(
        e
    )  # "shape mismatch: value tensor of shape [2, 3] cannot be broadcast ..."
else:
    raise SystemExit("accepted: a different deviation")
assert len(rb) == 4
