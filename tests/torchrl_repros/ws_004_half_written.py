"""WS-004: a wrong shape fails part-way: earlier tensors are already overwritten and the error
names no parameter.
"""

import torch
from tensordict import TensorDict
from torchrl.collectors import VanillaWeightUpdater  # update_policy_weights_'s local path

first, last = torch.nn.Linear(4, 8), torch.nn.Linear(8, 2)
receiver = torch.nn.Sequential(first, last)
updater = VanillaWeightUpdater(policy_weights=TensorDict.from_module(receiver).data)
before = {k: v.clone() for k, v in receiver.state_dict().items()}
new = {k: torch.randn_like(v) for k, v in before.items()}
new["1.bias"] = torch.zeros(3)  # the last tensor has a wrong shape
try:
    with torch.no_grad():
        updater.push_weights(TensorDict(new).unflatten_keys("."))
    raise SystemExit("accepted")
except RuntimeError as e:
    assert "bias" not in str(e)  # "The size of tensor a (2) must match ..."
assert not torch.equal(first.weight, before["0.weight"])  # half-written
assert torch.equal(last.bias, before["1.bias"])
