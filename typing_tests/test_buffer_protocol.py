"""Static conformance: who assigns to ``ReplayBufferV1`` (mypy --strict --warn-unused-ignores).

A class that should conform is assigned plainly; one that must not carries a
``# type: ignore[assignment]``. A regression either way is a mypy error: a conforming class
that stops conforming fails the assignment, a broken class that starts to "conform" makes
its ignore unused.
"""

from __future__ import annotations

from typing import Any

import torch
from tensordict import TensorDictBase
from torchrl.data import LazyTensorStorage, ReplayBuffer, TensorDictReplayBuffer

from posttrain.contracts import ReplayBufferV1, SupportsCheckpoint
from posttrain.reference_impls import RingBuffer

ring: ReplayBufferV1 = RingBuffer(capacity=8)
ring_ckpt: SupportsCheckpoint = RingBuffer(capacity=8)
torchrl_td_rb: ReplayBufferV1 = TensorDictReplayBuffer(storage=LazyTensorStorage(8))
torchrl_rb: ReplayBufferV1 = ReplayBuffer(storage=LazyTensorStorage(8))


class NoLen:
    def extend(self, data: TensorDictBase, /) -> torch.Tensor:
        return torch.zeros(0)

    def sample(self, batch_size: int, /) -> Any:
        return None

    def state_dict(self) -> dict[str, Any]:
        return {}

    def load_state_dict(self, state_dict: dict[str, Any], /) -> None:
        pass


class ExtendReturnsNone(NoLen):
    def extend(self, data: TensorDictBase, /) -> None:  # type: ignore[override]
        pass

    def __len__(self) -> int:
        return 0


class SampleNeedsTwoArgs(NoLen):
    def sample(self, batch_size: int, replace: bool, /) -> Any:  # type: ignore[override]
        return None

    def __len__(self) -> int:
        return 0


no_len: ReplayBufferV1 = NoLen()  # type: ignore[assignment]
bad_extend: ReplayBufferV1 = ExtendReturnsNone()  # type: ignore[assignment]
bad_sample: ReplayBufferV1 = SampleNeedsTwoArgs()  # type: ignore[assignment]
