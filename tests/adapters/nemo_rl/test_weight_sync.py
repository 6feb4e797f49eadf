"""NeMo-RL's WeightSynchronizer over posttrain weight syncs (in-process and TorchRL's)."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Any

import pytest
import torch

from posttrain.adapters.nemo_rl.weight_sync import NemoWeightSynchronizer
from posttrain.reference_impls import in_process_weight_sync
from posttrain.testing import tiny_causal_lm


class Timer:
    """NeMo-RL's Timer surface used by its synchronizers: ``with timer.time(label):``."""

    def __init__(self) -> None:
        self.labels: list[str] = []

    @contextlib.contextmanager
    def time(self, label: str) -> Iterator[None]:
        self.labels.append(label)
        yield


def refit_policy_generation(policy_generation: Any, timer: Any = None) -> dict[str, float]:
    """The synchronizer branch of NeMo-RL's ``refit_policy_generation`` (grpo.py)."""
    synchronizer = policy_generation.weight_synchronizer
    return synchronizer.sync_weights(timer=timer, kv_scales=None) or {}


def _equal(a: torch.nn.Module, b: torch.nn.Module) -> bool:
    sa, sb = a.state_dict(), b.state_dict()
    return sa.keys() == sb.keys() and all(torch.equal(sa[k], sb[k]) for k in sa)


@pytest.mark.parametrize("transport", ["in_process", "torchrl_shared_mem"])
def test_refit_hook_drives_the_synchronizer_to_bit_exact_weights(transport: str) -> None:
    trainer, generator = tiny_causal_lm(seed=1), tiny_causal_lm(seed=2)
    sender: Any
    receiver: Any
    if transport == "in_process":
        sender, receiver = in_process_weight_sync(generator)
    else:
        from posttrain.adapters.torchrl.weight_sync import weight_sync_pair

        sender, receiver = weight_sync_pair(generator, "shared_mem", adapted=True)
    sync = NemoWeightSynchronizer(trainer.state_dict, sender, receiver)
    sync.init_communicator()
    info = sync.prepare_refit_info()
    assert info["lm_head.weight"] == (torch.Size([64, 32]), torch.float32)
    assert sync.is_stale
    assert not _equal(trainer, generator)

    class PolicyGeneration:
        weight_synchronizer = sync

    timer = Timer()
    metrics = refit_policy_generation(PolicyGeneration(), timer)
    assert _equal(trainer, generator)
    assert not sync.is_stale
    assert metrics["weight_version"] == 1.0
    assert receiver.version == 1
    assert timer.labels == ["prepare_for_generation/transfer_and_update_weights"]
    with torch.no_grad():
        for p in trainer.parameters():
            p.add_(0.5)
    refit_policy_generation(PolicyGeneration())
    assert _equal(trainer, generator)
    assert receiver.version == 2
    sync.shutdown()
    sync.shutdown()
    with pytest.raises(RuntimeError, match="after shutdown"):
        sync.sync_weights()


def test_a_failed_sync_leaves_the_generator_unchanged_and_stale() -> None:
    trainer, generator = tiny_causal_lm(seed=1), tiny_causal_lm(seed=2, vocab_size=32)
    sender, receiver = in_process_weight_sync(generator)
    sync = NemoWeightSynchronizer(trainer.state_dict, sender, receiver)
    with pytest.raises(RuntimeError, match="init_communicator"):
        sync.sync_weights()
    sync.init_communicator()
    before = {k: v.clone() for k, v in generator.state_dict().items()}
    with pytest.raises(Exception, match=r"embed_tokens\.weight"):
        sync.sync_weights()
    assert sync.is_stale
    assert receiver.version == 0
    assert all(torch.equal(v, generator.state_dict()[k]) for k, v in before.items())
    with pytest.raises(ValueError, match="kv_scales"):
        sync.sync_weights(kv_scales={"k": 1.0})


# The reference in-process sync itself: all or nothing, versions only rise.


def _linear_and_weights() -> tuple[torch.nn.Linear, dict[str, torch.Tensor]]:
    model = torch.nn.Linear(2, 2)
    return model, {k: v.clone() + 1 for k, v in model.state_dict().items()}


@pytest.mark.parametrize(
    ("bias", "found"),
    [
        (lambda: torch.ones(2).to_sparse(), "expected layout strided, found sparse_coo"),
        (lambda: torch.nested.nested_tensor([torch.ones(2)], layout=torch.jagged), "found nested"),
        (lambda: torch.ones(2, device="meta"), "found one on device meta"),
        (lambda: [1.0, 1.0], "expected a tensor, found list"),
    ],
    ids=["sparse", "nested", "meta", "list"],
)
def test_reference_sync_refuses_at_send_what_cannot_be_copied(bias: Any, found: str) -> None:
    from posttrain.reference_impls.weight_sync import WeightMismatch

    model, weights = _linear_and_weights()
    before = {k: v.clone() for k, v in model.state_dict().items()}
    sender, receiver = in_process_weight_sync(model)
    with pytest.raises(WeightMismatch, match=rf"'bias': [^;]*{found}"):
        sender.send({**weights, "bias": bias()}, version=1)
    assert receiver.receive() is None
    assert receiver.version == 0
    assert all(torch.equal(v, model.state_dict()[k]) for k, v in before.items())


