"""TorchRL's RayWeightSyncScheme across processes: through the weight-sync suite (raw and
adapted), what it does with bad weights, and NeMo-RL's WeightSynchronizer facade driving it.

One local Ray cluster for the module (``ray.init(num_cpus=2)``), shut down at its end.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import pytest
import torch

from posttrain.adapters._ray import ensure_cluster
from posttrain.adapters.nemo_rl.weight_sync import NemoWeightSynchronizer
from posttrain.adapters.torchrl.implementations import (
    ADAPTED_RAY_WEIGHT_SYNC,
    RAW_RAY_WEIGHT_SYNC,
)
from posttrain.adapters.torchrl.ray_weight_sync import (
    RaySchemeSender,
    non_persistent_buffers,
    ray_weight_sync_pair,
)
from posttrain.conformance import Status
from posttrain.conformance.runner import Session, run
from posttrain.testing import tiny_causal_lm

# Cross-process (Ray, torch.distributed): `make test-distributed` runs these, `make test` not.
pytestmark = pytest.mark.distributed


@pytest.fixture(scope="module", autouse=True)
def cluster() -> Iterator[Any]:
    ray = ensure_cluster()
    yield ray
    ray.shutdown()


def _weights(seed: int) -> dict[str, torch.Tensor]:
    return {k: v.detach().clone() for k, v in tiny_causal_lm(seed=seed).state_dict().items()}


def _equal(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> list[str]:
    return [k for k in b if not torch.equal(a[k], b[k])]


def test_adapted_ray_scheme_conforms_across_processes() -> None:
    rep = run(ADAPTED_RAY_WEIGHT_SYNC)
    rows = {r.id: r for r in rep.results}
    assert rep.ok, [r.message for r in rep.results if r.status is not Status.PASS]
    assert rows["WS-008"].status is Status.PASS


def test_raw_ray_scheme_bad_weights_kill_the_receiving_actor() -> None:
    # TorchRL 0.14.1 sends through gloo, which refuses a non-contiguous tensor (WS-001, which
    # blocks the rest in a full run); it receives straight into the live parameters and checks
    # only byte sizes: a wrong shape or a shifted tensor order aborts the actor's process, and
    # WS-005's first bad send (float16 sent as bfloat16, the same size) is taken as bits, as
    # each of those requirements run on its own shows.
    rep = run(RAW_RAY_WEIGHT_SYNC)
    assert rep.failed_ids() == {"WS-001"}
    assert rep.surprises() == []  # what fails is what the row declares
    assert "contiguous" in {r.id: r.message for r in rep.results}["WS-001"]
    s = Session(RAW_RAY_WEIGHT_SYNC)
    alone = {rid: s.run_one(s.contract.requirement(rid)) for rid in ("WS-004", "WS-005", "WS-006")}
    assert {rid: r.status for rid, r in alone.items()} == dict.fromkeys(alone, Status.FAIL)
    died = {rid for rid, r in alone.items() if "ActorDiedError" in r.message}
    assert died == {"WS-004", "WS-006"}, alone
    assert "was accepted" in alone["WS-005"].message, alone


def test_raw_ray_scheme_reinterprets_a_same_size_dtype_silently() -> None:
    sender, receiver = ray_weight_sync_pair(tiny_causal_lm(seed=0))
    ones = {k: torch.ones_like(v) for k, v in _weights(1).items()}
    as_int = {k: v.to(torch.int32) for k, v in ones.items()}  # 1.0 -> 1: 4 bytes either way
    sender.send(as_int, version=2)  # accepted
    receiver.receive(timeout=30)
    got = receiver.state_dict()
    assert receiver.version == 2
    w = got["lm_head.weight"]
    assert w.dtype == torch.float32
    # The bits of int32 1, read as float32 (1.4e-45), where a cast would have given 1.0.
    assert torch.equal(w.view(torch.int32), torch.ones_like(w, dtype=torch.int32))
    receiver.close()


def test_a_state_dict_alone_leaves_the_raw_receiver_waiting() -> None:
    # Why the raw shim adds the non-persistent buffers: the receiver waits for every tensor of
    # TensorDict.from_module, and the send fails only at the gloo timeout.
    model = tiny_causal_lm(seed=0)
    assert non_persistent_buffers(model)
    sender, receiver = ray_weight_sync_pair(model)
    bare = RaySchemeSender(sender.scheme, extras={})
    with pytest.raises((RuntimeError, TimeoutError)):
        bare.send(_weights(1), version=1)
    receiver.close()


def test_nemo_weight_synchronizer_drives_the_ray_scheme() -> None:
    trainer = tiny_causal_lm(seed=1)
    sender, receiver = ray_weight_sync_pair(tiny_causal_lm(seed=0), adapted=True)
    sync = NemoWeightSynchronizer(trainer.state_dict, sender, receiver)
    sync.init_communicator()
    assert sync.is_stale
    for step in (1, 2):
        with torch.no_grad():
            trainer.lm_head.weight.add_(0.25)
        metrics = sync.sync_weights()
        assert metrics["weight_version"] == step
        assert receiver.version == step
        assert not sync.is_stale
        assert not _equal(receiver.state_dict(), trainer.state_dict())
    before = receiver.state_dict()
    trainer.lm_head.weight.data = trainer.lm_head.weight.data.double()
    with pytest.raises(ValueError, match=r"lm_head\.weight"):
        sync.sync_weights()
    assert not _equal(receiver.state_dict(), before)
    assert receiver.version == 2
    sync.shutdown()
