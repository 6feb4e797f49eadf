"""BUF-018: dumps of a buffer nothing was written to raises instead of saving an empty state."""

import tempfile

from torchrl.data import LazyMemmapStorage, LazyTensorStorage, TensorDictReplayBuffer

for storage in (LazyTensorStorage(8), LazyMemmapStorage(8)):
    rb = TensorDictReplayBuffer(storage=storage)
    try:
        rb.dumps(tempfile.mkdtemp())
        raise SystemExit("dumps of an empty buffer worked: the deviation is fixed")
    except RuntimeError as e:
        assert "non-initialized storage" in str(e), e