def test_reference_sync_rejects_a_version_not_above_the_pending_one() -> None:
    model, weights = _linear_and_weights()
    sender, receiver = in_process_weight_sync(model)
    sender.send(weights, version=5)
    with pytest.raises(ValueError, match=r"version: expected an int above 5 .*found 3"):
        sender.send(weights, version=3)
    assert receiver.receive() == 5
    with pytest.raises(ValueError, match=r"version: expected an int above 5 .*found 5"):
        sender.send(weights, version=5)
    sender.send(weights, version=6)
    assert receiver.receive() == 6


def test_reference_sync_keeps_pending_weights_the_model_no_longer_fits() -> None:
    from posttrain.reference_impls.weight_sync import WeightMismatch

    model, weights = _linear_and_weights()
    sender, receiver = in_process_weight_sync(model)
    sender.send(weights, version=1)
    model.double()  # changed after the send: the copy would cast silently
    with pytest.raises(WeightMismatch, match=r"'weight': expected dtype float64, found float32"):
        receiver.receive()
    assert receiver.version == 0
    model.float()
    assert receiver.receive() == 1
    assert all(torch.equal(v, model.state_dict()[k]) for k, v in weights.items())


def test_sharded_senders_pass_the_weight_sync_suite() -> None:
    from posttrain.adapters.nemo_rl.implementations import WEIGHT_SYNC_SHARDED
    from posttrain.conformance import Status
    from posttrain.conformance.runner import run

    rep = run(WEIGHT_SYNC_SHARDED)
    bad = [
        (r.id, r.message)
        for r in rep.results
        if r.status not in (Status.PASS, Status.NOT_APPLICABLE)
    ]
    assert rep.ok, bad[:10]
    assert sum(r.status is Status.PASS for r in rep.results) >= 5


class _Worker:
    """A policy worker holding its shard (a slice of the trainer's state dict)."""

    def __init__(self, model: torch.nn.Module, names: list[str]) -> None:
        self.model, self.names = model, names

    def state_shard(self) -> dict[str, torch.Tensor]:
        sd = self.model.state_dict()
        return {n: sd[n] for n in self.names}


class _Recorder:
    """Records the colocated offload/wake calls in order."""

    def __init__(self, calls: list[str]) -> None:
        self.calls = calls

    def offload_before_refit(self) -> None:
        self.calls.append("policy.offload_before_refit")

    def offload_after_refit(self) -> None:
        self.calls.append("policy.offload_after_refit")

    def prepare_for_generation(self, tags: list[str] | None = None) -> None:
        self.calls.append(f"policy_generation.prepare_for_generation({tags})")


def test_sharded_synchronizer_keeps_nemo_rls_colocated_order_and_takes_kv_scales() -> None:
    from posttrain.adapters.nemo_rl.weight_sync import NemoShardedWeightSynchronizer, ShardAssembler

    trainer, generator = tiny_causal_lm(seed=1), tiny_causal_lm(seed=2)
    names = sorted(trainer.state_dict())
    workers = [_Worker(trainer, names[i::3]) for i in range(3)]
    sender, receiver = in_process_weight_sync(generator)
    calls: list[str] = []

    class Receiver:
        version = property(lambda self: receiver.version)

        def receive(self, timeout: float | None = None) -> Any:
            calls.append("receiver.receive")
            return receiver.receive(timeout)

    scales: list[tuple[dict[str, float], int]] = []
    rec = _Recorder(calls)
    sync = NemoShardedWeightSynchronizer(
        workers,
        ShardAssembler(sender, 3),
        Receiver(),
        colocated=True,
        policy=rec,
        policy_generation=rec,
        kv_scales_sink=lambda s, v: scales.append((dict(s), v)),
    )
    sync.init_communicator()
    timer = Timer()
    out = sync.sync_weights(timer=timer, kv_scales={"model.layers.0.self_attn.k_scale": 0.5})
    assert out["weight_version"] == 1.0
    assert calls == [
        "policy.offload_before_refit",
        "policy_generation.prepare_for_generation(['weights'])",
        "receiver.receive",
        "policy.offload_after_refit",
        "policy_generation.prepare_for_generation(['kv_cache'])",
    ]
    assert timer.labels == ["prepare_for_generation/transfer_and_update_weights"]
    assert _equal(trainer, generator)
    assert scales == [({"model.layers.0.self_attn.k_scale": 0.5}, 1)]
    assert not sync.is_stale


