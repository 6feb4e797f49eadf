"""GEN-007: a malformed request reaches the model and its error fails every request of the batch."""

import torch
from tensordict import TensorDict
from tensordict.nn import TensorDictModule
from torchrl.modules.inference_server import InferenceServer

policy = TensorDictModule(torch.nn.Linear(2, 1), in_keys=["x"], out_keys=["y"])
server = InferenceServer(policy, transport="auto", min_batch_size=2, timeout=1.0).start()
client = server.client()
good = client.submit(TensorDict({"x": torch.ones(2)}))
bad = client.submit(TensorDict({"z": torch.ones(2)}))  # "x" missing
assert isinstance(good.exception(10), KeyError)  # the valid request fails with the bad one
server.shutdown()
