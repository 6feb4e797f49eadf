"""WS-005: a tensor of the wrong dtype is cast silently."""

import torch
from tensordict import TensorDict
from torchrl.collectors import VanillaWeightUpdater  # update_policy_weights_'s local path

first, last = torch.nn.Linear(4, 8), torch.nn.Linear(8, 2)
receiver = torch.nn.Sequential(first, last)
updater = VanillaWeightUpdater(policy_weights=TensorDict.from_module(receiver).data)
before = {k: v.clone() for k, v in receiver.state_dict().items()}
new = {k: torch.randn_like(v) for k, v in before.items()}
new["1.bias"] = new["1.bias"].double()
with torch.no_grad():
    updater.push_weights(TensorDict(new).unflatten_keys("."))
assert last.bias.dtype == torch.float32  # float64 accepted and cast, no error
