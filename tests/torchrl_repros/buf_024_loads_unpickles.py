"""BUF-024: loads unpickles prefetch.pkl (a planted pickle runs its code) and, refusing a damaged
file, leaves the storage already replaced.
"""

import contextlib
import pathlib
import pickle
import tempfile

import torch
from tensordict import TensorDict
from torchrl.data import LazyTensorStorage, TensorDictReplayBuffer

rb = TensorDictReplayBuffer(storage=LazyTensorStorage(8))
rb.extend(TensorDict({"a": torch.ones(2), "b": torch.ones(2)}, batch_size=[2]))
d = pathlib.Path(tempfile.mkdtemp())
rb.dumps(d / "ckpt")
marker = d / "ran"


class Payload:
    def __reduce__(self) -> tuple[object, tuple[pathlib.Path]]:
        return (pathlib.Path.touch, (marker,))


(d / "ckpt" / "prefetch.pkl").write_bytes(pickle.dumps(Payload()))
TensorDictReplayBuffer(storage=LazyTensorStorage(8)).loads(d / "ckpt")
assert marker.exists()  # loading the checkpoint ran the planted code
other = TensorDictReplayBuffer(storage=LazyTensorStorage(8))
other.extend(TensorDict({"a": torch.zeros(3), "b": torch.zeros(3)}, batch_size=[3]))
(d / "ckpt" / "buffer_metadata.json").write_text("not json")
with contextlib.suppress(Exception):  # refused
    other.loads(d / "ckpt")
assert len(other) == 2  # refused, yet the storage is the checkpoint's (it held 3 items)
