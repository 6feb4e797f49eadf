"""BUF-011: a wrong dtype fails half-way: the error names no key and the write position still
advances.
"""

import torch
from tensordict import TensorDict
from torchrl.data import LazyTensorStorage, TensorDictReplayBuffer

rb = TensorDictReplayBuffer(storage=LazyTensorStorage(8))
rb.extend(TensorDict({"a": torch.ones(2), "b": torch.ones(2)}, batch_size=[2]))
try:
    rb.extend(
        TensorDict({"a": torch.ones(2), "b": torch.ones(2, dtype=torch.float64)}, batch_size=[2])
    )
except RuntimeError as e:
    assert "'b'" not in str(e)  # "Index put requires the source and destination dtypes match"
else:
    raise SystemExit("accepted: a different deviation")
assert len(rb) == 4  # the failed write counts: two rows of garbage are now sampleable
