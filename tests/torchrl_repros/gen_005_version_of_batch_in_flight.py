"""GEN-005: update_policy_weights_ bumps the version without the model lock, and a batch is stamped
when its forward ends: a batch in flight during an update is stamped with the new version.
"""

import threading
from typing import Any

import torch
from tensordict import TensorDict
from tensordict.nn import TensorDictModule
from torchrl.modules.inference_server import InferenceServer

policy = TensorDictModule(torch.nn.Linear(2, 1), in_keys=["x"], out_keys=["y"])

entered, release = threading.Event(), threading.Event()


def hold(
    module: object, args: object, output: object
) -> None:  # the batch stays in the model until released
    entered.set()
    release.wait(10)


policy.register_forward_hook(hold)
server: Any = InferenceServer(policy, transport="auto").start()
inflight = server.client().submit(TensorDict({"x": torch.ones(2)}))
assert entered.wait(10)  # computed by version 0's weights, not yet stamped
server.update_policy_weights_()  # returns at once, the batch still in the model
release.set()
assert int(inflight.result(10)["policy_version"]) == 1  # stamped with the later version
server.shutdown()
