"""GEN-002: once a caller cancels its pending future, setting its result raises
InvalidStateError in the server's loop, and the server stops serving every other caller.
"""

import concurrent.futures as cf
import time

import torch
from tensordict import TensorDict
from tensordict.nn import TensorDictModule
from torchrl.modules.inference_server import InferenceServer


class Slow(torch.nn.Linear):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        time.sleep(0.2)  # a batch in flight while the next request is cancelled
        return super().forward(x)


policy = TensorDictModule(Slow(2, 1), in_keys=["x"], out_keys=["y"])
server = InferenceServer(policy, transport="auto").start()
first = server.client().submit(TensorDict({"x": torch.ones(2)}))
cancelled = server.client().submit(TensorDict({"x": torch.ones(2)}))
assert cancelled.cancel()  # the caller gives up on its request while it is queued
first.result(10)
other = server.client().submit(TensorDict({"x": torch.zeros(2)}))
try:
    other.result(10)
    served = True
except (RuntimeError, cf.TimeoutError):  # "InferenceServer is shutting down.", or no answer
    served = False
assert not served
server.shutdown()
