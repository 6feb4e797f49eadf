"""GEN-009: a request submitted after shutdown() is never answered nor failed."""

import concurrent.futures

import torch
from tensordict import TensorDict
from tensordict.nn import TensorDictModule
from torchrl.modules.inference_server import InferenceServer

policy = TensorDictModule(torch.nn.Linear(2, 1), in_keys=["x"], out_keys=["y"])
server = InferenceServer(policy, transport="auto").start()
client = server.client()
server.shutdown()
future = client.submit(TensorDict({"x": torch.ones(2)}))
try:
    future.result(timeout=2)
    raise AssertionError("answered")
except concurrent.futures.TimeoutError:
    pass  # still pending: the caller waits forever without a timeout
