"""WS-001: weights holding a non-contiguous tensor (a transposed view, a slice with a step) are
refused by gloo's send, "input tensor has to be contiguous", so they never reach the receiver.
RayWeightSyncScheme shows it; DistributedWeightSyncScheme sends through the same gloo call.
"""

from typing import Any

import ray
import torch
from tensordict import TensorDict
from torchrl.weight_update import RayWeightSyncScheme

ray.init(num_cpus=2, include_dashboard=False, ignore_reinit_error=True)


class Receiver:
    def __init__(self, scheme: Any) -> None:
        self.model = torch.nn.Linear(4, 4)
        self.scheme = scheme
        scheme.init_on_receiver(model_id="policy", worker_idx=0, model=self.model)

    def connect(self) -> None:
        self.scheme.connect(worker_idx=0)

    def _receive_weights_scheme(self, model_version: int | None = None) -> None:  # by RayTransport
        self.scheme.receive()

    def weight(self) -> torch.Tensor:
        return self.model.weight.detach().clone()


ReceiverActor: Any = ray.remote(num_cpus=0)(Receiver)


def pair() -> tuple[Any, Any]:
    scheme: Any = RayWeightSyncScheme(backend="gloo")
    actor = ReceiverActor.remote(scheme)
    scheme.init_on_sender(
        model_id="policy", remote_collectors=[actor], num_workers=1, model=torch.nn.Linear(4, 4)
    )
    ray.get(actor.weight.remote())
    joined = actor.connect.remote()
    scheme.connect()
    ray.get(joined)
    return scheme, actor


scheme, actor = pair()
new = TensorDict.from_module(torch.nn.Linear(4, 4)).data.apply(torch.ones_like)
new["weight"] = torch.ones(4, 4).t().contiguous().t()  # the same values, column-major strides
try:
    scheme.send(weights=new)
    raise SystemExit("a non-contiguous weight was sent: the deviation is fixed")
except RuntimeError as e:
    assert "contiguous" in str(e), e
scheme.shutdown()
