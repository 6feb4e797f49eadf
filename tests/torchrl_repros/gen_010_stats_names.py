"""GEN-010: stats() reports p50/p95 milliseconds and avg_batch_size, not
queue_wait_s/batch_size/forward_s.
"""

import torch
from tensordict import TensorDict
from tensordict.nn import TensorDictModule
from torchrl.modules.inference_server import InferenceServer

policy = TensorDictModule(torch.nn.Linear(2, 1), in_keys=["x"], out_keys=["y"])
server = InferenceServer(policy, transport="auto").start()
server.client().submit(TensorDict({"x": torch.ones(2)})).result(10)
stats = server.stats()
assert "p50_queue_ms" in stats and "queue_wait_s" not in stats
server.shutdown()
