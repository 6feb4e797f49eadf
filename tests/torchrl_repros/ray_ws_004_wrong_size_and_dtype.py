"""WS-004, WS-005, WS-006: weights of the wrong size abort the receiving actor's process; same-size
weights of another dtype are reinterpreted bit for bit and acknowledged.
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
scheme.send(weights=new.to(torch.int32))  # same size, other dtype: accepted
got = ray.get(actor.weight.remote())
assert torch.equal(got.view(torch.int32), torch.ones(4, 4, dtype=torch.int32))  # 1.4e-45, not 1.0
try:
    scheme.send(weights=new.double())  # twice the bytes per tensor
    raise SystemExit("accepted")
except Exception as e:
    assert "ActorDiedError" in type(e).__name__ or "died" in str(e)  # the receiver aborted
scheme.shutdown()
