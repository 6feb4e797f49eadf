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
