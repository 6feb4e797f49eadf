"""BUF-009, BUF-023: a producer's batch with a key missing is stored through a client, like the
local buffer's.
"""

from functools import partial
from typing import Any

import ray
import torch
from tensordict import TensorDict
from torchrl.data import LazyTensorStorage, RandomSampler, TensorDictReplayBuffer

ray.init(num_cpus=2, include_dashboard=False, ignore_reinit_error=True)
rb: Any = TensorDictReplayBuffer(
    storage=partial(LazyTensorStorage, 8),
    sampler=RandomSampler,
    service_backend="ray",
    service_backend_options={"remote_config": {"num_cpus": 0}},
)
rb.extend(TensorDict({"a": torch.ones(2), "b": torch.ones(2)}, batch_size=[2]))


@ray.remote(num_cpus=0)
def producer(client: Any) -> list[int]:
    indices: list[int] = client.extend(TensorDict({"a": torch.ones(2)}, batch_size=[2])).tolist()
    return indices


print(ray.get(producer.remote(rb.client())))  # [2, 3]: accepted, "b" missing
assert len(rb) == 4
rb.close()
