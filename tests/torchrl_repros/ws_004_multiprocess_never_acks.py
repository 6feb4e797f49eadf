"""WS-004: after a wrong shape the receiver only logs the error and never acknowledges, so send()
blocks forever.
"""

import copy
import threading

import torch
from tensordict import TensorDict
from torchrl.weight_update import MultiProcessWeightSyncScheme

receiver = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.Linear(8, 2))
scheme = MultiProcessWeightSyncScheme()
scheme.init_on_sender(
    weights=TensorDict.from_module(receiver).data.clone(), devices=[torch.device("cpu")]
)
worker = copy.copy(scheme)  # the worker's end, here in the same process
worker.init_on_receiver(model_id="policy", model=receiver, worker_idx=0)
scheme.connect()
worker.connect(worker_idx=0)
bad = TensorDict.from_module(receiver).data.clone()
bad["1", "bias"] = torch.zeros(3)
t = threading.Thread(target=scheme.send, args=(bad,), daemon=True)
t.start()
t.join(timeout=10)
assert t.is_alive()  # still waiting for an acknowledgement that never comes
worker.shutdown()