def test_a_refused_shard_leaves_the_held_shards_as_they_were() -> None:
    from posttrain.adapters.nemo_rl.weight_sync import ShardAssembler

    model = torch.nn.Linear(2, 2)
    sender, receiver = in_process_weight_sync(model)
    asm = ShardAssembler(sender, 2)
    asm.shard_sender(0).send({"weight": torch.ones(2, 2)}, version=1)
    with pytest.raises(ValueError, match="already sent"):
        asm.shard_sender(0).send({"weight": torch.ones(2, 2)}, version=1)
    asm.shard_sender(0).send({"weight": torch.ones(2, 2)}, version=2)
    with pytest.raises(ValueError, match="held by another shard"):
        asm.shard_sender(1).send({"weight": torch.ones(2, 2), "bias": torch.ones(2)}, version=2)
    with pytest.raises(TypeError, match="non-tensors for \\['bias'\\]"):
        asm.shard_sender(1).send({"bias": [1.0, 1.0]}, version=2)  # type: ignore[dict-item]
    assert receiver.receive(timeout=0) is None
    assert receiver.version == 0
    asm.shard_sender(1).send({"bias": torch.ones(2)}, version=2)  # worker 0's shard was kept
    assert receiver.receive(timeout=0) == 2
    assert model.weight.sum().item() == 4.0
    asm.shard_sender(1).send({"bias": torch.ones(3)}, version=3)
    with pytest.raises(ValueError, match="rejected"):  # the whole fails the receiver's check
        asm.shard_sender(0).send({"weight": torch.ones(2, 2)}, version=3)
    asm.shard_sender(1).send({"bias": torch.ones(2)}, version=3)
    with pytest.raises(ValueError, match="rejected"):
        asm.shard_sender(0).send({"weight": torch.ones(3, 2)}, version=3)
    asm.shard_sender(1).send({"bias": torch.ones(2)}, version=3)  # version 3 again: not spent
    asm.shard_sender(0).send({"weight": torch.ones(2, 2)}, version=3)
    assert receiver.receive(timeout=0) == 3


def test_a_sink_failing_once_does_not_block_the_next_sync() -> None:
    from posttrain.adapters.nemo_rl.weight_sync import NemoShardedWeightSynchronizer, ShardAssembler

    fails = [True]

    def sink(scales: Any, version: int) -> None:
        if fails.pop(0) if fails else False:
            raise OSError("kv-scales sink unavailable")

    trainer, generator = tiny_causal_lm(seed=1), tiny_causal_lm(seed=2)
    sender, receiver = in_process_weight_sync(generator)
    sync = NemoWeightSynchronizer(trainer.state_dict, sender, receiver, kv_scales_sink=sink)
    sync.init_communicator()
    with pytest.raises(OSError, match="unavailable"):
        sync.sync_weights(kv_scales={"k_scale": 1.0})
    assert sync.is_stale
    assert sync.version == 1  # the sender took version 1
    assert sync.sync_weights(kv_scales={"k_scale": 1.0})["weight_version"] == 2.0
    assert not sync.is_stale
    assert receiver.version == 2

    fails[:] = [True]
    trainer, generator = tiny_causal_lm(seed=1), tiny_causal_lm(seed=2)
    sender, receiver = in_process_weight_sync(generator)
    names = sorted(trainer.state_dict())
    workers = [_Worker(trainer, names[i::2]) for i in range(2)]
    sharded = NemoShardedWeightSynchronizer(
        workers, ShardAssembler(sender, 2), receiver, kv_scales_sink=sink
    )
    sharded.init_communicator()
    with pytest.raises(OSError, match="unavailable"):
        sharded.sync_weights(kv_scales={"k_scale": 1.0})
    assert sharded.is_stale
    assert sharded.sync_weights(kv_scales={"k_scale": 1.0})["weight_version"] == 2.0
    assert receiver.version == 2
    assert _equal(trainer, generator)


def test_sharded_synchronizer_checks_the_refit_info_before_the_first_send() -> None:
    from posttrain.adapters.nemo_rl.weight_sync import NemoShardedWeightSynchronizer, ShardAssembler

    trainer, generator = tiny_causal_lm(seed=1), tiny_causal_lm(seed=2)
    sender, receiver = in_process_weight_sync(generator)
    names = sorted(trainer.state_dict())
    workers = [_Worker(trainer, names[i::2]) for i in range(2)]
    asm = ShardAssembler(sender, 2)
    sync = NemoShardedWeightSynchronizer(workers, asm, receiver)
    sync.init_communicator()
    bad = workers[1].state_shard()
    last = sorted(bad)[-1]
    bad[last] = bad[last].double()
    workers[1].state_shard = lambda: bad  # type: ignore[method-assign]
    with pytest.raises(ValueError, match=rf"refit info\), found changes for \['{last}'\]"):
        sync.sync_weights()
    assert asm._pending == {}  # worker 0's shard was never sent
    assert sync.is_stale
    assert receiver.version == 0
