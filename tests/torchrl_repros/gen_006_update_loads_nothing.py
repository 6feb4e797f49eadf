"""GEN-006: update_policy_weights_(model_id, weights) bumps the version but loads nothing."""

from typing import Any

import torch
from tensordict import TensorDict
from tensordict.nn import TensorDictModule
from torchrl.modules.inference_server import InferenceServer

policy = TensorDictModule(torch.nn.Linear(2, 1), in_keys=["x"], out_keys=["y"])
server: Any = InferenceServer(policy, transport="auto", min_batch_size=2, timeout=1.0).start()
client = server.client()
before = [client.submit(TensorDict({"x": torch.ones(2)})) for _ in range(2)]  # a full batch
server.update_policy_weights_(
    None, {k: torch.zeros_like(v) for k, v in policy.state_dict().items()}
)
after = [client.submit(TensorDict({"x": torch.ones(2)})) for _ in range(2)]
assert int(after[0].result(10)["policy_version"]) == 1
assert torch.equal(after[0].result(10)["y"], before[0].result(10)["y"])  # the old weights
server.shutdown()
